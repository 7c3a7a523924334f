"""What selection returns: the rule (or None), why, how it was decided and what it cost."""
from __future__ import annotations

import dataclasses
from typing import Optional

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
