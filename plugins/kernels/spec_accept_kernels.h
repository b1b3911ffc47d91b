/*
 * The speccompile CUDA kernels (SpecAccept, SpecSample, SpecTransform) behind a plain C ABI (no
 * TensorRT dependency).
 *
 * The rules are exactly those of the numpy oracle, speccompile/core/acceptance.py,
 * speccompile/core/sampling.py and speccompile/core/tree.py: same inputs, same integers out (and, for
 * the transform, the same probabilities to within fp32 rounding; for the typical tree rule, the same
 * decisions unless a probability lies within rounding of its threshold). Layouts are dense row-major,
 * B = batch, G = γ (number of draft tokens), R = rows per batch entry, N = nodes of a token tree (the
 * root included), V = vocabulary size. All pointers are device pointers; the
 * work is enqueued on `stream` and the call returns without synchronising.
 *
 * Every function returns 0 (cudaSuccess) when the kernel was enqueued, cudaErrorInvalidValue for
 * bad sizes or missing pointers, or the launch error otherwise (a cudaError_t value as int).
 * B == 0 enqueues nothing and returns 0; with G == 0 the G-sized inputs may be NULL.
 *
 * Row b proposes only its first k = draft_len[b] drafts (0 <= k <= G; values outside are clamped): a
 * batch verified together shares G, its rows need not. The slots after them are padding, never read:
 * neither their draft ids nor their draft probabilities matter.
 */
#ifndef SPECCOMPILE_SPEC_ACCEPT_KERNELS_H
#define SPECCOMPILE_SPEC_ACCEPT_KERNELS_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#if defined(_WIN32)
#define SPECCOMPILE_API __declspec(dllexport)
#else
#define SPECCOMPILE_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Greedy acceptance (`greedy_accept` on target_tokens = argmax(logits, -1)).
 *   t_j      = argmax_v logits[b, j, v]            first maximum on ties (NaN counts as maximal)
 *   accepted = leading run of j < k with draft_tokens[b, j] == t_j
 *   next     = t_accepted                          the correction, or the target's token after d_k
 *   new_len  = past_len + accepted + 1
 * logits [B, G+1, V] fp32, draft_tokens [B, G], draft_len [B], past_len [B] int64; outputs [B] int64.
 */
SPECCOMPILE_API int speccompile_greedy_accept(const float* logits, const int64_t* draft_tokens,
    const int64_t* draft_len, const int64_t* past_len, int B, int G, int V, int64_t* accepted, int64_t* next_token,
    int64_t* new_len, cudaStream_t stream);

/*
 * Speculative sampling (`sample_accept`).
 *   accept d_j (j < k) iff u_accept[b, j] * q_j(d_j) < p_j(d_j); n = leading run of accepts (n <= k)
 *   next ~ max(0, p_n - q_n) with q_k := 0 (after k accepts the draw is from p_k); when that residual
 *          has no mass (p_n == q_n) the draw is from p_n; drawn with u_sample[b] as `sample_from`
 *   new_len = past_len + n + 1
 * target_probs [B, G+1, V], draft_probs [B, G, V], u_accept [B, G], u_sample [B] fp32;
 * draft_tokens [B, G], draft_len [B], past_len [B] int64; outputs [B] int64. A draft id outside [0, V)
 * is rejected.
 */
SPECCOMPILE_API int speccompile_sample_accept(const float* target_probs, const float* draft_probs,
    const int64_t* draft_tokens, const int64_t* draft_len, const float* u_accept, const float* u_sample,
    const int64_t* past_len, int B, int G, int V, int64_t* accepted, int64_t* next_token, int64_t* new_len,
    cudaStream_t stream);

/*
 * Inverse-CDF sampling (`sample_from`): token[b] = #{i : c_i <= uniform[b] * c_{V-1}}, clamped to V-1,
 * with c the inclusive fp32 prefix sums of probs[b, :] in index order. Weights need not be normalised.
 * probs [B, V] fp32, uniform [B] fp32 in [0, 1); token [B] int64.
 */
SPECCOMPILE_API int speccompile_sample(const float* probs, const float* uniform, int B, int V, int64_t* token,
    cudaStream_t stream);

/*
 * Sampling transform (`transform`), row by row: probs[b, r, :] = transform(logits[b, r, :], temperature[b],
 * top_k[b], top_p[b]), the distribution SpecTransform hands to sampling:
 *   temperature == 0  one-hot on the first maximum of the logits (NaN counts as maximal)
 *   otherwise         z = logits / temperature;
 *                     0 < top_k < V: keep z >= the top_k-th largest z (ties kept), the rest drop out;
 *                     softmax;
 *                     top_p < 1: keep probs >= the probability of the m-th most likely token, where
 *                     m = 1 + #{i : c_i < top_p} clamped to V, c the inclusive fp32 prefix sums of the
 *                     probabilities sorted in descending order; renormalise.
 * logits [B, R, V], temperature [B], top_p [B] fp32; top_k [B] int64; probs [B, R, V] fp32 (may be
 * `logits` itself). One thread block per row, B * R <= INT_MAX; any V >= 1 (selection is by radix
 * select, not a sort, so there is no vocabulary limit). R == 0 is a no-op like B == 0.
 * Values match the numpy reference to within fp32 rounding (exp and the softmax sum run in a different
 * order); the kept set matches exactly except when the top-p prefix sum lands within rounding of top_p.
 */
SPECCOMPILE_API int speccompile_transform(const float* logits, const float* temperature, const int64_t* top_k,
    const float* top_p, int B, int R, int V, float* probs, cudaStream_t stream);

/* Per-node state of a tree lives in shared memory: trees have at most this many nodes, the root included. */
#define SPECCOMPILE_MAX_TREE_NODES 1024

/*
 * Token-tree acceptance, greedy rule (`tree_accept` on target_tokens = argmax(logits, -1)). Node i of
 * row b holds tree_tokens[b, i] (node 0: the root, the last accepted token) under tree_parents[i] < i
 * (breadth-first numbering: parents precede children; a node whose parent does not is rejected).
 *   t_i       = argmax_v logits[b, i, v]           first maximum on ties (NaN counts as maximal)
 *   ok_i      = tree_tokens[b, i] == t_{parent(i)} and i <= draft_len[b]    (the root: always)
 *   kept_i    = ok_i and kept_{parent(i)}          the node's whole path is kept
 *   best_node = the kept node of largest tree_depths[i], the lowest index among equals
 *   accepted  = tree_depths[best_node], next = t_best_node, new_len = past_len + accepted + 1
 * logits [B, N, V] fp32; tree_tokens [B, N], draft_len [B], past_len [B], tree_parents [N],
 * tree_depths [N] int64; outputs [B] int64. 1 <= N <= SPECCOMPILE_MAX_TREE_NODES. The ancestor mask the
 * graph also carries is not an argument: the walk follows the parents. Only the rows of kept nodes are read.
 */
SPECCOMPILE_API int speccompile_tree_accept(const float* logits, const int64_t* tree_tokens, const int64_t* draft_len,
    const int64_t* past_len, const int64_t* tree_parents, const int64_t* tree_depths, int B, int N, int V,
    int64_t* accepted, int64_t* next_token, int64_t* new_len, int64_t* best_node, cudaStream_t stream);

/*
 * Token-tree acceptance, typical rule (`typical_accept`): as speccompile_tree_accept, with
 *   ok_i = p_{parent(i)}(tree_tokens[b, i]) > min(epsilon[b], delta[b] * exp(-H(p_{parent(i)}))) and i <= draft_len[b]
 * where p_j = softmax(logits[b, j]) and H its entropy in nats. A token outside [0, V) is rejected.
 * epsilon [B], delta [B] fp32. The softmax sums and the entropy accumulate in double (the reference
 * works in float64), so a decision can differ from it only where p lies within rounding of the threshold.
 */
SPECCOMPILE_API int speccompile_tree_typical_accept(const float* logits, const int64_t* tree_tokens,
    const int64_t* draft_len, const int64_t* past_len, const int64_t* tree_parents, const int64_t* tree_depths,
    const float* epsilon, const float* delta, int B, int N, int V, int64_t* accepted, int64_t* next_token,
    int64_t* new_len, int64_t* best_node, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* SPECCOMPILE_SPEC_ACCEPT_KERNELS_H */
