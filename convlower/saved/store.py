"""Saved compiles on disk: ``<folder>/<slot>.json`` (identity, traced sources, records, the
blob's size and sha256) beside ``<slot>.bin`` (torch's serialized compiled function).

Files are written atomically and owner-only; the caller hands a folder it has made private.
Reading checks the blob against the header, so a truncated or corrupt file is reported as
such, never loaded.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from ..private_files import write_atomic


class Unreadable(ValueError):
    """A saved compile that is there but cannot be used as it is (corrupt, truncated)."""


def paths(folder: str, slot: str) -> tuple[str, str]:
    return os.path.join(folder, f"{slot}.json"), os.path.join(folder, f"{slot}.bin")


def write(folder: str, slot: str, header: dict, blob: bytes) -> str:
    head, body = paths(folder, slot)
    write_atomic(body, blob)  # the blob first: a header always names a complete blob
    meta = dict(header, size=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    write_atomic(head, json.dumps(meta, sort_keys=True).encode())
    return body


def read(folder: str, slot: str) -> Optional[tuple[dict, bytes]]:
    """``(header, blob)``; None when nothing was saved; :class:`Unreadable` when broken."""
    head, body = paths(folder, slot)
    try:
        with open(head, "rb") as f:
            header = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise Unreadable(f"{head}: {type(e).__name__}: {e}") from e
    try:
        with open(body, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise Unreadable(f"{body}: {type(e).__name__}: {e}") from e
    if not isinstance(header, dict) or len(blob) != header.get("size") \
            or hashlib.sha256(blob).hexdigest() != header.get("sha256"):
        raise Unreadable(f"{body}: truncated or corrupt ({len(blob)} bytes, header says "
                         f"{header.get('size') if isinstance(header, dict) else '?'})")
    return header, blob
