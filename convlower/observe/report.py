"""``convlower.report()``: a snapshot of what convlower decided since the last reset.

``str()`` is a readable table and ``to_dict()`` is JSON-ready.  A graph served from
Inductor's or AOTAutograd's cache runs no pass, so it adds no per-conv record; the compile
statistics say when that happened.
"""
from __future__ import annotations

from typing import Any

from . import records as _records


def reset_report() -> None:
    """Forget everything recorded so far, including finished compiles whose statistics were
    not collected yet (otherwise they would surface in the next report)."""
    _records.clear()


def report() -> "Report":
    """A snapshot of what convlower decided since the last :func:`reset_report`."""
    return Report(_records.snapshot())


def _fmt_table(rows: list[list[str]], head: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _decided(c) -> str:
    """The rule or why none, with how the decision was made and what deciding cost."""
    what = c.rule or c.reason
    if not c.how:
        return what
    cost = f", {c.decision_s:.2f} s" if c.decision_s >= 0.005 else ""
    return f"{what} [{c.how}{cost}]"


class Report:
    def __init__(self, data: dict[str, list]):
        self._data = data

    @property
    def convolutions(self) -> list[_records.ConvRecord]:
        return self._data.get("convolutions", [])

    @property
    def snake(self) -> list[_records.SnakeRecord]:
        return self._data.get("snake", [])

    @property
    def compiles(self) -> list[_records.CompileRecord]:
        return self._data.get("compiles", [])

    def lowered(self, phase: str | None = None) -> list[_records.ConvRecord]:
        return [c for c in self.convolutions if c.rule and (phase is None or c.phase == phase)]

    def to_dict(self) -> dict[str, Any]:
        return {kind: [r.to_dict() for r in recs] for kind, recs in self._data.items()}

    def __str__(self) -> str:
        parts = []
        if self.convolutions:
            rows = []
            for c in self.convolutions:
                call = c.call
                rows.append([c.graph, c.phase, c.node, "x".join(call["input"]),
                             "x".join(call["weight"][2:]),
                             ",".join(map(str, call["stride"])), ",".join(map(str, call["padding"])),
                             call["dtype"], _decided(c), "; ".join(c.guards) or "-"])
            parts.append("convolutions:\n" + _fmt_table(
                rows, ["graph", "phase", "node", "input", "kernel", "stride", "pad", "dtype",
                       "rule / why not", "guards"]))
        else:
            parts.append("convolutions: none seen")
        if self.snake:
            rows = [[s.graph, s.node, s.variant, s.dtype, s.route, s.why] for s in self.snake]
            parts.append("snake sites:\n" + _fmt_table(
                rows, ["graph", "node", "variant", "dtype", "route", "why"]))
        parts += [s.summary for s in self.compiles if s.summary]
        return "\n\n".join(parts)

    __repr__ = __str__
