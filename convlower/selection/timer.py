"""Timing one candidate: the default timer, the injectable one, and which figures to trust.

A timer is ``(label, fn, budget_s) -> seconds per call of fn`` (label: "aten" or a rule
name).  Tests inject stubs with :func:`set_timer` so the decision logic runs without timings.
Some GPU timers report elapsed times <= 0 (MIOpen 3.6 on gfx1151, Inductor autotuning on
gfx1201): :func:`plausible` rejects such figures and the original convolution is kept.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Optional

REPEATS = 5  # timed samples per candidate and round (after one warm-up), fewer past the budget
MIN_SAMPLE_S = 1e-3  # a sample repeats a short op until it lasts about this long
MAX_PLAUSIBLE_S = 3600.0  # one call of one convolution taking longer is a broken timer

Timer = Callable[[str, Callable[[], object], float], float]


def default_timer(label: str, fn: Callable[[], object], budget_s: float) -> float:
    """Seconds per call: median of up to REPEATS samples after one warm-up, within ``budget_s``.
    A sample runs a short op several times (about MIN_SAMPLE_S) so timer resolution and
    scheduling jitter do not dominate.  ``fn`` synchronises the device itself."""
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:
        prepare()  # compile, untimed
    start = time.perf_counter()
    fn()  # warm-up (allocations, library plans)
    warm = time.perf_counter() - start
    if warm >= budget_s:  # a long op: its one run is the (conservative) measurement
        return warm
    inner = max(1, min(50, int(MIN_SAMPLE_S / max(warm, 1e-7))))
    times = []
    deadline = time.perf_counter() + max(budget_s - warm, 0.0)
    while len(times) < REPEATS and (not times or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    # The median, not the best: on a shared machine the same kernel's speed follows time
    # (cache, memory and CPU contention); the best sample shows a moment users rarely see.
    return statistics.median(times)


def plausible(seconds) -> Optional[str]:
    """None for a usable timing, else why it is not one."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return f"timer returned {seconds!r}, not a number"
    if not math.isfinite(seconds):
        return f"timer returned {seconds!r}"
    if seconds <= 0:
        return f"timer returned {seconds!r} s (elapsed <= 0: a broken device timer)"
    if seconds > MAX_PLAUSIBLE_S:
        return f"timer returned {seconds:.3g} s for one call (implausible)"
    return None


class _State:
    timer: Timer = default_timer
    compile_first: bool = True  # compile every candidate before timing any


def set_timer(timer: Optional[Timer], *, compiles: bool = False) -> Timer:
    """Use ``timer`` for measurements (None: the default); return the previous one.

    The default timer compiles every candidate before timing any, so compiling never overlaps
    a measurement.  A stub timer pays for no compile unless ``compiles`` (a candidate is then
    compiled on its first call)."""
    prev, _State.timer = _State.timer, timer or default_timer
    _State.compile_first = timer is None or timer is default_timer or compiles
    return prev


def timer() -> Timer:
    return _State.timer


def compile_first() -> bool:
    return _State.compile_first
