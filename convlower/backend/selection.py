"""Which eligible rule (if any) lowers a convolution.

``always``: the first eligible rule in priority order (for experiments and tests).
``heuristic``: the same, minus shapes where a rule is known to lose (see docs/rules.md).
``measure``: time the original convolution and each candidate on the real device; see
:mod:`convlower.backend.measure`.
"""
from __future__ import annotations

from typing import Optional

from ..lowerings.rule import ConvCall, Rule


def heuristic_ok(rule: Rule, call: ConvCall) -> tuple[bool, str]:
    """Static knowledge of where a rule loses.  Returns (use it?, why)."""
    return True, "eligible"


def choose(call: ConvCall, candidates: list[Rule], select: str) -> tuple[Optional[Rule], str, dict]:
    """Return (rule or None, why, timings)."""
    if not candidates:
        return None, "no rule is eligible", {}
    if select == "always":
        return candidates[0], "forced (select=always)", {}
    if select == "heuristic":
        for rule in candidates:
            ok, why = heuristic_ok(rule, call)
            if ok:
                return rule, f"heuristic: {why}", {}
        return None, "heuristic: every eligible rule is known to lose here", {}
    from .measure import choose_by_measurement

    return choose_by_measurement(call, candidates)
