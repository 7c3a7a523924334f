"""Decisions measured on known devices, shipped with the package, read-only.

``seeds.json`` beside this file holds compiled measurements (``select="exhaustive"``, a
warm-up's settling) taken on known devices, keyed like the decision cache without
convlower's version: a seed outlives a release, and the key still names the device, torch's
version, the call, the dtypes, the layout and the candidate rules.  ``auto`` reads a seed after
the user's own measured decisions and before its own screens (:mod:`.auto`), so a close call
on a known device is settled before any warm-up.  ``bench/bench_settle.py --write-seeds``
writes the file;
the device check does the same for a GPU when one is lent.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from typing import Optional

from ..private_files import write_atomic

log = logging.getLogger("convlower")

SEED_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeds.json")
_FORMAT = 1
SEED = "seed"  # how auto names this source
# CONVLOWER_SEED_FILE: another table (a missing file: none); the tests run without seeds.
_state: dict = {"path": os.environ.get("CONVLOWER_SEED_FILE") or SEED_FILE, "table": None,
                "digest": None}


def set_seed_file(path: Optional[str]) -> str:
    """Read seeds from ``path`` (None: the shipped table); return the previous path."""
    prev = _state["path"]
    _state.update(path=os.fspath(path) if path is not None else SEED_FILE, table=None,
                  digest=None)
    return prev


def seed_key(key: str) -> str:
    """A decision-cache key as the seed table keys it (convlower's version left out)."""
    fields = json.loads(key)
    fields.pop("convlower", None)
    return json.dumps(fields, sort_keys=True)


def lookup(key: str) -> Optional[dict]:
    """The seed for decision-cache ``key``, or None."""
    hit = _table().get(seed_key(key))
    return hit if isinstance(hit, dict) else None


def digest() -> str:
    """A digest of the seed table in use (part of convlower's cache identity)."""
    _table()
    return _state["digest"]


def _table() -> dict:
    if _state["table"] is None:
        path, data = _state["path"], b""
        try:
            with open(path, "rb") as f:
                data = f.read()
            table = _parse(data)
        except FileNotFoundError:
            table = {}
        except Exception as e:  # a broken table must not break a compile
            msg = f"convlower: ignoring the seed table {path}: {type(e).__name__}: {e}"
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            log.warning(msg)
            table = {}
        _state.update(table=table, digest=hashlib.sha256(data).hexdigest()[:16])
    return _state["table"]


def _parse(data: bytes) -> dict:
    parsed = json.loads(data)
    if not isinstance(parsed, dict) or parsed.get("format") != _FORMAT \
            or not isinstance(parsed.get("decisions"), dict):
        raise ValueError("not a convlower seed table")
    return parsed["decisions"]


def export(entries: dict, method: str, path: str, source: str) -> int:
    """Add the decisions among ``entries`` (decision-cache key -> decision) measured by
    ``method`` to the seed table at ``path`` (kept: other rows); return how many."""
    try:
        with open(path, "rb") as f:
            table = _parse(f.read())
    except FileNotFoundError:
        table = {}
    added = 0
    for key, d in entries.items():
        if json.loads(key).get("method") != method or not isinstance(d, dict):
            continue
        table[seed_key(key)] = {"rule": d.get("rule"), "opaque": bool(d.get("opaque")),
                                "why": d.get("why", ""), "timings": d.get("timings", {}),
                                "source": source}
        added += 1
    text = json.dumps({"format": _FORMAT, "decisions": table}, indent=1, sort_keys=True)
    write_atomic(path, text.encode("utf-8") + b"\n")
    return added
