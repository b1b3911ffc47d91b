/*
 * SpecAccept kernels: the acceptance rule of speculative decoding, one thread block per sequence.
 *
 * The oracle is numpy (speccompile/core/acceptance.py, sampling.py); the tests demand equal integers,
 * so every floating-point step below is the same fp32 operation, in the same order, as numpy's:
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
 */
#include "spec_accept_kernels.h"

#include <cuda_runtime.h>
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

__global__ void greedyAcceptKernel(const float* logits, const int64_t* draftTokens, const int64_t* pastLen, int G,
    int V, int64_t* accepted, int64_t* nextToken, int64_t* newLen)
{
    const int64_t b = blockIdx.x;
    // Positions are scored only up to the first mismatch: the rest cannot change the result.
    for (int j = 0; j <= G; ++j)
    {
        const int target = blockArgmax(logits + (b * (G + 1) + j) * V, V);
        // Every thread sees the same target and draft, so the whole block leaves together.
        if (j == G || draftTokens[b * G + j] != target)
        {
            if (threadIdx.x == 0)
            {
                accepted[b] = j;
                nextToken[b] = target; // the correction, or the bonus token when j == G
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

// n = the leading run of accepts: d_j is kept iff u_j * q_j(d_j) < p_j(d_j), i.e. with probability
// min(1, p_j(d_j) / q_j(d_j)). p, q, draft and u point at this sequence's rows.
__device__ int leadingAccepts(const float* p, const float* q, const int64_t* draft, const float* u, int G, int V)
{
    for (int j = 0; j < G; ++j)
    {
        const int64_t d = draft[j];
        if (d < 0 || d >= V)
            return j; // not a token: rejected (the numpy oracle would raise)
        const int64_t at = static_cast<int64_t>(j) * V + d;
        if (!(__fmul_rn(u[j], q[at]) < p[at]))
            return j;
    }
    return G;
}

__global__ void sampleAcceptKernel(const float* targetProbs, const float* draftProbs, const int64_t* draftTokens,
    const float* uAccept, const float* uSample, const int64_t* pastLen, int G, int V, int64_t* accepted,
    int64_t* nextToken, int64_t* newLen)
{
    __shared__ float stage[kChunk];
    __shared__ int run;
    const int64_t b = blockIdx.x;
    const float* p = targetProbs + b * (G + 1) * V;
    const float* q = draftProbs + b * G * V;
    if (threadIdx.x == 0)
        run = leadingAccepts(p, q, draftTokens + b * G, uAccept + b * G, G, V);
    __syncthreads();
    const int n = run;
    // Rejected at n < γ: draw from the residual max(0, p_n - q_n), the mass p has where q over-proposed.
    // All γ accepted: q_γ := 0, so the residual is p_γ and the bonus token is a plain draw from the target.
    const Weights residual{p + static_cast<int64_t>(n) * V, n < G ? q + static_cast<int64_t>(n) * V : nullptr, true};
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

int launched()
{
    return static_cast<int>(cudaGetLastError());
}

} // namespace

// ---------------------------------------------------------------------------------------------
// C ABI

extern "C" int speccompile_greedy_accept(const float* logits, const int64_t* draft_tokens, const int64_t* past_len,
    int B, int G, int V, int64_t* accepted, int64_t* next_token, int64_t* new_len, cudaStream_t stream)
{
    if (B < 0 || G < 0 || V < 1)
        return cudaErrorInvalidValue;
    if (B == 0)
        return cudaSuccess;
    if (!logits || (G > 0 && !draft_tokens) || !past_len || !accepted || !next_token || !new_len)
        return cudaErrorInvalidValue;
    greedyAcceptKernel<<<B, kThreads, 0, stream>>>(logits, draft_tokens, past_len, G, V, accepted, next_token, new_len);
    return launched();
}

extern "C" int speccompile_sample_accept(const float* target_probs, const float* draft_probs,
    const int64_t* draft_tokens, const float* u_accept, const float* u_sample, const int64_t* past_len, int B, int G,
    int V, int64_t* accepted, int64_t* next_token, int64_t* new_len, cudaStream_t stream)
{
    if (B < 0 || G < 0 || V < 1)
        return cudaErrorInvalidValue;
    if (B == 0)
        return cudaSuccess;
    if (!target_probs || (G > 0 && (!draft_probs || !draft_tokens || !u_accept)) || !u_sample || !past_len
        || !accepted || !next_token || !new_len)
        return cudaErrorInvalidValue;
    sampleAcceptKernel<<<B, kThreads, 0, stream>>>(
        target_probs, draft_probs, draft_tokens, u_accept, u_sample, past_len, G, V, accepted, next_token, new_len);
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
