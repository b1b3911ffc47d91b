/*
 * speccompile kernels: the acceptance rule of speculative decoding (SpecAccept, on a chain of drafts or
 * a token tree) and inverse-CDF sampling (SpecSample), one thread block per sequence; the sampling
 * transform (SpecTransform), one per row.
 *
 * The oracle is numpy (speccompile/core/acceptance.py, sampling.py, tree.py); the tests demand equal
 * integers, so every floating-point step below is the same fp32 operation, in the same order, as
 * numpy's (the transform's softmax and the typical tree rule excepted, see their sections):
 * products and differences use the _rn intrinsics (never contracted into an FMA), prefix sums run in
 * index order on one thread, and this file must not be built with --use_fast_math (it flushes
 * denormals and would change the bits).
 *
 * Greedy is lossless by construction: the target scored [last, d_1..d_γ] in one pass, so t_j is the
 * token the target itself would emit after input j. A draft is kept only while it equals the target's
 * own choice, so every emitted token is a target argmax given a target-greedy prefix.
 *
 * Sampling keeps the target distribution exactly (Leviathan et al. 2023; Chen et al. 2023): accept
 * d ~ q with probability min(1, p(d)/q(d)), else draw from r = max(0, p - q) / sum(max(0, p - q)).
 *   P(emit x) = q(x) min(1, p(x)/q(x)) + P(reject) r(x)
 *             = min(p(x), q(x)) + (1 - sum_y min(p(y), q(y))) max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y))
 *             = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x),
 * because sum_y max(0, p - q) = 1 - sum_y min(p, q). With u ~ U[0, 1), "u q(d) < p(d)" is that accept.
 *
 * A row with k = draft_len[b] < γ real drafts is verified as at γ = k: the target is causal, so its
 * scores at inputs 0..k never saw the pads after d_k, and the kernels read no pad slot (see
 * speccompile/core/acceptance.py).
 */
#include "spec_accept_kernels.h"

#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>

namespace
{

constexpr int kThreads = 256; // per block; one block per sequence; a multiple of 32
constexpr int kChunk = 2048;  // weights staged in shared memory per step of an in-order scan

// ---------------------------------------------------------------------------------------------
// Argmax over a row (greedy)

struct Best
{
    float value;
    int index;
};

// numpy / ONNX ArgMax order: NaN counts as the maximum, and among equal values the first index wins.
__device__ Best better(Best a, Best b)
{
    const bool aNan = isnan(a.value), bNan = isnan(b.value);
    if (aNan || bNan)
        return (aNan && (!bNan || a.index < b.index)) ? a : b;
    return (a.value > b.value || (a.value == b.value && a.index < b.index)) ? a : b;
}

__device__ Best warpBest(Best x)
{
    for (int offset = 16; offset > 0; offset /= 2)
    {
        const Best other{__shfl_down_sync(0xffffffffu, x.value, offset), __shfl_down_sync(0xffffffffu, x.index, offset)};
        x = better(x, other);
    }
    return x;
}

// Index of the row's first maximum, returned to every thread of the block.
__device__ int blockArgmax(const float* row, int V)
{
    __shared__ Best warps[kThreads / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    Best mine{-INFINITY, V}; // index V: loses every tie, so even an all -inf row yields index 0
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        mine = better(mine, Best{row[i], i});
    mine = warpBest(mine);
    if (lane == 0)
        warps[warp] = mine;
    __syncthreads();
    if (warp == 0)
    {
        mine = lane < blockDim.x / 32 ? warps[lane] : Best{-INFINITY, V};
        mine = warpBest(mine);
        if (lane == 0)
            warps[0] = mine;
    }
    __syncthreads();
    const int best = warps[0].index;
    __syncthreads(); // everyone has read warps[0] before the next call overwrites it
    return best;
}

// k = draft_len clamped to [0, G]: how many of the row's G draft slots are real drafts.
__device__ int realDrafts(const int64_t* draftLen, int64_t b, int G)
{
    const int64_t k = draftLen[b];
    return k < 0 ? 0 : (k > G ? G : static_cast<int>(k));
}

__global__ void greedyAcceptKernel(const float* logits, const int64_t* draftTokens, const int64_t* draftLen,
    const int64_t* pastLen, int G, int V, int64_t* accepted, int64_t* nextToken, int64_t* newLen)
{
    const int64_t b = blockIdx.x;
    const int k = realDrafts(draftLen, b, G);
    // Positions are scored only up to the first mismatch or the last real draft: the rest cannot change the result.
    for (int j = 0; j <= k; ++j)
    {
        const int target = blockArgmax(logits + (b * (G + 1) + j) * V, V);
        // Every thread sees the same target and draft, so the whole block leaves together.
        if (j == k || draftTokens[b * G + j] != target)
        {
            if (threadIdx.x == 0)
            {
                accepted[b] = j;
                nextToken[b] = target; // the correction, or the target's own token after d_k
                newLen[b] = pastLen[b] + j + 1;
            }
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Inverse-CDF sampling (speculative sampling and plain sampling)

// The weights of the distribution to draw from, one per token: p itself, or the residual
// max(0, p - q), where q == nullptr stands for q := 0 (the bonus position).
struct Weights
{
    const float* p;
    const float* q;
    bool residual;

    __device__ float operator()(int i) const
    {
        if (!residual)
            return p[i];
        const float d = __fsub_rn(p[i], q ? q[i] : 0.0f);
        return (d > 0.0f || isnan(d)) ? d : 0.0f; // np.maximum(d, 0): NaN propagates
    }
};

// Hand w(0), w(1), ..., w(V-1) to `visit` in index order, on thread 0. The block stages each chunk in
// shared memory (coalesced loads) and one thread consumes it: fp32 addition is not associative, so a
// parallel scan would round differently from numpy's cumsum (a sequential accumulate) and could move
// the drawn token across a CDF boundary. The serial chain of V adds is the price of bit-exactness;
// rows still run in parallel, one block each.
template <typename Visit>
__device__ void visitInOrder(Weights w, int V, float* stage, Visit visit)
{
    for (int base = 0; base < V; base += kChunk)
    {
        const int n = min(kChunk, V - base);
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            stage[i] = w(base + i);
        __syncthreads();
        if (threadIdx.x == 0)
        {
#pragma unroll 8
            for (int i = 0; i < n; ++i)
                visit(stage[i]);
        }
        __syncthreads();
    }
}

// `sample_from`: token = #{i : c_i <= u * c_{V-1}}, clamped to V-1, with c the inclusive fp32 prefix
// sums. A zero-weight token is never drawn: its c_i equals c_{i-1}. The result is valid on thread 0.
__device__ int64_t sampleRow(Weights w, int V, float u, float* stage)
{
    float total = 0.0f;
    visitInOrder(w, V, stage, [&](float x) { total = __fadd_rn(total, x); });
    const float scaled = __fmul_rn(u, total);
    float c = 0.0f;
    int64_t count = 0;
    visitInOrder(w, V, stage, [&](float x) {
        c = __fadd_rn(c, x);
        count += c <= scaled;
    });
    return count < V ? count : V - 1;
}

// The oracle tests residual.sum() > 0. Every term is >= 0, and a round-to-nearest sum of non-negative
// terms never falls below its largest term, so the sum is positive iff some term is, unless a NaN
// poisons it. (Returned to every thread.)
__device__ bool hasMass(Weights r, int V)
{
    bool positive = false, nan = false;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
    {
        const float x = r(i);
        positive |= x > 0.0f;
        nan |= isnan(x) != 0;
    }
    const bool anyPositive = __syncthreads_or(positive) != 0;
    const bool anyNan = __syncthreads_or(nan) != 0;
    return anyPositive && !anyNan;
}

// n = the leading run of accepts among the k real drafts: d_j is kept iff u_j * q_j(d_j) < p_j(d_j), i.e. with
// probability min(1, p_j(d_j) / q_j(d_j)). p, q, draft and u point at this sequence's rows.
__device__ int leadingAccepts(const float* p, const float* q, const int64_t* draft, const float* u, int k, int V)
{
    for (int j = 0; j < k; ++j)
    {
        const int64_t d = draft[j];
        if (d < 0 || d >= V)
            return j; // not a token: rejected (the numpy oracle would raise)
        const int64_t at = static_cast<int64_t>(j) * V + d;
        if (!(__fmul_rn(u[j], q[at]) < p[at]))
            return j;
    }
    return k;
}

__global__ void sampleAcceptKernel(const float* targetProbs, const float* draftProbs, const int64_t* draftTokens,
    const int64_t* draftLen, const float* uAccept, const float* uSample, const int64_t* pastLen, int G, int V,
    int64_t* accepted, int64_t* nextToken, int64_t* newLen)
{
    __shared__ float stage[kChunk];
    __shared__ int run;
    const int64_t b = blockIdx.x;
    const int k = realDrafts(draftLen, b, G);
    const float* p = targetProbs + b * (G + 1) * V;
    const float* q = draftProbs + b * G * V;
    if (threadIdx.x == 0)
        run = leadingAccepts(p, q, draftTokens + b * G, uAccept + b * G, k, V); // only the k real drafts
    __syncthreads();
    const int n = run;
    // Rejected at n < k: draw from the residual max(0, p_n - q_n), the mass p has where q over-proposed.
    // All k accepted: q_k := 0 (slot k, if any, is a pad), so the residual is p_k: a plain draw from the target.
    const Weights residual{p + static_cast<int64_t>(n) * V, n < k ? q + static_cast<int64_t>(n) * V : nullptr, true};
    // p_n == q_n leaves no residual (rejection then had probability 0); like the oracle, draw from p_n.
    const Weights weights = hasMass(residual, V) ? residual : Weights{residual.p, nullptr, false};
    const int64_t token = sampleRow(weights, V, uSample[b], stage);
    if (threadIdx.x == 0)
    {
        accepted[b] = n;
        nextToken[b] = token;
        newLen[b] = pastLen[b] + n + 1;
    }
}

__global__ void sampleKernel(const float* probs, const float* uniform, int V, int64_t* token)
{
    __shared__ float stage[kChunk];
    const int64_t b = blockIdx.x;
    const int64_t t = sampleRow(Weights{probs + b * V, nullptr, false}, V, uniform[b], stage);
    if (threadIdx.x == 0)
        token[b] = t;
}

// ---------------------------------------------------------------------------------------------
// Sampling transform (temperature, top-k, top-p), one thread block per row
//
// Both cut-offs are value thresholds, found without sorting the row:
//  - top-k: the k-th largest z, by radix select on the order-preserving uint32 image of the floats
//    (four 8-bit passes of a 256-bin histogram, each over the whole row). Exact, any V.
//  - top-p: m = 1 + #{i : c_i < p} needs the prefix sums c of the probabilities in descending order,
//    summed like np.cumsum: sequentially, in fp32. The row is consumed from the top in chunks: radix
//    select finds the kTopPChunk-th largest key below the previous chunk, the keys above it (and below
//    that chunk) are gathered into shared memory and bitonic-sorted, and thread 0 adds them in order,
//    then the copies of the selected key itself (the ties, however many). Equal values sum the same in any
//    order, so this is numpy's sum bit for bit on the same probabilities. It stops at the first
//    c_i >= p (threshold: that value) or as soon as an addition no longer changes c (every later value
//    is no larger, so c can never reach p: m = V, the threshold is the smallest value, all are kept).
//    A peaked distribution finishes in the first chunk; each further chunk costs five more passes.
// Nothing holds a whole row, so there is no vocabulary limit beyond V fitting an int. The softmax sum
// runs as a block reduction, not in numpy's pairwise order, and expf is not numpy's exp, so the
// probabilities agree to fp32 rounding, not bit for bit.

constexpr int kTopPChunk = 4096;           // keys sorted per step of the top-p walk: 16 KiB of shared memory
constexpr uint32_t kNoBound = 0xffffffffu; // above every key orderKey() produces

// a > b  <=>  orderKey(a) > orderKey(b) for non-NaN floats (-0 sits just below +0, which compare equal
// as floats anyway). NaN maps to 0, below everything: where np.sort leaves it in a descending sort.
__device__ uint32_t orderKey(float x)
{
    if (isnan(x))
        return 0u;
    const uint32_t bits = __float_as_uint(x);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ float keyValue(uint32_t key)
{
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// numpy's max: a NaN wins.
struct MaxOf
{
    __device__ float operator()(float a, float b) const
    {
        return (isnan(a) || a > b) ? a : b;
    }
};

struct SumOf
{
    __device__ float operator()(float a, float b) const
    {
        return __fadd_rn(a, b);
    }
};

struct SumOfDouble
{
    __device__ double operator()(double a, double b) const
    {
        return __dadd_rn(a, b);
    }
};

// Reduce one value per thread over the block; the result goes to every thread.
template <typename T, typename Op>
__device__ T blockReduce(T x, Op op, T identity)
{
    __shared__ T partial[kThreads / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int offset = 16; offset > 0; offset /= 2)
        x = op(x, __shfl_down_sync(0xffffffffu, x, offset));
    if (lane == 0)
        partial[warp] = x;
    __syncthreads();
    if (warp == 0)
    {
        x = lane < kThreads / 32 ? partial[lane] : identity;
        for (int offset = 16; offset > 0; offset /= 2)
            x = op(x, __shfl_down_sync(0xffffffffu, x, offset));
        if (lane == 0)
            partial[0] = x;
    }
    __syncthreads();
    const T result = partial[0];
    __syncthreads(); // everyone has read partial[0] before the next call overwrites it
    return result;
}

struct Selection
{
    uint32_t key; // the k-th largest key below the bound
    int above;    // keys in (key, bound)
    int equal;    // keys == key
};

// The k-th largest of the keys below `bound` (1 <= k <= their number), MSB first: each pass counts the
// candidates still sharing the digits chosen so far in a 256-bin histogram and picks the digit holding
// the k-th. keyOf(i) must return the same key on every call. The result goes to every thread.
template <typename KeyOf>
__device__ Selection selectKth(KeyOf keyOf, int V, uint32_t bound, int k)
{
    __shared__ int histogram[256];
    __shared__ Selection chosen;
    if (threadIdx.x == 0)
        chosen = Selection{0u, 0, 0};
    uint32_t prefix = 0u, mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8)
    {
        for (int i = threadIdx.x; i < 256; i += blockDim.x)
            histogram[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += blockDim.x)
        {
            const uint32_t key = keyOf(i);
            if (key < bound && (key & mask) == prefix)
                atomicAdd(&histogram[(key >> shift) & 0xffu], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0)
        {
            int digit = 255, above = chosen.above;
            while (digit > 0 && above + histogram[digit] < k)
                above += histogram[digit--];
            chosen = Selection{prefix | (static_cast<uint32_t>(digit) << shift), above, histogram[digit]};
        }
        __syncthreads();
        prefix = chosen.key;
        mask |= 0xffu << shift;
    }
    const Selection result = chosen;
    __syncthreads(); // everyone has read `chosen` before the next call resets it
    return result;
}

// Sort keys[0, count) in descending order (bitonic network; count <= kTopPChunk).
__device__ void sortDescending(uint32_t* keys, int count)
{
    int n = 1;
    while (n < count)
        n *= 2;
    for (int i = count + threadIdx.x; i < n; i += blockDim.x)
        keys[i] = 0u; // padding sinks to the end
    __syncthreads();
    for (int size = 2; size <= n; size *= 2)
    {
        for (int stride = size / 2; stride > 0; stride /= 2)
        {
            for (int i = threadIdx.x; i < n / 2; i += blockDim.x)
            {
                const int a = 2 * i - (i & (stride - 1)), b = a + stride;
                const bool descending = (a & size) == 0; // the last merge (size == n) is descending throughout
                const uint32_t ka = keys[a], kb = keys[b];
                if ((ka < kb) == descending)
                {
                    keys[a] = kb;
                    keys[b] = ka;
                }
            }
            __syncthreads();
        }
    }
}

// The top-p threshold of a row of probabilities: the probability of the m-th most likely token,
// m = 1 + #{i : c_i < topP} clamped to V, c the inclusive fp32 prefix sums in descending value order.
// 0 when that is the smallest probability (everything is kept). Returned to every thread.
__device__ float topPThreshold(const float* probs, int V, float topP, uint32_t* chunk)
{
    __shared__ int gathered;
    __shared__ int decided;
    __shared__ float threshold;
    const auto keyOf = [probs](int i) { return orderKey(probs[i]); };
    float c = 0.0f; // the running prefix sum, on thread 0
    uint32_t bound = kNoBound; // keys >= bound are summed already
    int consumed = 0;
    while (true)
    {
        // Every thread runs the same iterations: the exit is decided on thread 0 and read back from shared.
        const Selection s = selectKth(keyOf, V, bound, min(kTopPChunk, V - consumed));
        if (threadIdx.x == 0)
            gathered = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += blockDim.x)
        {
            const uint32_t key = keyOf(i);
            if (key > s.key && key < bound)
                chunk[atomicAdd(&gathered, 1)] = key; // s.above < kTopPChunk of them
        }
        __syncthreads();
        sortDescending(chunk, s.above);
        if (threadIdx.x == 0)
        {
            // Adds x to c; true once the answer is known.
            auto add = [&](float x) {
                const float next = __fadd_rn(c, x);
                if (next >= topP)
                {
                    threshold = x; // c_i >= p first here: m = i + 1
                    return true;
                }
                if (next == c)
                {
                    threshold = 0.0f; // c is stuck below p: m = V, keep everything
                    return true;
                }
                c = next;
                return false;
            };
            bool done = false;
            for (int j = 0; j < s.above && !done; ++j)
                done = add(keyValue(chunk[j]));
            const float tie = keyValue(s.key);
            for (int j = 0; j < s.equal && !done; ++j)
                done = add(tie);
            if (!done && consumed + s.above + s.equal >= V)
            {
                threshold = 0.0f; // c never reached p: m = V
                done = true;
            }
            decided = done;
        }
        __syncthreads();
        if (decided)
            break;
        consumed += s.above + s.equal;
        bound = s.key;
    }
    return threshold; // written before the last __syncthreads, not written again
}

__global__ void transformKernel(const float* logits, const float* temperature, const int64_t* topK, const float* topP,
    int R, int V, float* probs)
{
    __shared__ uint32_t chunk[kTopPChunk];
    const int64_t row = blockIdx.x;
    const int64_t b = row / R;
    const float* x = logits + row * V;
    float* out = probs + row * V; // may be x: x[i] is last read by the thread that overwrites it, after all other reads
    const float t = temperature[b];
    if (t == 0.0f)
    {
        // Greedy: one-hot on the first maximum of the logits.
        const int best = blockArgmax(x, V);
        for (int i = threadIdx.x; i < V; i += blockDim.x)
            out[i] = i == best ? 1.0f : 0.0f;
        return;
    }
    const auto z = [x, t](int i) { return __fdiv_rn(x[i], t); };
    // top-k: keep z >= the k-th largest z
    const int64_t k = topK[b];
    const bool cut = 0 < k && k < V;
    const auto zKey = [&z](int i) { return orderKey(z(i)); };
    const float kth = cut ? keyValue(selectKth(zKey, V, kNoBound, static_cast<int>(k)).key) : -INFINITY;
    const auto masked = [&](int i) {
        const float zi = z(i);
        return (!cut || zi >= kth) ? zi : -INFINITY; // np.where(z >= kth, z, -inf)
    };
    // softmax: exp(z - max) / sum
    float m = -INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        m = MaxOf{}(m, masked(i));
    m = blockReduce(m, MaxOf{}, -INFINITY);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
    {
        const float e = expf(__fsub_rn(masked(i), m));
        out[i] = e;
        sum = __fadd_rn(sum, e);
    }
    sum = blockReduce(sum, SumOf{}, 0.0f);
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        out[i] = __fdiv_rn(out[i], sum); // each thread divides what it wrote
    const float p = topP[b];
    if (!(p < 1.0f))
        return;
    // top-p: keep probs >= the threshold, renormalise
    __syncthreads(); // the whole row is written before anyone walks it
    const float threshold = topPThreshold(out, V, p, chunk);
    sum = 0.0f;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
    {
        const float kept = out[i] >= threshold ? out[i] : 0.0f;
        out[i] = kept;
        sum = __fadd_rn(sum, kept);
    }
    sum = blockReduce(sum, SumOf{}, 0.0f);
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        out[i] = __fdiv_rn(out[i], sum);
}

// ---------------------------------------------------------------------------------------------
// Token trees (speccompile/core/tree.py), one thread block per sequence
//
// Node i's path is kept iff every node on it passes its check against its parent's row, so walking
// the nodes in index order (parents precede children) decides each from its parent alone:
// kept_i = ok_i && kept_parent(i). The block scores a row only once its node is known to be kept: a
// rejected node's children are rejected whatever its row says, and it cannot be the answer. Per node,
// the block reduces over V (argmax; for the typical rule the softmax sums too) and thread 0 does the
// O(1) check, so a tree costs (kept nodes) row passes plus N barriers.
//
// The typical rule thresholds a probability, so it cannot be bit-exact against the float64 reference
// whatever the order of operations; its sums accumulate in double to keep the disagreement to
// probabilities within rounding of the threshold.

constexpr int kMaxTreeNodes = SPECCOMPILE_MAX_TREE_NODES;

// What the typical rule checks a node's children against: p(v) = exp(x_v - max) / sum.
struct RowStats
{
    float max;        // the row's maximum logit (NaN if any logit is)
    double sum;       // sum_v exp(x_v - max)
    double threshold; // min(ε, δ·exp(-H(p)))
};

// np.minimum: a NaN on either side wins.
__device__ double minimumOf(double a, double b)
{
    return (isnan(a) || a < b) ? a : b;
}

// exp(x - max) as every thread computes it for the sum, so p of a single token agrees with the sum it
// is divided by (a one-hot row gives exactly 1).
__device__ float shiftedExp(float x, float max)
{
    return expf(__fsub_rn(x, max));
}

// H = log(sum) - sum_v e_v (x_v - max) / sum, which is -sum_v p_v log p_v without a log per token. A
// token with e_v = 0 (a -inf logit, or one far enough below the max to underflow) adds nothing, as
// p log p -> 0 (the reference clamps p to 1e-30 inside its log: the same to rounding). A NaN or +inf
// logit makes the sum NaN, so every child fails its check, as in the reference. Returned to every thread.
__device__ RowStats rowStats(const float* row, int V, float max, float epsilon, float delta)
{
    double sum = 0.0, weighted = 0.0;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
    {
        const float shifted = __fsub_rn(row[i], max);
        const float e = expf(shifted);
        sum = __dadd_rn(sum, e);
        if (e > 0.0f)
            weighted = __dadd_rn(weighted, __dmul_rn(e, shifted));
    }
    sum = blockReduce(sum, SumOfDouble{}, 0.0);
    weighted = blockReduce(weighted, SumOfDouble{}, 0.0);
    const double entropy = __dsub_rn(log(sum), __ddiv_rn(weighted, sum));
    return RowStats{max, sum, minimumOf(epsilon, __dmul_rn(delta, exp(-entropy)))};
}

// Nodes 0..last are verified: i <= draft_len[b], and the root always.
__device__ int lastRealNode(const int64_t* draftLen, int64_t b, int N)
{
    const int64_t k = draftLen[b];
    return k < 0 ? 0 : (k >= N ? N - 1 : static_cast<int>(k));
}

// Whether node i > 0 is kept, on thread 0: its parent precedes it and is kept, and the node passes the
// rule's check against the parent's row. `rows` is the sequence's logits [N, V].
template <bool Typical>
__device__ bool keepsNode(int i, const int64_t* parents, const int64_t* tokens, const bool* kept, const int* target,
    const RowStats* stats, const float* rows, int V)
{
    const int64_t parent = parents[i];
    if (parent < 0 || parent >= i || !kept[parent])
        return false; // a parent after its child is no breadth-first tree: rejected rather than read out of order
    const int64_t token = tokens[i];
    if (!Typical)
        return token == target[parent]; // the target's own choice after the parent
    if (token < 0 || token >= V)
        return false; // not a token: rejected (the numpy reference would raise)
    const RowStats s = stats[parent];
    const float e = shiftedExp(rows[parent * V + token], s.max);
    return __ddiv_rn(e, s.sum) > s.threshold;
}

template <bool Typical>
__global__ void treeAcceptKernel(const float* logits, const int64_t* treeTokens, const int64_t* draftLen,
    const int64_t* pastLen, const int64_t* parents, const int64_t* depths, const float* epsilon, const float* delta,
    int N, int V, int64_t* accepted, int64_t* nextToken, int64_t* newLen, int64_t* bestNode)
{
    __shared__ bool kept[kMaxTreeNodes];
    __shared__ int target[kMaxTreeNodes];                 // t_i, written for kept nodes only
    __shared__ RowStats stats[Typical ? kMaxTreeNodes : 1]; // typical rule only
    const int64_t b = blockIdx.x;
    const float* rows = logits + b * N * V;
    const int64_t* tokens = treeTokens + b * N;
    const int last = lastRealNode(draftLen, b, N);
    int best = 0; // on thread 0: the first deepest kept node so far
    for (int i = 0; i <= last; ++i)
    {
        if (threadIdx.x == 0)
            kept[i] = i == 0 || keepsNode<Typical>(i, parents, tokens, kept, target, stats, rows, V);
        __syncthreads();
        if (!kept[i])
            continue; // every thread reads the same kept[i]: the block stays together
        const float* row = rows + static_cast<int64_t>(i) * V;
        const int t = blockArgmax(row, V);
        RowStats s{};
        if (Typical)
            s = rowStats(row, V, row[t], epsilon[b], delta[b]); // the first maximum is the maximum
        if (threadIdx.x == 0)
        {
            // Only thread 0 reads these back, so no barrier is needed before the next node's check.
            target[i] = t;
            if (Typical)
                stats[i] = s;
            if (depths[i] > depths[best])
                best = i; // strictly deeper: among equals the lowest index stays, as ArgMax's first maximum
        }
    }
    if (threadIdx.x == 0)
    {
        accepted[b] = depths[best];
        nextToken[b] = target[best]; // the target's own token after the accepted path
        newLen[b] = pastLen[b] + depths[best] + 1;
        bestNode[b] = best;
    }
}

int launched()
{
    return static_cast<int>(cudaGetLastError());
}

template <bool Typical>
int treeAccept(const float* logits, const int64_t* treeTokens, const int64_t* draftLen, const int64_t* pastLen,
    const int64_t* parents, const int64_t* depths, const float* epsilon, const float* delta, int B, int N, int V,
    int64_t* accepted, int64_t* nextToken, int64_t* newLen, int64_t* bestNode, cudaStream_t stream)
{
    if (B < 0 || N < 1 || N > kMaxTreeNodes || V < 1)
        return cudaErrorInvalidValue;
    if (B == 0)
        return cudaSuccess;
    if (!logits || !treeTokens || !draftLen || !pastLen || !parents || !depths || (Typical && (!epsilon || !delta))
        || !accepted || !nextToken || !newLen || !bestNode)
        return cudaErrorInvalidValue;
    treeAcceptKernel<Typical><<<B, kThreads, 0, stream>>>(logits, treeTokens, draftLen, pastLen, parents, depths,
        epsilon, delta, N, V, accepted, nextToken, newLen, bestNode);
    return launched();
}

} // namespace

// ---------------------------------------------------------------------------------------------
// C ABI

extern "C" int speccompile_greedy_accept(const float* logits, const int64_t* draft_tokens, const int64_t* draft_len,
    const int64_t* past_len, int B, int G, int V, int64_t* accepted, int64_t* next_token, int64_t* new_len,
    cudaStream_t stream)
{
    if (B < 0 || G < 0 || V < 1)
        return cudaErrorInvalidValue;
    if (B == 0)
        return cudaSuccess;
    if (!logits || (G > 0 && !draft_tokens) || !draft_len || !past_len || !accepted || !next_token || !new_len)
        return cudaErrorInvalidValue;
    greedyAcceptKernel<<<B, kThreads, 0, stream>>>(
        logits, draft_tokens, draft_len, past_len, G, V, accepted, next_token, new_len);
    return launched();
}

extern "C" int speccompile_sample_accept(const float* target_probs, const float* draft_probs,
    const int64_t* draft_tokens, const int64_t* draft_len, const float* u_accept, const float* u_sample,
    const int64_t* past_len, int B, int G, int V, int64_t* accepted, int64_t* next_token, int64_t* new_len,
    cudaStream_t stream)
{
    if (B < 0 || G < 0 || V < 1)
        return cudaErrorInvalidValue;
    if (B == 0)
        return cudaSuccess;
    if (!target_probs || (G > 0 && (!draft_probs || !draft_tokens || !u_accept)) || !draft_len || !u_sample
        || !past_len || !accepted || !next_token || !new_len)
        return cudaErrorInvalidValue;
    sampleAcceptKernel<<<B, kThreads, 0, stream>>>(target_probs, draft_probs, draft_tokens, draft_len, u_accept,
        u_sample, past_len, G, V, accepted, next_token, new_len);
    return launched();
}

extern "C" int speccompile_sample(
    const float* probs, const float* uniform, int B, int V, int64_t* token, cudaStream_t stream)
{
    if (B < 0 || V < 1)
        return cudaErrorInvalidValue;
    if (B == 0)
        return cudaSuccess;
    if (!probs || !uniform || !token)
        return cudaErrorInvalidValue;
    sampleKernel<<<B, kThreads, 0, stream>>>(probs, uniform, V, token);
    return launched();
}

extern "C" int speccompile_transform(const float* logits, const float* temperature, const int64_t* top_k,
    const float* top_p, int B, int R, int V, float* probs, cudaStream_t stream)
{
    if (B < 0 || R < 0 || V < 1)
        return cudaErrorInvalidValue;
    if (B == 0 || R == 0)
        return cudaSuccess;
    if (!logits || !temperature || !top_k || !top_p || !probs)
        return cudaErrorInvalidValue;
    if (static_cast<int64_t>(B) * R > INT_MAX) // one block per row; gridDim.x is at most 2^31 - 1
        return cudaErrorInvalidValue;
    transformKernel<<<B * R, kThreads, 0, stream>>>(logits, temperature, top_k, top_p, R, V, probs);
    return launched();
}

extern "C" int speccompile_tree_accept(const float* logits, const int64_t* tree_tokens, const int64_t* draft_len,
    const int64_t* past_len, const int64_t* tree_parents, const int64_t* tree_depths, int B, int N, int V,
    int64_t* accepted, int64_t* next_token, int64_t* new_len, int64_t* best_node, cudaStream_t stream)
{
    return treeAccept<false>(logits, tree_tokens, draft_len, past_len, tree_parents, tree_depths, nullptr, nullptr, B,
        N, V, accepted, next_token, new_len, best_node, stream);
}

extern "C" int speccompile_tree_typical_accept(const float* logits, const int64_t* tree_tokens,
    const int64_t* draft_len, const int64_t* past_len, const int64_t* tree_parents, const int64_t* tree_depths,
    const float* epsilon, const float* delta, int B, int N, int V, int64_t* accepted, int64_t* next_token,
    int64_t* new_len, int64_t* best_node, cudaStream_t stream)
{
    return treeAccept<true>(logits, tree_tokens, draft_len, past_len, tree_parents, tree_depths, epsilon, delta, B, N,
        V, accepted, next_token, new_len, best_node, stream);
}
