"""The decision cache: measured choices, in memory and on disk, shared across processes.

Keyed by what a timing depends on (:func:`decision_key`): device name, torch and convlower
versions, the timing method, the site (phase, context, mask, folded pad), dtype, compute
dtype, sizes, strides, parameters and the candidate rules.  The file
``<dir>/decisions.json`` is written atomically with owner-only permissions and merged with
what other processes wrote meanwhile; a corrupt or unreadable file is ignored with a warning.
The directory is the one :func:`set_cache_dir` set, else ``$CONVLOWER_CACHE_DIR``, else
``~/.cache/convlower``.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import warnings
from typing import Optional, Sequence

import torch

from .. import torch_internals as ti
from ..device import device_name
from ..lowerings.rule import Rule
from ..lowerings.site import ConvSite
from ..private_files import write_atomic
from ..version import __version__

log = logging.getLogger("convlower")

CACHE_FILE = "decisions.json"
_FORMAT = 1


def _warn(msg: str) -> None:
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    log.warning(msg)


def decision_key(site: ConvSite, candidates: Sequence[Rule], compute_dtype: Optional[str],
                 method: str) -> str:
    c = site.call
    return json.dumps({
        "device": device_name(c.x.device), "torch": torch.__version__, "convlower": __version__,
        "method": method, "phase": site.phase, "produced": site.input_produced,
        "consumed": site.output_consumed and not site.backward,
        "mask": list(site.output_mask) if site.output_mask else None,
        "pad": list(site.pad_fold.pads) if site.pad_fold else None,
        "dtype": str(c.x.dtype), "compute_dtype": compute_dtype,
        "inputs": [[ti.hint(s) for s in t.shape] for t in site.inputs],
        "strides": [[ti.hint(s) for s in t.stride()] for t in site.inputs],
        "bias": c.has_bias, "stride": list(c.stride), "padding": list(c.padding),
        "dilation": list(c.dilation), "transposed": c.transposed,
        "output_padding": list(c.output_padding), "groups": c.groups,
        "candidates": [r.name for r in candidates],
    }, sort_keys=True)


class DecisionCache:
    """Decisions by key, in memory and in ``decisions.json`` under :meth:`directory`."""

    def __init__(self):
        self._dir: Optional[str] = None
        self._memory: dict[tuple[str, str], dict] = {}
        self._lock = threading.Lock()

    def set_directory(self, path: Optional[str]) -> None:
        self._dir = os.fspath(path) if path is not None else None

    def directory(self) -> str:
        if self._dir is not None:
            return self._dir
        env = os.environ.get("CONVLOWER_CACHE_DIR")
        return env or os.path.join(os.path.expanduser("~"), ".cache", "convlower")

    def clear_memory(self) -> None:
        with self._lock:
            self._memory.clear()

    def lookup(self, key: str) -> Optional[dict]:
        directory = self.directory()
        with self._lock:
            hit = self._memory.get((directory, key))
            if hit is None:
                hit = _read(os.path.join(directory, CACHE_FILE)).get(key)
                if isinstance(hit, dict):
                    self._memory[(directory, key)] = hit
            return hit if isinstance(hit, dict) else None

    def entries(self) -> dict[str, dict]:
        """Every decision in the current directory (the file, and what this process stored)."""
        directory = self.directory()
        with self._lock:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # lookup() reports a corrupt file
                out = dict(_read(os.path.join(directory, CACHE_FILE)))
            out.update({k: v for (d, k), v in self._memory.items() if d == directory})
        return {k: v for k, v in out.items() if isinstance(v, dict)}

    def store(self, key: str, decision: dict) -> None:
        directory = self.directory()
        with self._lock:
            self._memory[(directory, key)] = decision
            _write(directory, key, decision)


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("format") != _FORMAT \
                or not isinstance(data.get("decisions"), dict):
            raise ValueError("not a convlower decision cache")
        return data["decisions"]
    except FileNotFoundError:
        return {}
    except Exception as e:  # corrupt or unreadable: ignore it, measure again
        _warn(f"convlower: ignoring the decision cache {path}: {type(e).__name__}: {e}")
        return {}


def _write(directory: str, key: str, decision: dict) -> None:
    path = os.path.join(directory, CACHE_FILE)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a corrupt file was already reported; replace it
            decisions = _read(path)  # merge with what other processes wrote meanwhile
        decisions[key] = decision
        text = json.dumps({"format": _FORMAT, "decisions": decisions}, indent=1, sort_keys=True)
        write_atomic(path, text.encode("utf-8"))
    except OSError as e:
        _warn(f"convlower: could not write the decision cache in {directory}: {e}")


CACHE = DecisionCache()  # the process's cache
