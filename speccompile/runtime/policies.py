"""The γ policy for each load, from this machine's γ profile or a quick calibration, beside the
tree sizing (tree_sizing.py): what the scheduler asks each iteration (`policy_for`).

With a profile: one policy per batch size and profiled context (the nearest), with that point's
costs and acceptance as its prior. Without one: the quick calibration's costs at this batch size
(run `speccompile profile` for γ under load), or None before there is one (the scheduler then runs
the bundle's default γ). Acceptance is learned from the requests served at that load and context.
"""

import logging

from speccompile.core.cost_model import LoopCosts
from speccompile.core.gamma_policy import GammaPolicy

log = logging.getLogger("speccompile")


class LoadPolicies:
    def __init__(self, profile, gammas: list[int], max_batch: int, max_seq: int):
        self.profile, self.gammas, self.max_batch, self.max_seq = profile, gammas, max_batch, max_seq
        self._policies: dict[tuple, GammaPolicy] = {}  # (decoding requests, context point) -> γ policy
        self.calibration: dict[int, LoopCosts] | None = None  # batch size -> costs measured here (no profile)

    @property
    def needs_calibration(self) -> bool:
        return self.profile is None and self.calibration is None

    def policy_for(self, decoding: int, context: int) -> GammaPolicy | None:
        """The γ policy for `decoding` requests at once whose mean context is `context`."""
        if self.profile is not None:
            point = min(self.profile.context_lengths, key=lambda c: (abs(c - context), c))
            if (decoding, point) not in self._policies:
                costs, acceptance = self.profile.prior(decoding, point)
                self._policies[decoding, point] = GammaPolicy(costs, acceptance)
            return self._policies[decoding, point]
        if self.calibration is None:
            return None
        if (decoding, None) not in self._policies:
            prior = [0.5**k for k in range(1, max(self.gammas) + 1)]  # neutral, worth 2 iterations
            self._policies[decoding, None] = GammaPolicy(self._calibrated(decoding), prior, prior_weight=2.0)
        return self._policies[decoding, None]

    def calibrate(self, target, draft) -> None:
        """Time the steps quickly at batch 1 and at the bundle's max batch (costs in between are
        interpolated). It drives the models directly: only with no request in flight."""
        from speccompile.runtime.calibration import measure_costs

        log.warning("no γ profile for this hardware in the bundle (run `speccompile profile`): calibrating quickly")
        context = min(64, self.max_seq // 4)
        self.calibration = {batch: measure_costs(target, draft, self.gammas, batch, context, repeats=3)
                            for batch in sorted({1, self.max_batch})}

    def _calibrated(self, batch: int) -> LoopCosts:
        """Step costs at `batch`, linear between the two calibrated batch sizes."""
        w = 0.0 if self.max_batch == 1 else (batch - 1) / (self.max_batch - 1)
        return self.calibration[1].mix(self.calibration[self.max_batch], w)
