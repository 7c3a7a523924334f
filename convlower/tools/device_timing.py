"""Benchmark timing on any device: a clock per device, warm-up, interleaved rounds, medians.

Used by ``bench/device_check.py``.  A *clock* is ``clock(fn, reps) -> seconds`` for ``reps``
back-to-back calls of ``fn`` (the total, not per call):

* :func:`event_clock` (CUDA and HIP devices): CUDA events recorded around the calls on the
  current stream, then ``end.synchronize()``; the device's own elapsed time, so host-side
  launch jitter between samples does not count.
* :func:`wall_clock` (any device): synchronise, ``time.perf_counter()``, the calls, synchronise.

:func:`time_interleaved` warms every variant up, picks how many calls make one sample (about
``min_sample_s``: single short calls are mostly timer resolution and jitter), then runs
``rounds`` rounds, each round timing every variant once in a rotated order, so a burst of load
hits all of them; the result per variant is the median of its rounds.  A variant whose clock
ever reports an implausible figure (<= 0, not finite, absurdly long: the checks of
:func:`convlower.selection.timer.plausible`) is rejected as a whole: some GPU timers report
elapsed times <= 0, and the other figures of such a timer are not to be trusted either.
Clocks are parameters, so this logic is tested on CPU with fake clocks.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Optional

import torch

from ..device import sync
from ..selection.timer import plausible

Clock = Callable[[Callable[[], object], int], float]


def wall_clock(device) -> Clock:
    """Seconds for ``reps`` calls: synchronise, perf_counter, calls, synchronise."""
    device = torch.device(device)

    def clock(fn, reps: int) -> float:
        sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        return time.perf_counter() - start

    clock.kind = "wall clock + device synchronize"
    return clock


def event_clock(device) -> Clock:
    """Seconds for ``reps`` calls as CUDA (or HIP) events on the current stream measure them."""
    device = torch.device(device)

    def clock(fn, reps: int) -> float:
        with torch.cuda.device(device):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            sync(device)  # nothing queued before ``start`` is counted
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3  # ms -> s

    clock.kind = "cuda events"
    return clock


def clock_for(device, kind: str = "auto") -> Clock:
    """``kind`` "auto": events on a CUDA/HIP device, the wall clock elsewhere; or "events",
    "wall"."""
    device = torch.device(device)
    if kind == "auto":
        kind = "events" if device.type == "cuda" else "wall"
    if kind == "events":
        return event_clock(device)
    if kind == "wall":
        return wall_clock(device)
    raise ValueError(f"unknown clock {kind!r}; valid: auto, events, wall")


@dataclasses.dataclass
class Timing:
    """One variant's result: ``median_s`` is None when it failed or its figures were rejected."""

    median_s: Optional[float] = None
    samples: list = dataclasses.field(default_factory=list)  # seconds per call, per round
    reps: int = 0                                            # calls per sample
    rejected: Optional[str] = None                           # why the figures were thrown away
    error: Optional[str] = None                              # the variant raised

    @property
    def ok(self) -> bool:
        return self.median_s is not None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _clocked(timing: Timing, clock: Clock, fn, reps: int, check, where: str,
             warmup: int = 0) -> Optional[float]:
    """Seconds for ``reps`` calls of ``fn`` (after ``warmup`` untimed calls: compile, allocate,
    pick library plans), or None with ``timing.error`` / ``timing.rejected`` saying why.  A
    variant that fails is a finding, not the end of the row."""
    try:
        for _ in range(warmup):
            fn()
        seconds = clock(fn, reps)
    except Exception as e:
        timing.error = f"{type(e).__name__}: {e}"[:500]
        return None
    problem = check(seconds)
    if problem:
        timing.rejected = f"{where}: {problem}"
        return None
    return seconds


def time_interleaved(fns: dict, *, clock: Clock, rounds: int = 7, warmup: int = 2,
                     min_sample_s: float = 0.02, max_reps: int = 1000,
                     check: Callable[[object], Optional[str]] = plausible) -> dict:
    """``{name: Timing}``: median seconds per call of each ``fns[name]()`` over ``rounds``
    interleaved rounds (see the module docstring).  A variant that raises is reported with
    ``error`` and left out of the rounds; one whose clock gives an implausible figure
    (``check(seconds)`` returns a reason) gets ``rejected`` and no median."""
    out = {name: Timing() for name in fns}
    live = []
    for name, fn in fns.items():
        first = _clocked(out[name], clock, fn, 1, check, "calibration",
                         warmup=max(warmup, 1))
        if first is not None:
            out[name].reps = max(1, min(max_reps, math.ceil(min_sample_s / first)))
            live.append(name)
    for r in range(rounds):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        for name in order:
            timing = out[name]
            if timing.rejected or timing.error:
                continue
            seconds = _clocked(timing, clock, fns[name], timing.reps, check, f"round {r}")
            if seconds is not None:
                timing.samples.append(seconds / timing.reps)
    for timing in out.values():
        if timing.rejected or timing.error:
            timing.median_s = None
        elif timing.samples:
            timing.median_s = statistics.median(timing.samples)
    return out
