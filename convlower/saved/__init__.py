"""A whole compiled model saved in a warm-up's cache folder and loaded by the next process
without Dynamo, AOTAutograd or convlower's passes (torch's AOT compile, torch_internals).

On a warm cache folder, Dynamo re-tracing the model is most of a warm load (a UNet: 7 of 10 s).
A model that compiles as one graph is therefore captured once with torch's AOT compile (the
same backend, the same passes), its compiled function is written here, and a later process
loads it: guards, bytecode and the compiled forward/backward, with Inductor's kernels from the
cache folder.  The model object is an argument of the saved function, so its own parameters
are used (a new state dict or LoRA weights need no recompile).

Only what torch can write is kept of the guards (identity guards on code and modules are not),
so an entry is keyed on the rest (:mod:`.identity`) and checked against the sources the trace
read; anything that differs is a miss that says which field changed.  A call that fails the
saved guards (another shape, train vs eval) goes to an ordinary compile, made on first need.
This room knows nothing of the passes: the caller hands it a backend and a context.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Optional

from .. import torch_internals as ti
from ..observe import persist as _persist
from ..observe import records as _records
from . import identity as _identity
from . import store as _store

log = logging.getLogger("convlower")


@dataclasses.dataclass
class SavedCompile:
    """What happened to the saved compile in this warm-up."""

    state: str = "off"    # "loaded" | "saved" | "not saved" | "off"
    why: str = ""         # why nothing is saved (off, not saved)
    missed: str = ""      # why no saved compile was used (nothing yet, stale, unreadable)
    broken: bool = False  # a saved compile was there but corrupt or refused (worth a warning)
    known: bool = False   # an earlier warm-up found this model cannot be saved: do not retry
    load_s: float = 0.0   # reading and loading the saved function
    compile_s: float = 0.0  # what the compile it stands for took (the saving process's)
    compile_phases_s: dict = dataclasses.field(default_factory=dict)  # that compile by phase
    path: str = ""

    def __str__(self) -> str:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in self.compile_phases_s.items() if v >= 0.05)
        took = f"{self.compile_s:.1f} s" + (f": {phases}" if phases else "")
        head = {"loaded": f"loaded in {self.load_s:.2f} s (its compile took {took})",
                "saved": "saved for the next process"}
        text = head.get(self.state, self.state)
        notes = "; ".join(n for n in (self.missed, self.why) if n)
        return f"{text} ({notes})" if notes else text


class SavedModel:
    """Calls the saved function on the model while its guards hold, else an ordinary
    compile of the model (``fallback()``, made on first need).  Attributes are the model's."""

    def __init__(self, fn, model, fallback: Callable[[], Callable]):
        self._fn, self._model, self._make_fallback = fn, model, fallback
        self._fallback = None
        ti.skip_saved_guard_check(fn)  # checked here, once per call

    def __call__(self, *args, **kwargs):
        if ti.guard_passes(self._fn, self._model, *args, **kwargs):
            return self._fn(self._model, *args, **kwargs)
        if self._fallback is None:
            log.info("convlower: a call does not fit the saved compile's guards; compiling")
            self._fallback = self._make_fallback()
        return self._fallback(*args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("_"):  # our own, before __init__ set them (copy, pickle)
            raise AttributeError(name)
        return getattr(self._model, name)


def available() -> Optional[str]:
    """None, or why this torch cannot save compiled functions."""
    return None if ti.can_save_compiled() else "this torch has no AOT compile (torch >= 2.10)"


def load(folder: str, model, inputs: tuple, context: dict) -> tuple[Optional[object], SavedCompile]:
    """The saved function for ``model`` on ``inputs`` in ``context``, if one fits."""
    if any(getattr(getattr(x, "device", None), "type", "") == "cpu" for x in inputs):
        ti.probe_vec_isa_ahead()  # loading CPU kernels asks for it: on another core meanwhile
    ident = _identity.identity(model, inputs, context)
    status = SavedCompile(state="not saved", path=_store.paths(folder, _identity.slot(ident))[1])
    start = time.perf_counter()
    try:
        entry = _store.read(folder, _identity.slot(ident))
    except _store.Unreadable as e:
        status.missed, status.broken = f"the saved compile is unreadable ({e})", True
        return None, status
    if entry is None:
        status.missed = "nothing saved yet for this model and inputs"
        return None, status
    header, blob = entry
    stale = _identity.differences(header.get("identity", {}), ident)
    stale += [f"source of {m}" for m in _identity.changed_sources(header.get("sources", {}))]
    if stale:
        status.missed = f"the saved compile is stale: {', '.join(stale)} changed"
        return None, status
    if header.get("unsaveable"):  # no blob: an earlier warm-up's failed capture, not redone
        status.why, status.known = f"{header['unsaveable']} (an earlier warm-up found)", True
        return None, status
    try:
        fn = ti.deserialize_compiled(blob, model)
    except Exception as e:  # written by something else, or torch refused it
        status.missed = f"the saved compile did not load ({type(e).__name__}: {e})"
        status.broken = True
        return None, status
    _report_records(header.get("records"))
    status.state, status.load_s = "loaded", time.perf_counter() - start
    status.compile_s = float(header.get("compile_s") or 0.0)
    phases = header.get("compile_phases_s")
    status.compile_phases_s = phases if isinstance(phases, dict) else {}
    return fn, status


def mark_unsaveable(folder: str, model, inputs: tuple, context: dict, why: str) -> None:
    """Remember that ``model`` cannot be captured whole (a graph break), so later warm-ups
    skip the attempt (a partial trace each time) until the model's code or settings change."""
    ident = _identity.identity(model, inputs, context)
    header = {"identity": ident, "sources": _identity.model_sources(model), "unsaveable": why}
    try:
        _store.write(folder, _identity.slot(ident), header, b"")
    except OSError as e:
        log.warning("convlower: could not note that the model cannot be saved: %s", e)


def _report_records(saved: object) -> None:
    # The pass does not run on a loaded compile: report what it recorded when it did.
    try:
        revived = [_persist.revive(d, d.get("graph", "saved")) for d in saved]
    except Exception as e:
        log.warning("convlower: the saved compile's convolution records are unreadable (%s)", e)
        return
    for rec in revived:
        _records.record(rec)


def compile_whole(model, inputs: tuple, backend: Callable, dynamic=None):
    """Compile ``model`` as one saveable graph; raises when it cannot (a graph break)."""
    return ti.compile_saveable(model.forward if hasattr(model, "forward") else model,
                               inputs, backend, dynamic)


def save(folder: str, fn, model, inputs: tuple, context: dict, records: list,
         compile_s: float = 0.0, phases_s: Optional[dict] = None) -> SavedCompile:
    """Write ``fn`` (from :func:`compile_whole`) with its identity; ``records``: the
    convolution records of its compile, reported again by the process that loads it;
    ``compile_s``, ``phases_s``: what that compile took, to set a load beside."""
    ident = _identity.identity(model, inputs, context)
    header = {"identity": ident, "sources": ti.traced_sources(fn), "compile_s": compile_s,
              "compile_phases_s": dict(phases_s or {}),
              "records": [r.to_dict() for r in records]}
    try:
        path = _store.write(folder, _identity.slot(ident), header, ti.serialize_compiled(fn, model))
    except Exception as e:
        log.warning("convlower: could not save the compiled model: %s: %s", type(e).__name__, e)
        return SavedCompile(state="not saved", why=f"writing it failed ({type(e).__name__}: {e})")
    return SavedCompile(state="saved", path=path, compile_s=compile_s,
                        compile_phases_s=dict(phases_s or {}))
