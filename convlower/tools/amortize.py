"""Whether compiling pays off: speed-up, break-even calls and a verdict.

The rule users apply by hand after a short spike:
  * speed-up < ``low`` (5%)                       -> "don't compile"
  * speed-up >= ``high`` (15%) and stable         -> "compile at session load"
  * otherwise                                     -> "compile only for sessions of >= N calls"
"stable" means the spread of the compiled step times is small against the gain
(``spread <= stability * gain_per_call``).  N is the break-even call count: compile seconds
divided by the seconds saved per call.  Thresholds are inclusive (a speed-up of exactly 15%
is "at least 15%"), up to ``_EPS`` so that float rounding (1.15 / 1.0 - 1 < 0.15) does not move
a boundary.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

DONT = "don't compile"
SESSION_LOAD = "compile at session load"
LONG_SESSIONS = "compile only for sessions of >= {n} calls"
_EPS = 1e-9


@dataclasses.dataclass(frozen=True)
class Amortization:
    eager_step_s: float
    compiled_step_s: float
    compile_s: float
    speedup: float  # fraction: 0.2 means compiled steps take 1/1.2 of eager
    saved_per_call_s: float
    break_even_calls: Optional[int]  # None when compiling never pays off
    stable: bool
    verdict: str
    code: str  # "dont" | "session_load" | "long_sessions"
    reason: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def amortize(eager_step_s: float, compiled_step_s: float, compile_s: float, *,
             spread_s: float = 0.0, low: float = 0.05, high: float = 0.15,
             stability: float = 0.5) -> Amortization:
    """Decide from eager / compiled steady-state step time, compile time and the spread
    (e.g. interquartile range) of the compiled step times.  Thresholds are fractions."""
    for name, v in (("eager_step_s", eager_step_s), ("compiled_step_s", compiled_step_s),
                    ("compile_s", compile_s), ("spread_s", spread_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite non-negative number, got {v!r}")
    if compiled_step_s <= 0 or eager_step_s <= 0:
        raise ValueError("step times must be positive")
    if not 0 <= low <= high:
        raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")
    speedup = eager_step_s / compiled_step_s - 1.0
    saved = eager_step_s - compiled_step_s
    break_even = math.ceil(compile_s / saved - _EPS) if saved > 0 else None
    stable = spread_s <= stability * saved * (1 + _EPS) if saved > 0 else False
    if speedup < low - _EPS:
        code, verdict = "dont", DONT
        reason = f"speed-up {speedup:+.1%} is below {low:.0%}"
    elif speedup >= high - _EPS and stable:
        code, verdict = "session_load", SESSION_LOAD
        reason = (f"speed-up {speedup:+.1%} >= {high:.0%} and stable (spread {spread_s * 1e3:.3g} ms"
                  f" vs {saved * 1e3:.3g} ms saved per call); pays off after {break_even} calls")
    else:
        code, verdict = "long_sessions", LONG_SESSIONS.format(n=break_even)
        why = "unstable" if speedup >= high - _EPS else f"below {high:.0%}"
        reason = f"speed-up {speedup:+.1%} ({why}); compile cost is repaid after {break_even} calls"
    return Amortization(eager_step_s, compiled_step_s, compile_s, speedup, saved, break_even,
                        stable, verdict, code, reason)
