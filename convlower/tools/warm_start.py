"""How the warm-up gets its compiled model: the saved compile in the cache folder when one fits
(:mod:`convlower.saved`: no Dynamo trace, no AOTAutograd trace, no pass), else a compile made
as one saveable graph and saved for the next process, else an ordinary ``torch.compile``.

Saving needs a cache folder and a model without graph breaks (the regions plan is saved too:
its split graph and each distinct part, :class:`convlower.torch_saved.SavedSplit`); when one is
missing the warm-up compiles as before and says why nothing was saved.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Optional

import torch

from .. import saved as _saved
from ..backend.compiler import convlower_backend
from ..backend.options import parse as parse_options
from ..observe import records as _records
from ..observe import stats as _stats
from ..selection import decisions_digest
from . import session_cache as _cache

log = logging.getLogger("convlower")
SUBDIR = "saved"


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


class WarmStart:
    """The compiled model of one warm-up, and what became of its saved compile."""

    def __init__(self, model, inputs: tuple, *, options: Optional[dict], dynamic, backward: bool,
                 cache_dir: Optional[str], save: bool, warns: _cache.Warnings):
        self.model, self.inputs, self.backward = model, inputs, backward
        self.options = dict(options) if options else None
        self.dynamic = dynamic
        self.compile_dynamic = dynamic if isinstance(dynamic, bool) or dynamic is None else None
        self.status = _saved.SavedCompile()
        self.warns = warns
        self.folder: Optional[str] = None
        self.fn = None        # the compiled function to save (made here, not loaded)
        self.records: list = []
        self.made_at_us: Optional[int] = None  # when the compile to be saved started
        why = self._why_not(cache_dir, save)
        if why:
            self.status.why = why
        else:
            self.folder = _cache.private_dir(os.path.join(cache_dir, SUBDIR), warns)

    def _why_not(self, cache_dir: Optional[str], save: bool) -> str:
        if cache_dir is None:
            return "no cache_dir"
        if not save:
            return "save_compiled=False"
        return _saved.available() or ""

    def _backend(self) -> Callable:
        # A backend object of its own per compile: an equal one would reuse Dynamo's entries.
        return functools.partial(convlower_backend, options=self.options)

    def plain(self) -> Callable:
        return torch.compile(self.model, backend=self._backend(), dynamic=self.compile_dynamic)

    def context(self) -> dict:
        """The compile's settings a saved compile must match (besides model and inputs)."""
        return {"options": parse_options(self.options).key(), "dynamic": repr(self.dynamic),
                "backward": self.backward, "decisions": decisions_digest()}

    def first(self) -> Callable:
        """The model for the first call: loaded, compiled to be saved, or compiled plainly."""
        if self.folder is None:
            return self.plain()
        fn, self.status = _saved.load(self.folder, self.model, self.inputs, self.context())
        if self.status.broken:
            self.warns.add(f"convlower: {self.status.missed}; compiling again")
        if fn is not None:
            return _saved.SavedModel(fn, self.model, self.plain)
        if self.status.known:
            return self.plain()
        return self._whole(remember=True) or self.plain()

    def recover(self, error: Exception) -> Callable:
        """After the first call failed on a broken cache (the caller discarded Inductor's):
        compile again, to be saved again when it can be."""
        if self.status.state == "loaded":
            self.status = _saved.SavedCompile(
                state="not saved", broken=True,
                missed=f"the saved compile failed to run ({_first_line(error)})")
        return (self._whole() if self.folder else None) or self.plain()

    def again(self) -> Callable:
        """A new compile after the warm-up changed decisions (saved again when it can be)."""
        return (self._whole() if self.fn is not None else None) or self.plain()

    def _whole(self, remember: bool = False) -> Optional[Callable]:
        before = len(_records.records("convolutions"))
        self.made_at_us = _stats.now_us()
        try:
            self.fn = _saved.compile_whole(self.model, self.inputs, self._backend(),
                                           self.compile_dynamic)
        except Exception as e:  # a graph break, an unsaveable backend output: compile plainly
            if remember and _cache.broken_cache(e):
                raise  # the caller discards the broken cache and compiles again (recover)
            self.status.state = "not saved"
            self.status.why = f"not saveable as one graph ({_first_line(e)})"
            log.info("convlower: %s", self.status.why)
            if remember:
                _saved.mark_unsaveable(self.folder, self.model, self.inputs, self.context(),
                                       self.status.why)
            self.fn = None
            return None
        self.records = _records.records("convolutions")[before:]
        return _saved.SavedModel(self.fn, self.model, self.plain)

    def note_compile(self, seconds: float) -> None:
        """After the first call of a compile made here: its statistics record (torch's AOT
        compile writes Inductor's timings only as the compiled code is first run)."""
        if self.fn is not None and self.made_at_us is not None:
            _stats.record_whole_compile(type(self.model).__qualname__, seconds, self.made_at_us)
            self.made_at_us = None

    def save(self, compile_s: float, phases_s: dict) -> None:
        """Write the compile made here for the next process (after any settling);
        ``compile_s``, ``phases_s``: what compiling cost this process, by phase."""
        if self.fn is None or self.folder is None:
            return
        missed = self.status.missed
        self.status = _saved.save(self.folder, self.fn, self.model, self.inputs, self.context(),
                                  self.records, compile_s, phases_s)
        self.status.missed = missed
