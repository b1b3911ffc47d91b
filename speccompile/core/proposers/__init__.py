"""Who proposes a request's drafts: one object per request (base.Proposer), of a kind registered here.

- "draft": the bundle's draft model (draft_model.py).
- "ngram": prompt lookup in the request's own text (lookup.py).
- "suffix": suffix decoding over the request's text and earlier requests' outputs (suffix.py).
- "medusa": a Medusa bundle's heads, proposing token trees (medusa.py).
- "eagle": an EAGLE-3 head drafting from the target's own features (eagle.py).
- "eagle_tree": the head's dynamic token trees (EAGLE-2) where a request decodes alone (eagle_tree.py).
- "auto": per iteration, the member predicted fastest (auto.py); on a Medusa bundle, the heads.

Adding a proposer: a module with its `Proposer` subclass and one `Kind` entry in `KINDS` below.
"""

from collections.abc import Callable
from dataclasses import dataclass

from speccompile.core.proposers.auto import Auto
from speccompile.core.proposers.base import Offer, Proposer, Runner
from speccompile.core.proposers.draft_model import DraftModel, DraftRunner
from speccompile.core.proposers.eagle import EagleDraft, EagleRunner
from speccompile.core.proposers.eagle_tree import EagleTree
from speccompile.core.proposers.lookup import NgramIndex, PromptLookup
from speccompile.core.proposers.medusa import MedusaHeads, TreeShape
from speccompile.core.proposers.suffix import MAX_DEPTH as SUFFIX_DEPTH
from speccompile.core.proposers.suffix import SuffixCache, SuffixDecoding
from speccompile.errors import SpecCompileError

__all__ = ["DEFAULT_PROPOSER", "KINDS", "PROPOSERS", "NgramIndex", "Offer", "Proposer", "Proposers", "Runner",
           "TreeShape"]


@dataclass(frozen=True)
class Kind:
    """make(proposers, p_min) -> the request's proposer. needs: what of a bundle it drafts with
    ("draft": a draft model, "tree": Medusa heads, "eagle": an EAGLE-3 head, None: nothing)."""

    make: Callable[["Proposers", float], Proposer]
    needs: str | None = None


KINDS = {
    "draft": Kind(lambda shared, p_min: DraftModel(shared.draft, p_min), needs="draft"),
    "ngram": Kind(lambda shared, p_min: PromptLookup(shared.lookup_priors)),
    "suffix": Kind(lambda shared, p_min: SuffixDecoding(shared.suffix)),
    "medusa": Kind(lambda shared, p_min: MedusaHeads(shared.tree), needs="tree"),
    "eagle": Kind(lambda shared, p_min: EagleDraft(shared.eagle, p_min), needs="eagle"),
    "eagle_tree": Kind(lambda shared, p_min: EagleTree(shared.eagle, p_min), needs="eagle"),
    "auto": Kind(lambda shared, p_min: shared.auto(p_min)),
}
# Free proposers first: they win ties. Suffix decoding joins only where no model drafts: beside the
# demo pair's draft model it was chosen over drafts that would have been kept more often (auto 2.23x
# with it, 2.49x without, on held-out completions; python -m tools.measure suffix), while on its own it beats
# prompt lookup where requests repeat structure (1.79x against 1.34x).
AUTO_MEMBERS = ("ngram", "suffix", "draft", "eagle", "medusa")
PROPOSERS = tuple(KINDS)
DEFAULT_PROPOSER = "auto"


class Proposers:
    """What a runtime's proposers share: the draft model's runner (None: a bundle without a draft), a
    Medusa bundle's tree shape (None: not a Medusa bundle), prompt lookup's priors (a γ profile's),
    the EAGLE-3 head's runner (None: a bundle without one) and the suffix cache of finished requests.
    Makes each request's proposer by kind."""

    def __init__(self, draft: DraftRunner | None = None, tree: TreeShape | None = None,
                 lookup_priors: dict[int, float] | None = None, eagle: EagleRunner | None = None):
        self.draft, self.tree, self.lookup_priors, self.eagle = draft, tree, lookup_priors, eagle
        self.suffix = SuffixCache(max_depth=SUFFIX_DEPTH)

    def forget(self) -> None:
        """Forget what finished requests taught: what they answered (suffix decoding's cross-request
        tree) and how often the EAGLE-3 head's drafts were kept."""
        self.suffix.forget_outputs()
        if self.eagle is not None:
            self.eagle.forget()

    @property
    def runners(self) -> list[Runner]:
        return [runner for runner in (self.draft, self.eagle) if runner is not None]

    def available(self) -> list[str]:
        """The kinds a request may ask for here: on a Medusa bundle only the heads (and auto)."""
        have = {"draft": self.draft is not None, "tree": self.tree is not None, "eagle": self.eagle is not None,
                None: self.tree is None}
        return [name for name, kind in KINDS.items() if have[kind.needs] or name == "auto"]

    def check(self, name: str) -> None:
        """Raise SpecCompileError unless requests here may ask for proposer `name`."""
        if name not in KINDS:
            raise SpecCompileError(f"proposer must be one of {', '.join(PROPOSERS)}, not {name!r}")
        if name in self.available():
            return
        others = " or ".join(repr(n) for n in self.available())
        if self.tree is not None:
            raise SpecCompileError(f"this bundle speculates with Medusa heads (built with --medusa): proposer "
                                   f"{others}, not {name!r}")
        if KINDS[name].needs == "tree":
            raise SpecCompileError(f"proposer {name} needs a bundle built with --medusa (Medusa heads and token-tree "
                                   "verification)")
        if KINDS[name].needs == "eagle":
            raise SpecCompileError(f"proposer {name} needs a bundle built with an EAGLE-3 head (--eagle)")
        raise SpecCompileError(f"this bundle has no draft model (it was built without --draft): its requests "
                               f"speculate with proposer {others}")

    def make(self, name: str, p_min: float = 0.0) -> Proposer:
        self.check(name)
        return KINDS[name].make(self, p_min)

    def auto(self, p_min: float) -> Proposer:
        names = [name for name in AUTO_MEMBERS if name in self.available()]
        if self.draft is not None or self.eagle is not None:
            names.remove("suffix")
        members = [self.make(name, p_min) for name in names]
        if any(isinstance(m, PromptLookup) for m in members):  # lookup covers the request's own text
            members = [SuffixDecoding(self.suffix, own_text=False) if isinstance(m, SuffixDecoding) else m
                       for m in members]
        return members[0] if len(members) == 1 else Auto(members)
