"""The γ policy for each load, from this machine's γ profile or a quick calibration, beside the
tree sizing (tree_sizing.py): what the scheduler asks each iteration (`policy_for`).

With a profile: one policy per batch size and profiled context (the nearest), with that point's
costs and acceptance as its prior. The draft model's acceptance is learned once per load (per
profiled context), by every batch size's policy: a batch whose rows finish runs at each smaller size
in turn, and a policy of its own per size started each from the prior (demo pair with its EAGLE-3
head, batch 8: the draft model, back at a neutral prior at every size, ranked below the head, whose
acceptance is the load's, and was not tried again). Without one: the costs of a quick calibration at batch 1, run by
`load()` before any request (`calibrate`) and recorded in the bundle for this machine (the next
load reads them, as it reads a Medusa tree's size), carried to each batch size by the cost model
(LoopCosts.at_batch) as a prior that the loop's own measurements correct; `speccompile profile`
measures every batch size in loop runs instead. Either way the same policy decides, from the
requests served at that load and context: a profile only makes its priors right sooner.
"""

import logging
import time
from dataclasses import replace

from speccompile.core.cost_model import LoopCosts
from speccompile.core.gamma_policy import GammaPolicy
from speccompile.runtime.gamma_profile import Calibration, KeptDrafts, find_calibration, write_calibration

log = logging.getLogger("speccompile")
CALIBRATION_REPEATS = 3
GUESSED_PRIOR_WEIGHT = 2.0  # iterations a neutral acceptance prior (no profile measured one) is worth


class LoadPolicies:
    def __init__(self, profile, gammas: list[int], max_batch: int, max_seq: int, head: bool = False,
                 compiled: list[int] | None = None):
        """gammas: those the runtime verifies at; compiled: the bundle's (default: the same). The
        calibration times the compiled γ and the smallest, and fills in the costs of those between
        (LoopCosts.filled): on a session graph every γ is the same call at another width."""
        self.profile, self.gammas, self.max_batch, self.max_seq = profile, gammas, max_batch, max_seq
        self.timed_gammas = sorted({*(compiled or gammas), min(gammas)})
        self.head = head  # the bundle has an EAGLE-3 head, whose calls the costs must price
        self._policies: dict[tuple, GammaPolicy] = {}  # (decoding requests, context point) -> γ policy
        self._acceptance: dict = {}  # context point (None: no profile) -> the draft model's acceptance
        self.calibration: LoopCosts | None = None  # batch-1 costs measured here (no profile, or one without the head's)
        self.calibrated_acceptance: KeptDrafts | None = None  # what the calibration's drafts kept

    @property
    def needs_calibration(self) -> bool:
        """No costs for the policies yet: no profile, or (a bundle with a head) a profile that did not
        time the head, whose drafts would then look free and whose measured calls teach nothing."""
        if self.calibration is not None:
            return False
        return self.profile is None or (self.head and not self._profiled_head)

    @property
    def _profiled_head(self) -> bool:
        point = self.profile.points[0]
        return self.profile.costs(point.batch, point.context).has_head

    def policy_for(self, decoding: int, context: int) -> GammaPolicy | None:
        """The γ policy for `decoding` requests at once whose mean context is `context`."""
        if self.profile is not None:
            point = min(self.profile.context_lengths, key=lambda c: (abs(c - context), c))
            if (decoding, point) not in self._policies:
                costs, acceptance = self.profile.prior(decoding, point)
                if self.head and not costs.has_head and self.calibration is not None:
                    timed = self.calibration.at_batch(decoding)
                    costs = replace(costs, head_step=timed.head_step, head_catch_up=timed.head_catch_up)
                counts = self._acceptance.setdefault(point, GammaPolicy.acceptance_prior(acceptance, max(self.gammas)))
                self._policies[decoding, point] = GammaPolicy(costs, acceptance, counts=counts)
            return self._policies[decoding, point]
        if self.calibration is None:
            return None
        if (decoding, None) not in self._policies:
            prior, weight = self.calibrated_prior()
            counts = self._acceptance.setdefault(None, GammaPolicy.acceptance_prior(prior, max(self.gammas), weight))
            self._policies[decoding, None] = GammaPolicy(self.calibration.at_batch(decoding), prior,
                                                          guessed_prior=not self._calibration_kept, counts=counts)
        return self._policies[decoding, None]

    @property
    def _calibration_kept(self) -> bool:
        """Whether the calibration ran iterations of a draft model (their drafts kept or not)."""
        return bool(self.calibrated_acceptance and self.calibrated_acceptance.kept)

    def calibrated_prior(self) -> tuple[list[float], float]:
        """The draft model's acceptance prior without a profile, P_1..P_γ, and what it is worth in
        iterations: the calibration's iterations on the neutral guess (0.5 at the first position,
        halving, worth GUESSED_PRIOR_WEIGHT iterations), worth as many iterations as it ran; or,
        where none ran (no draft model), the guess alone."""
        gamma = max(self.gammas)
        guess = [0.5**k for k in range(1, gamma + 1)]
        if not self._calibration_kept:
            return guess, GUESSED_PRIOR_WEIGHT
        measured = self.calibrated_acceptance
        counts = GammaPolicy.acceptance_prior(guess, gamma, GUESSED_PRIOR_WEIGHT)
        for accepted in measured.kept:
            counts.observe(measured.gamma, accepted)
        return counts.by_position(gamma), float(len(measured.kept))

    def forget(self) -> None:
        """Forget what the loads' policies learned (acceptance, measured costs): back to their priors."""
        self._policies.clear()
        self._acceptance.clear()

    def calibrate(self, target, draft, bundle_path, fp: dict, eagle=None, tokenizer=None) -> bool:
        """The step costs at batch 1 recorded for this machine (fingerprint `fp`), or timed quickly
        now and recorded (other batch sizes start from the cost model's extrapolation); whether they
        were timed. With an EAGLE-3 head (`eagle`), its step and catch-up too: a record without them
        is timed again, or the head's drafts would look free. With a draft model (and the bundle's
        `tokenizer`), the timing continues the calibration prompt and its rounds' iterations at the
        largest γ keep what the target keeps: the drafts they kept are recorded with the costs
        (`calibrated_prior`). Timing drives the models directly: only with no request in flight."""
        from speccompile.runtime.calibration import Continuation, measure_costs

        found = find_calibration(bundle_path, fp, self.timed_gammas, head=eagle is not None)
        timed = found is None
        if timed:
            began = time.perf_counter()
            prompt = self._acceptance_prompt(draft, tokenizer)
            text = Continuation(prompt) if prompt else None
            context = len(prompt) if prompt else min(64, self.max_seq // 4)
            costs = measure_costs(target, draft, self.timed_gammas, 1, context, repeats=CALIBRATION_REPEATS,
                                  eagle=eagle, text=text)
            found = Calibration(costs, KeptDrafts(max(self.gammas), tuple(text.kept)) if text else None)
            written = write_calibration(bundle_path, fp, found)
            recorded = f", recorded in {written}" if written else ""
            log.debug(f"no γ profile for this hardware in the bundle (`speccompile profile` measures one): calibrated "
                      f"step costs (drafts kept: {found.acceptance}) in {time.perf_counter() - began:.2f} s"
                      f"{recorded}")
        self.calibration = found.costs.filled(self.gammas)
        self.calibrated_acceptance = found.acceptance
        return timed

    def _acceptance_prompt(self, draft, tokenizer) -> list[int]:
        """What the calibration's acceptance iterations continue, also the context its costs are timed
        at: the calibration prompt's last tokens, as many as the usual context (64, or a quarter of
        the cache) and the iterations' room in the cache allow; none without a draft model."""
        from speccompile.runtime.calibration import ACCEPTANCE_PROMPT

        room = self.max_seq - (CALIBRATION_REPEATS + 1) * (max(self.gammas) + 1)
        keep = min(64, self.max_seq // 4, room)
        if draft is None or tokenizer is None or keep < 2:
            return []
        return tokenizer.encode(ACCEPTANCE_PROMPT)[-keep:]
