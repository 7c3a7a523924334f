"""What convlower decided: one record per convolution call (and per Snake site), per graph.

``convlower.report()`` returns a :class:`Report` snapshot of everything recorded since the last
``convlower.reset_report()``; ``str()`` is a readable table and ``to_dict()`` is JSON-ready.
Records are appended by the graph passes while a graph compiles.  A graph served from
Inductor's or AOTAutograd's cache runs no pass, so it adds no per-conv record; the compile
statistics say when that happened.
"""
from __future__ import annotations

import copy
import threading
from typing import Any

_lock = threading.Lock()
_records: dict[str, list[dict]] = {"convolutions": [], "snake": [], "compiles": []}


def record(kind: str, entry: dict) -> None:
    with _lock:
        _records.setdefault(kind, []).append(entry)


def records(kind: str) -> list[dict]:
    """A copy of the records of one kind (no collection hooks run)."""
    with _lock:
        return copy.deepcopy(_records.get(kind, []))


# Run by report() before the snapshot: compile statistics are collected lazily (stats.py).
before_snapshot: list = []


def reset_report() -> None:
    """Forget everything recorded so far, including finished compiles whose statistics were
    not collected yet (otherwise they would surface in the next report)."""
    for hook in before_snapshot:
        hook()
    with _lock:
        for v in _records.values():
            v.clear()


def report() -> "Report":
    """A snapshot of what convlower decided since the last :func:`reset_report`."""
    for hook in before_snapshot:
        hook()
    with _lock:
        return Report(copy.deepcopy(_records))


def _fmt_table(rows: list[list[str]], head: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


class Report:
    def __init__(self, data: dict[str, list[dict]]):
        self._data = data

    @property
    def convolutions(self) -> list[dict]:
        return self._data.get("convolutions", [])

    @property
    def snake(self) -> list[dict]:
        return self._data.get("snake", [])

    @property
    def compiles(self) -> list[dict]:
        return self._data.get("compiles", [])

    def lowered(self, phase: str | None = None) -> list[dict]:
        return [c for c in self.convolutions if c["rule"] and (phase is None or c["phase"] == phase)]

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._data)

    def __str__(self) -> str:
        parts = []
        convs = self.convolutions
        if convs:
            rows = []
            for c in convs:
                call = c["call"]
                why = c["rule"] or c["reason"]
                rows.append([c["graph"], c["phase"], c["node"], "x".join(call["input"]),
                             "x".join(call["weight"][2:]),
                             ",".join(map(str, call["stride"])), ",".join(map(str, call["padding"])),
                             call["dtype"], why, "; ".join(c["guards"]) or "-"])
            parts.append("convolutions:\n" + _fmt_table(
                rows, ["graph", "phase", "node", "input", "kernel", "stride", "pad", "dtype",
                       "rule / why not", "guards"]))
        else:
            parts.append("convolutions: none seen")
        if self.snake:
            rows = [[s["graph"], s["node"], s["variant"], s["dtype"], s["route"], s["why"]]
                    for s in self.snake]
            parts.append("snake sites:\n" + _fmt_table(
                rows, ["graph", "node", "variant", "dtype", "route", "why"]))
        for s in self.compiles:
            if "summary" in s:
                parts.append(s["summary"])
        return "\n\n".join(parts)

    __repr__ = __str__
