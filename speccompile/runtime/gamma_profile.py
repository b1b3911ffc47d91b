"""The γ profile's format and storage: what `speccompile profile` measured on one machine for one
bundle (profile.py measures it), which the runtime reads to choose γ (runtime.py). One module both
sides import: reading a profile drives nothing.
"""

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from speccompile.core.cost_model import LoopCosts
from speccompile.runtime.hardware import fingerprint, fingerprint_key

PROFILES_DIR = "profiles"
PROFILE_VERSION = 3  # 2: costs from loop runs; 3: a list of points, each with its own acceptance
COST_KEYS = ("target_step_ms", "draft_step_ms", "draft_ms", "verify_ms", "overhead_ms")
PER_GAMMA = ("draft_ms", "verify_ms", "acceptance_by_gamma", "predicted_speedup", "measured_speedup",
             "end_to_end_speedup", "tokens_per_iteration")  # {γ: ...} fields, whose keys JSON makes strings


@dataclass
class ProfilePoint:
    """One batch size and context of a γ profile: the loop's costs there (ms per iteration), the
    acceptance seen at each γ, and the speedups predicted and measured (see point_entry)."""

    batch: int
    context: int
    target_step_ms: float
    draft_step_ms: float
    draft_ms: dict[int, float]
    verify_ms: dict[int, float]
    overhead_ms: float
    acceptance_by_gamma: dict[int, list[float]]  # γ -> P_1..P_γ over the runs at that γ
    predicted_speedup: dict[int, float]  # γ (0: plain decoding) -> the γ policy's prediction
    best_gamma: int
    measured_speedup: dict[int, float]  # steady state
    end_to_end_speedup: dict[int, float]
    tokens_per_iteration: dict[int, float]  # measured, per request

    @property
    def acceptance_by_position(self) -> list[float]:
        """P_k at the largest γ (k <= γ: the γ policy's prior at this point)."""
        return self.acceptance_by_gamma[max(self.acceptance_by_gamma)]

    def costs(self) -> LoopCosts:
        return LoopCosts.from_timings({key: getattr(self, key) for key in COST_KEYS})

    @classmethod
    def from_json(cls, fields_: dict) -> "ProfilePoint":
        return cls(**{k: {int(g): v for g, v in value.items()} if k in PER_GAMMA else value
                      for k, value in fields_.items()})


@dataclass
class GammaProfile:
    """What `speccompile profile` measured on one machine (its fingerprint) for one bundle."""

    fingerprint: dict
    key: str
    created: str
    gammas: list[int]
    context_lengths: list[int]
    max_new_tokens: int
    acceptance_by_position: list[float]  # the mean over points (each alike)
    points: list[ProfilePoint]
    p_min: float = 0.0  # the default confidence threshold measured here (0: none paid)
    p_min_speedups: dict[float, float] = field(default_factory=dict)  # p_min -> rate over p_min 0's
    lookup_speedup: float = 0.0  # prompt lookup alone at the first point, over plain decoding
    lookup_priors: dict[int, float] = field(default_factory=dict)  # matched length -> kept rate of its drafts
    version: int = PROFILE_VERSION

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({p.batch for p in self.points})

    def point(self, batch: int, context: int) -> ProfilePoint:
        """The point measured at the batch size closest to `batch` (the smaller on a tie) and this
        profiled context."""
        nearest = min(self.batch_sizes, key=lambda b: (abs(b - batch), b))
        return next(p for p in self.points if p.batch == nearest and p.context == context)

    def costs(self, batch: int, context: int) -> LoopCosts:
        """Loop costs at the batch size closest to `batch`, interpolated linearly between the
        measured contexts (held at the nearest one outside them): attention and cache reads make
        every step grow with context, and a request's costs are those at its own lengths."""
        contexts = sorted(self.context_lengths)
        context = min(max(context, contexts[0]), contexts[-1])
        upper = next(c for c in contexts if c >= context)
        lower = max(c for c in contexts if c <= context)
        w = 0.0 if upper == lower else (context - lower) / (upper - lower)
        return self.point(batch, lower).costs().mix(self.point(batch, upper).costs(), w)

    def prior(self, batch: int, context: int) -> tuple[LoopCosts, list[float]]:
        """A γ policy's start at a batch size and a profiled context: the costs and the acceptance
        by position measured there."""
        return self.costs(batch, context), self.point(batch, context).acceptance_by_position

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, fields_: dict) -> "GammaProfile":
        return cls(**{**fields_, "points": [ProfilePoint.from_json(p) for p in fields_["points"]],
                      "p_min_speedups": {float(p): v for p, v in fields_.get("p_min_speedups", {}).items()},
                      "lookup_priors": {int(n): v for n, v in fields_.get("lookup_priors", {}).items()}})


# ---------------------------------------------------------------------------------------------
# storage: bundle/profiles/<fingerprint key>.json (outside the manifest's integrity list: a bundle
# gains profiles as it meets new hardware)


def write_profile(bundle_path: Path, profile: GammaProfile) -> Path:
    directory = Path(bundle_path) / PROFILES_DIR
    directory.mkdir(exist_ok=True)
    path = directory / f"{profile.key}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=1))
    tmp.replace(path)
    return path


def find_profile(bundle_path: Path, fp: dict | None = None) -> GammaProfile | None:
    """The bundle's profile measured on hardware with this fingerprint, if any. A profile of an
    older format is ignored (version 1's costs were steps timed alone; version 2 kept one acceptance
    for all points): run `speccompile profile` again."""
    fp = fp or fingerprint()
    path = Path(bundle_path) / PROFILES_DIR / f"{fingerprint_key(fp)}.json"
    if not path.is_file():
        return None
    profile = json.loads(path.read_text())
    if profile.get("version") != PROFILE_VERSION or profile.get("fingerprint") != fp:
        return None
    return GammaProfile.from_json(profile)


# ---------------------------------------------------------------------------------------------
# a Medusa bundle's token tree, as sized on one machine (runtime._size_tree)

TREE_PROFILE_VERSION = 1


def tree_profile_path(bundle_path: Path, fp: dict | None = None) -> Path:
    return Path(bundle_path) / PROFILES_DIR / f"tree-{fingerprint_key(fp or fingerprint())}.json"


def write_tree_profile(bundle_path: Path, fp: dict, paths: list, prefix_nodes: dict, sizing: dict) -> Path | None:
    """Record the tree sized here (its paths), the prefix each batch size verifies, and the costs and
    predictions they were chosen by; None where the bundle is read-only (then each process sizes)."""
    path = tree_profile_path(bundle_path, fp)
    entry = {"version": TREE_PROFILE_VERSION, "fingerprint": fp, "tree": paths,
             "prefix_nodes_per_batch": {str(b): n for b, n in prefix_nodes.items()}, "sizing": sizing}
    return _write_record(path, entry)


def _write_record(path: Path, entry: dict) -> Path | None:
    """Write a per-machine record whole (by rename); None where the bundle is read-only."""
    try:
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entry, indent=1))
        tmp.replace(path)
    except OSError:
        return None
    return path


def find_tree_profile(bundle_path: Path, fp: dict) -> tuple[list, dict, dict] | None:
    """(tree paths, prefix nodes per batch size, sizing) recorded on hardware with this fingerprint."""
    path = tree_profile_path(bundle_path, fp)
    if not path.is_file():
        return None
    entry = json.loads(path.read_text())
    if entry.get("version") != TREE_PROFILE_VERSION or entry.get("fingerprint") != fp:
        return None
    return entry["tree"], {int(b): n for b, n in entry["prefix_nodes_per_batch"].items()}, entry["sizing"]


# ---------------------------------------------------------------------------------------------
# a quick calibration's step costs, as measured on one machine (policies.LoadPolicies.calibrate)

CALIBRATION_VERSION = 2  # 2: the draft model's acceptance beside the costs


@dataclass(frozen=True)
class KeptDrafts:
    """Greedy speculative iterations at γ and the drafts each kept (a calibration's, continuing
    calibration.ACCEPTANCE_PROMPT)."""

    gamma: int
    kept: tuple[int, ...]


@dataclass(frozen=True)
class Calibration:
    """What load() measured on one machine without a γ profile: batch-1 step costs and, with a draft
    model, what its drafts kept in the timing's iterations (None: no draft model)."""

    costs: LoopCosts
    acceptance: KeptDrafts | None = None


def calibration_path(bundle_path: Path, fp: dict) -> Path:
    return Path(bundle_path) / PROFILES_DIR / f"calibration-{fingerprint_key(fp)}.json"


def write_calibration(bundle_path: Path, fp: dict, calibration: Calibration) -> Path | None:
    """Record what was measured here; None where the bundle is read-only (then each load measures it)."""
    kept = calibration.acceptance
    entry = {"version": CALIBRATION_VERSION, "fingerprint": fp, "timings": calibration.costs.timings(),
             "acceptance": None if kept is None else {"gamma": kept.gamma, "kept": list(kept.kept)}}
    return _write_record(calibration_path(bundle_path, fp), entry)


def find_calibration(bundle_path: Path, fp: dict, gammas: list[int], head: bool = False) -> Calibration | None:
    """What was recorded on hardware with this fingerprint for these γ; None when there is nothing,
    or what is there is of another version, machine or γ, or not a calibration at all, or (head: the
    bundle has an EAGLE-3 head) has no head's costs (recorded before they were measured)."""
    path = calibration_path(bundle_path, fp)
    try:
        entry = json.loads(path.read_text())
        if entry.get("version") != CALIBRATION_VERSION or entry.get("fingerprint") != fp:
            return None
        costs = LoopCosts.from_timings(entry["timings"])
        recorded = entry["acceptance"]
        kept = None if recorded is None else KeptDrafts(int(recorded["gamma"]), tuple(recorded["kept"]))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if head and not costs.has_head:
        return None
    positive = [costs.target_step, *costs.draft.values(), *costs.verify.values(), costs.head_step, costs.head_catch_up]
    if costs.gammas != sorted(gammas) or not all(isinstance(ms, float) and math.isfinite(ms) and ms >= 0
                                                 for ms in positive):
        return None
    if kept is not None and not all(isinstance(a, int) and 0 <= a <= kept.gamma for a in kept.kept):
        return None
    return Calibration(costs, kept)
