"""Per-conv records that outlive Inductor's and AOTAutograd's caches.

A graph served from Inductor's FX graph cache, directly or through an AOTAutograd cache entry
(which names the FX graph entries of its forward and backward), runs no graph pass, so the
pass records nothing for it.  The pass's records of each graph are therefore saved next to
convlower's own cache entries, ``<cache dir>/records/<sha256>.json``, when Inductor saves the
graph, under the FX graph cache's own key and the guard expression the entry is stored with:
the identity of the cached artifact itself (one key holds one entry per guard set), so the
records of one graph cannot be served for another.  A lookup that hits loads them back as
:class:`ConvRecord` with ``from_cache=True``, renamed to the graph being compiled now.

A missing, unreadable or mismatched entry gives a warning and one record that says "from
cache, details unavailable": never another graph's records.  Files are written atomically
and owner-only (:func:`convlower.private_files.write_atomic`) in a 0700 directory.  The
backend wires the hooks (torch_internals.on_fx_graph_cache) and passes the directory.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
import warnings
from typing import Optional

from ..private_files import write_atomic
from ..version import __version__
from .records import ConvRecord

log = logging.getLogger("convlower")

SUBDIR = "records"
FORMAT = 1
UNAVAILABLE = "from cache, details unavailable"
_pending = threading.local()  # the last pass's records in this thread, until Inductor saves
_FIELDS = {f.name for f in dataclasses.fields(ConvRecord)}


def _warn(msg: str) -> None:
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    log.warning(msg)


def path_of(directory: str, fx_key: str, guards: str) -> str:
    name = hashlib.sha256(json.dumps([fx_key, guards or ""]).encode()).hexdigest()
    return os.path.join(directory, SUBDIR, f"{name}.json")


def note_pass(graph: str, records: list) -> None:
    """The pass's records of the graph it just ran on, for the cache save that follows."""
    _pending.value = (graph, [r.to_dict() for r in records])


def save(directory: str, fx_key: str, guards: str) -> Optional[str]:
    """Persist the pending records under the FX graph cache entry (fx_key, guards) that
    Inductor just saved; returns the file written (None: nothing pending or not written)."""
    pending, _pending.value = getattr(_pending, "value", None), None
    if pending is None:
        return None
    graph, recs = pending
    path = path_of(directory, fx_key, guards)
    payload = {"format": FORMAT, "convlower": __version__, "fx_key": fx_key,
               "guards": guards or "", "graph": graph, "records": recs}
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        write_atomic(path, json.dumps(payload, default=str, sort_keys=True).encode("utf-8"))
        return path
    except (OSError, TypeError, ValueError) as e:
        _warn(f"convlower: could not save the convolution records of {graph} ({path}): {e}")
        return None


def revive(d: dict, graph: str) -> ConvRecord:
    """A saved record dict as ``graph``'s ConvRecord, marked from_cache; ValueError if not one."""
    if not isinstance(d, dict) or not {"phase", "node", "call"} <= d.keys():
        raise ValueError("not a convolution record")
    rec = ConvRecord(**{k: v for k, v in d.items() if k in _FIELDS and k != "graph"},
                     graph=graph)
    if rec.phase not in ("forward", "backward") or not isinstance(rec.call, dict) \
            or not isinstance(rec.guards, list) or not isinstance(rec.verdicts, list):
        raise ValueError("not a convolution record")
    rec.from_cache = True
    return rec


def load(directory: str, fx_key: str, guards: str, graph: str, phase: str) -> list[ConvRecord]:
    """The records of the cached FX graph entry (fx_key, guards), as ``graph``'s, marked
    from_cache; on any failure a warning and one "details unavailable" record."""
    path = path_of(directory, fx_key, guards)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not a convlower record file")
        if data.get("fx_key") != fx_key or data.get("guards") != (guards or ""):
            raise ValueError("written for another cache entry")
        if not isinstance(data.get("records"), list):
            raise ValueError("no record list")
        return [revive(d, graph) for d in data["records"]]
    except FileNotFoundError:
        why = "no records were saved for it"
    except Exception as e:  # corrupt, truncated, foreign: never report something wrong
        why = f"its record file is unreadable ({type(e).__name__}: {e})"
    _warn(f"convlower: {graph} ({phase}) was served from Inductor's cache but {why}: {path}; "
          f"its convolutions are reported as '{UNAVAILABLE}'")
    return [ConvRecord(graph, phase, node="?", call={}, reason=f"{UNAVAILABLE}: {why}",
                       from_cache=True)]
