"""Close calls settled later, where measuring costs nothing: the warm-up's share of selection.

``select="auto"`` keeps the original on a close call (the screen could not tell) and compiles
nothing.  Each such call is noted here (:func:`note_close`) with what the screen saw.  A
warm-up at session load, once the model is usable, calls :func:`settle`: every open call is
compiled and timed with every eligible rule, not only the close ones
(:func:`convlower.selection.measure.decide`), within a budget, and the
measured decision is stored under the key ``auto`` reads first, marked ``settled``.  The
screen's clear wins are noted too (:func:`note_clear_win`) and measured after the close calls
while the budget lasts: an eager figure swings with the machine's load, and a clear win taken
on a fluke would otherwise never be looked at again.  The
settled decisions' digest (:func:`settled_digest`) is part of convlower's cache identity
(``ConvLowerPass.uuid``), so a graph compiled before them is not served from Inductor's cache
afterwards: the next compile, in this process or another, takes the measured choice.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from typing import Callable, Optional, Sequence

from ..lowerings.rule import Rule
from ..lowerings.site import ConvSite
from . import measure, screen, seeds
from .cache import CACHE, decision_key
from .decision import OPAQUE, Decision, label, opaque_of


@dataclasses.dataclass
class _Open:
    site: ConvSite
    candidates: tuple          # every eligible rule: all are measured (the screen's bounds
                               # can be wrong either way: bench/bench_settle.py)
    close: tuple               # the names the screen could not tell from the original
    key: str                   # where auto looks for a measured decision
    compute_dtype: Optional[str]
    screen: dict               # the screen's seconds per candidate ("aten" = the original)
    chosen: Optional[str] = None  # what the screen chose meanwhile, as a label (decision.label)
    clear_win: bool = False    # nothing was close: the screen's clear win, measured last


@dataclasses.dataclass
class Settled:
    """One close call (or one of the screen's clear wins), measured: what it was, what the
    screen leaned to, what won compiled."""

    conv: str                  # the call, in words (sizes, stride, dtype, phase)
    rule: Optional[str]        # the measured choice, as a label (None: the original stays)
    changed: bool              # the choice differs from what the screen chose
    screen_ratio: Optional[float]    # best close candidate (a clear win: the winner) /
                                     # original, as the screen predicts
    compiled_ratio: Optional[float]  # best candidate / original, compiled and timed
    saved_s: float             # seconds per call of this conv the change saves (>= 0)
    seconds: float             # what measuring it cost
    why: str
    clear_win: bool = False    # the screen called it a clear win (measured to confirm it)

    @property
    def agrees(self) -> Optional[bool]:
        """Whether the screen's lean (a rule if its ratio was < 1; a clear win: that rule) was
        the measured pick."""
        if self.clear_win:
            return not self.changed
        if self.screen_ratio is None:
            return None
        return (self.screen_ratio < 1.0) == (self.rule is not None)

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), agrees=self.agrees)


_OPEN: dict[str, _Open] = {}
_lock = threading.Lock()
# A noted call holds its graph's fake tensors until a warm-up measures it: a process that
# compiles many models and never warms up keeps at most this many (the first ones noted).
MAX_OPEN = 1024


def note_close(site: ConvSite, candidates: Sequence[Rule], close: Sequence[str],
               compute_dtype: Optional[str], screen: dict,
               chosen: Optional[str] = None) -> None:
    """A close call ``auto`` kept the original for, or chose rule ``chosen`` in while others
    may beat it compiled (or found so in the cache): ``close`` names the candidates the screen
    could not tell apart."""
    _note(_Open(site, tuple(candidates), tuple(close), "", compute_dtype, dict(screen), chosen))


def note_clear_win(site: ConvSite, candidates: Sequence[Rule], compute_dtype: Optional[str],
                   screen: dict, chosen: str) -> None:
    """A clear win ``auto`` took (label ``chosen``) with no rival in doubt: a warm-up measures it
    after the close calls.  The Wan DiT fp32 patch conv's screen called channels_last_conv
    0.18x the original in one process and 1.12x in the next (a loaded 2-core machine)."""
    _note(_Open(site, tuple(candidates), (chosen.removesuffix(OPAQUE),), "", compute_dtype,
                dict(screen), chosen, clear_win=True))


def _note(call: _Open) -> None:
    call.key = decision_key(call.site, call.candidates, call.compute_dtype, measure.METHOD)
    with _lock:
        if len(_OPEN) < MAX_OPEN:
            _OPEN.setdefault(call.key, call)


def waiting() -> tuple[int, int]:
    """(close calls, the screen's clear wins) not measured yet."""
    with _lock:
        wins = sum(c.clear_win for c in _OPEN.values())
        return len(_OPEN) - wins, wins


def open_calls() -> int:
    """Close calls not measured yet (the screen's clear wins waiting for a look: :func:`pending`)."""
    return waiting()[0]


def pending() -> int:
    """Calls a warm-up would measure: the close calls and the screen's clear wins."""
    return sum(waiting())


def forget() -> None:
    """Drop the open calls (tests)."""
    with _lock:
        _OPEN.clear()


def settle(budget_s: float = 120.0,
           progress: Optional[Callable[[str], None]] = None) -> tuple[list[Settled], int, float]:
    """Measure the open close calls, then the screen's clear wins, each stored for ``auto``;
    ``(settled, left open, seconds spent)``.

    Calls are measured one by one while the budget lasts (a measurement is never cut short:
    it is bounded by :mod:`.measure`'s own budgets); what is left stays open for a later
    warm-up.  Close calls come first: a clear win is more often right."""
    with _lock:
        pending = sorted(_OPEN.items(), key=lambda kv: kv[1].clear_win)
    done, start = [], time.perf_counter()
    for i, (key, call) in enumerate(pending):
        if time.perf_counter() - start >= budget_s:
            break
        if progress:
            what = "the screen's clear win" if call.clear_win else "close call"
            progress(f"measuring {what} {i + 1}/{len(pending)}: {_describe(call.site)}")
        done.append(_measure(call))
        with _lock:
            _OPEN.pop(key, None)
    return done, len(pending) - len(done), time.perf_counter() - start


def _measure(call: _Open) -> Settled:
    seeded = seeds.lookup(call.key)  # a first compile deferred a seed's choice: take it
    decision = _from_seed(call, seeded) if seeded else measure.decide(
        call.site, call.candidates, call.compute_dtype)
    measured = CACHE.lookup(call.key)  # measure stored it under the key auto reads
    if measured is not None and not measured.get("settled"):
        CACHE.store(call.key, dict(measured, settled=True, screen_rule=call.chosen))
    t = decision.timings
    base = t.get("aten")
    names = {r.name for r in call.candidates}
    best = min((n for n in t if n.removesuffix(OPAQUE) in names), key=t.get, default=None)
    rule = decision.label
    was, now = t.get(call.chosen or "aten"), t.get(rule or "aten")
    saved = max(was - now, 0.0) if was is not None and now is not None else 0.0
    # a failed measurement stores nothing: the next compile keeps what the screen chose
    changed = rule != call.chosen and CACHE.lookup(call.key) is not None
    return Settled(conv=_describe(call.site), rule=rule, changed=changed,
                   screen_ratio=_screen_ratio(call), seconds=decision.seconds,
                   compiled_ratio=t[best] / base if best and base else None,
                   saved_s=saved, why=decision.why, clear_win=call.clear_win)


def _from_seed(call: _Open, seeded: dict) -> Decision:
    """The seed's measured decision, stored for ``auto`` as the user's own (nothing timed)."""
    CACHE.store(call.key, dict(seeded))
    rule = next((r for r in call.candidates if r.name == seeded.get("rule")), None)
    return Decision(rule, f"seed: {seeded.get('why', '')}", "cache", 0.0,
                    dict(seeded.get("timings", {})), opaque=opaque_of(seeded, rule))


def _screen_ratio(call: _Open) -> Optional[float]:
    base = call.screen.get("aten")
    if call.clear_win:  # the figures it won on (auto.judge): the winner's eager run, and
        name = call.close[0]  # eager_conv's against the original in Inductor's layout
        if name == screen.EAGER_CONV.name:
            base = call.screen.get(screen.INDUCTOR_LAYOUT, base)
        return call.screen[name] / base if name in call.screen and base else None
    times = [screen.predicted(call.screen, n) for n in call.close if n in call.screen]
    return min(times) / base if times and base else None


def _describe(site: ConvSite) -> str:
    c = site.call
    return (f"{site.phase} conv x{list(c.x.shape)} w{list(c.weight.shape)} stride "
            f"{list(c.stride)} {str(c.x.dtype).replace('torch.', '')}")


def settled_digest() -> str:
    """A digest of the settled decisions that change what the screen chose (part of the cache
    key of every graph convlower compiles: a changed choice recompiles the graphs once).  A
    measurement that keeps the screen's choice changes no code, so it leaves the cached graphs
    warm."""
    labels = ((k, v, label(v["rule"], v.get("opaque", False)))
              for k, v in CACHE.entries().items() if v.get("settled"))
    settled = sorted((k, now) for k, v, now in labels if now != v.get("screen_rule"))
    return hashlib.sha256(json.dumps(settled).encode()).hexdigest()[:16]
