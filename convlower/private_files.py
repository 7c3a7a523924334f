"""Owner-only, atomic cache files (decisions, cache artifacts)."""
from __future__ import annotations

import contextlib
import os
import tempfile


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file + ``os.replace``), owner-only (0600):
    a reader sees the old file or the new one, never a torn write."""
    directory = os.path.dirname(path) or "."
    name = os.path.basename(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".tmp", dir=directory)  # mode 0o600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
