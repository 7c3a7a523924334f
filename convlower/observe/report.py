"""``convlower.report()``: a snapshot of what convlower decided since the last reset.

``str()`` is readable at 120 columns (long reasons and guard lists are cut in the table and
wrapped below it, graph breaks get a section of their own) and ``to_dict()`` is JSON-ready
with every text in full.  A graph served from Inductor's or AOTAutograd's cache runs no pass:
its convolutions are the records its first compile saved (persist.py), marked ``from_cache``.
"""
from __future__ import annotations

import textwrap
from typing import Any

from . import breaks as _breaks
from . import records as _records

WIDTH = 120
GUARDS_SHOWN = 6  # per convolution in the guards section; to_dict() has them all


def reset_report() -> None:
    """Forget everything recorded so far, including finished compiles whose statistics were
    not collected yet (otherwise they would surface in the next report)."""
    _records.clear()


def report() -> "Report":
    """A snapshot of what convlower decided since the last :func:`reset_report`."""
    return Report(_records.snapshot())


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(width - 3, 0)] + "..."


def _fmt_table(rows: list[list[str]], head: list[str], flexible: tuple = (),
               width: int = WIDTH) -> str:
    """Columns two spaces apart; the ``flexible`` columns (widest first) are cut so that a
    line fits ``width``."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    while sum(widths) + 2 * (len(widths) - 1) > width and flexible:
        i = max(flexible, key=lambda j: widths[j])
        if widths[i] <= max(12, len(head[i])):
            break
        widths[i] -= 1
    line = lambda r: "  ".join(_cut(c, w).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _wrap_phrases(text: str, width: int = WIDTH) -> str:
    """A one-line summary ("head: a; b; c") on lines of at most ``width``, broken between
    its phrases (a phrase longer than a line is wrapped by itself)."""
    head, sep, rest = text.partition(": ")
    phrases = [head + sep.rstrip()] + rest.split("; ") if sep else text.split("; ")
    lines: list[str] = []
    for i, p in enumerate(phrases):
        p += ";" if 0 < i < len(phrases) - 1 else ""
        if lines and len(lines[-1]) + 1 + len(p) <= width:
            lines[-1] += " " + p
        else:
            lines += textwrap.wrap(p, width, initial_indent="    " if lines else "",
                                   subsequent_indent="    ")
    return "\n".join(lines)


def _decided(c) -> str:
    """The rule or why none, with how the decision was made and what deciding cost."""
    what = (f"{c.rule} (opaque form)" if c.rule and c.opaque else c.rule) or c.reason
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
    def regions(self) -> list[_records.RegionRecord]:
        return self._data.get("regions", [])

    @property
    def compiles(self) -> list[_records.CompileRecord]:
        return self._data.get("compiles", [])

    def lowered(self, phase: str | None = None) -> list[_records.ConvRecord]:
        return [c for c in self.convolutions if c.rule and (phase is None or c.phase == phase)]

    def to_dict(self) -> dict[str, Any]:
        return {kind: [r.to_dict() for r in recs] for kind, recs in self._data.items()}

    def __str__(self) -> str:
        parts = [self._conv_table()]
        guards = self._guard_lines()
        if guards:
            parts.append("guards (all of them in to_dict()):\n" + "\n".join(guards))
        if self.snake:
            rows = [[s.graph, s.node, s.variant, s.dtype, s.route, s.why] for s in self.snake]
            parts.append("snake sites:\n" + _fmt_table(
                rows, ["graph", "node", "variant", "dtype", "route", "why"], flexible=(5,)))
        if self.regions:
            parts.append(self._region_table())
        seen, gbs = set(), []
        for b in (b for s in self.compiles for b in s.graph_breaks):
            key = (b.get("location"), b.get("reason"))
            if key not in seen:
                seen.add(key)
                gbs.append(_breaks.describe(b, WIDTH - 2).replace("\n", "\n  "))
        if gbs:
            parts.append(f"graph breaks ({len(gbs)}):\n" + "\n".join("  " + g for g in gbs))
        parts += [_wrap_phrases(s.summary) for s in self.compiles if s.summary]
        return "\n\n".join(parts)

    def _region_table(self) -> str:
        """One row per distinct region: block, signature, instances, compiled once / reused."""
        rows: dict = {}
        for r in self.regions:
            if not r.signature:
                continue
            row = rows.setdefault(r.signature, [r.block, r.signature, 0, 0, 0.0, r.nodes])
            row[2] += 1
            row[3] += r.how == "reused"
            row[4] += r.compile_s
        table = [[b, s, str(n), f"once, reused {k}x" if n > 1 else "once", f"{t:.2f}", str(nodes)]
                 for b, s, n, k, t, nodes in rows.values()]
        whole = [f"{r.graph}: {r.how}" for r in self.regions if r.whole]
        views = sum(1 for r in self.regions if not r.signature) - len(whole)
        seams = sum(r.channels_last_out for r in self.regions)
        converted = sum(r.inputs_converted for r in self.regions)
        called = [r.direct for r in self.regions if r.direct is not None]
        direct = (f", {sum(called)} of {len(called)} parts called so far straight into "
                  f"Inductor's code" if called else "")
        head = ["block", "signature", "instances", "compiled", "compile s", "nodes"]
        return (f"regions ({len(self.regions) - len(whole)} parts, {len(rows)} compiled, "
                f"{views} run as is, {seams} seams channels-last, {converted} inputs converted "
                f"per call{direct}):\n"
                + _fmt_table(table, head, flexible=(0,))
                + "".join(f"\n{w}" for w in whole))

    def _conv_table(self) -> str:
        if not self.convolutions:
            return "convolutions: none seen"
        rows = []
        for c in self.convolutions:
            call = c.call or {}
            size = lambda k, sep, skip=0: sep.join(map(str, call.get(k, ["?"])[skip:])) or "?"
            n = len(c.guards)
            guards = "-" if not n else c.guards[0] if n == 1 else f"{n}: see below"
            rows.append([c.graph, c.phase, c.node, size("input", "x"), size("weight", "x", 2),
                         size("stride", ","), size("padding", ","), call.get("dtype", "?"),
                         _decided(c), guards, "cache" if c.from_cache else "-"])
        head = ["graph", "phase", "node", "input", "kernel", "stride", "pad", "dtype",
                "rule / why not", "guards", "from"]
        if not any(c.from_cache for c in self.convolutions):  # no column of dashes
            head, rows = head[:-1], [r[:-1] for r in rows]
        return "convolutions:\n" + _fmt_table(rows, head, flexible=(8, 9, 2, 3))

    def _guard_lines(self) -> list[str]:
        out = []
        for c in self.convolutions:
            if len(c.guards) < 2 and all(len(g) <= 40 for g in c.guards):
                continue  # fits in the table
            out.append(f"  {c.graph} {c.phase} {c.node}:")
            for g in c.guards[:GUARDS_SHOWN]:
                out += textwrap.wrap(g, WIDTH, initial_indent="    ", subsequent_indent="      ")
            if len(c.guards) > GUARDS_SHOWN:
                out.append(f"    ... and {len(c.guards) - GUARDS_SHOWN} more")
        return out

    __repr__ = __str__
