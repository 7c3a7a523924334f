"""What selection returns: the rule (or None), why, how it was decided and what it cost."""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..decompositions.opaque_form import has_opaque_form
from ..lowerings.rule import Rule

# How a decision was made, as the report says it.
HOW = ("none eligible", "forced", "heuristic", "proof", "screen", "measurement", "cache")


@dataclasses.dataclass
class Decision:
    rule: Optional[Rule]   # None: keep the original convolution
    why: str
    how: str               # one of HOW
    seconds: float = 0.0   # what deciding cost (measuring); 0 for static decisions
    timings: dict = dataclasses.field(default_factory=dict)  # seconds per candidate
    shared: str = ""       # across ranks: "" own, "rank N" whose decision (selection/ranks.py)
    opaque: bool = False   # the rule in its opaque form (decompositions/opaque_form.py)

    @property
    def label(self) -> Optional[str]:
        """The choice as timings and caches name it: the rule, ``+ OPAQUE`` in its opaque form."""
        return label(self.rule.name if self.rule else None, self.opaque)


OPAQUE = ":opaque"  # a timing label's suffix: the rule in its opaque form


def label(rule: Optional[str], opaque: bool) -> Optional[str]:
    return rule + OPAQUE if rule and opaque else rule


def fastest_opaque(timings: dict) -> Optional[str]:
    """The label of the fastest opaque form among ``timings`` (None: none was timed)."""
    return min((n for n in timings if n.endswith(OPAQUE)), key=timings.get, default=None)


def opaque_of(entry: dict, rule: Optional[Rule]) -> bool:
    """Whether a stored decision (cache, seed) chose ``rule``'s opaque form; entries written
    before the form existed chose the traced one."""
    return bool(entry.get("opaque")) and has_opaque_form(rule)
