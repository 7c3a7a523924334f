"""Which eligible rule (if any) lowers a convolution site.  See docs/selection.md.

``auto`` (the default): proof, cache, then a milliseconds eager screen; close calls keep the
original, nothing is compiled (:mod:`.auto`).  ``measure``: the same, but close calls are
compiled and timed.  ``exhaustive``: every eligible conv's candidates are compiled and timed
on the real device, dtype and layout (:mod:`.measure`; ``mode="max-autotune"`` implies it).
``heuristic``: each rule's own static knowledge (``Rule.heuristic``).  ``always``: the first
eligible lowering in priority order (tests, experiments; never ``eager_conv``).  Decisions are cached on disk.
Selection knows sites and rules, never the graph pass.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..device import platform as device_platform
from ..lowerings.rule import Rule
from ..lowerings.site import ConvSite
from . import ranks
from .cache import CACHE
from .decision import HOW, Decision
from . import auto, measure
from . import seeds
from .close_calls import Settled, settle, settled_digest
from .timer import set_timer

__all__ = ["choose", "Decision", "HOW", "set_timer", "set_cache_dir", "cache_dir",
           "clear_memory", "settle", "Settled", "decisions_digest"]


def choose(site: ConvSite, candidates: Sequence[Rule], select: str, *, platform: str = "auto",
           compute_dtype: Optional[str] = None) -> Decision:
    """The rule for ``site`` (or None), the same on every rank of a process group."""
    decision = _choose_here(site, candidates, select, platform, compute_dtype)
    return ranks.agree(site, candidates, decision)


def _choose_here(site, candidates, select, platform, compute_dtype) -> Decision:
    if not candidates:
        return Decision(None, "no rule is eligible", "none eligible")
    if select == "always":  # forces lowerings; eager_conv (not one) is chosen by timing
        lowering = next((r for r in candidates if r.lowers), None)
        why = "forced (select=always)" if lowering else \
            "forced (select=always): no lowering is eligible, kept the original"
        return Decision(lowering, why, "forced")
    if select == "heuristic":
        return _heuristic(site, candidates, device_platform(platform, site.call.x.device))
    if select == "exhaustive":
        return measure.decide(site, candidates, compute_dtype)
    return auto.decide(site, candidates, compute_dtype, measure_close=select == "measure")


def _heuristic(site: ConvSite, candidates: Sequence[Rule], plat: str) -> Decision:
    whys = []
    for rule in candidates:
        ok, why = rule.heuristic(site.call, plat)
        if ok:
            return Decision(rule, f"heuristic: {why}", "heuristic")
        whys.append(f"{rule.name}: {why}")
    return Decision(None, "heuristic: " + "; ".join(whys), "heuristic")


def decisions_digest() -> str:
    """What changes a compile's decisions besides the graph and the options: the decisions a
    warm-up settled and the seed table.  Part of convlower's cache identity."""
    return f"{settled_digest()}-{seeds.digest()}"


# The knobs users and tests turn: where decisions are kept, and the timer.
set_cache_dir = CACHE.set_directory
cache_dir = CACHE.directory
clear_memory = CACHE.clear_memory
