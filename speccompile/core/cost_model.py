"""The speculative speedup model (Leviathan et al. 2023, §3), with measured costs.

Per iteration the draft runs γ steps and the target one verification of γ+1 tokens; the iteration
emits the accepted drafts plus one target token. With P_k the probability that draft k is accepted
(k = 1..γ; unconditional, so P_1 >= P_2 >= ...):

    E[tokens per iteration] = 1 + sum_k P_k                    (= (1 - α^(γ+1)) / (1 - α) for i.i.d. α)
    time per iteration      = γ · t_draft + t_verify(γ) + t_overhead
    speedup                 = E · t_target / time per iteration

where t_target is one autoregressive target step. The paper assumes t_verify(γ) = t_target ("free
parallel verification"); here t_verify is measured, which is what makes γ hardware-specific.
"""


def expected_tokens(acceptance_by_position: list[float]) -> float:
    """E[tokens emitted per iteration] from per-position (unconditional) acceptance."""
    return 1.0 + sum(acceptance_by_position)


def iid_acceptance_by_position(alpha: float, gamma: int) -> list[float]:
    """P_k = α^k: the paper's i.i.d. acceptance assumption."""
    return [alpha**k for k in range(1, gamma + 1)]


def predicted_speedup(acceptance_by_position: list[float], t_target: float, t_draft: float, t_verify: float,
                      t_overhead: float = 0.0) -> float:
    gamma = len(acceptance_by_position)
    if gamma == 0:
        return 1.0
    return predicted_speedup_mixed(acceptance_by_position, {gamma: 1}, t_target, t_draft, t_verify, t_overhead)


def predicted_speedup_mixed(acceptance_by_position: list[float], gammas_used: dict[int, int], t_target: float,
                            t_draft: float, t_verify: float, t_overhead: float = 0.0) -> float:
    """The speedup of iterations run at several γ (gammas_used: γ -> iterations, as γ = auto runs),
    with t_verify their mean verification time: expected tokens and time per iteration, each
    averaged over the mix. One γ gives predicted_speedup.

    With P_k measured over the iterations that proposed draft k (GenerationStats.acceptance_by_position),
    the mix's expected tokens per iteration equal the measured mean acceptance length:
    sum_γ n_γ (1 + sum_{k<=γ} P_k) = N + sum_k P_k · drafted_k = N + accepted.
    """
    iterations = sum(gammas_used.values())
    if iterations == 0:
        return 1.0
    tokens = sum(n * expected_tokens(acceptance_by_position[:g]) for g, n in gammas_used.items()) / iterations
    mean_gamma = sum(g * n for g, n in gammas_used.items()) / iterations
    iteration = mean_gamma * t_draft + t_verify + t_overhead
    assert iteration > 0, "iteration time must be positive"
    return tokens * t_target / iteration
