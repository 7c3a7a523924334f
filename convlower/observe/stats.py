"""Compile statistics: what Dynamo, AOTAutograd, Inductor and convlower did for each compile.

One record per compile that convlower took part in (a Dynamo frame compile, and separately the
lazily compiled backward of a training graph), appended to the report as kind ``"compiles"``:
graphs, graph breaks (Dynamo's reason and explanation, the graph-break code, the user's frame
and code line: breaks.py), the recompile reason, exclusive compile time per phase (Dynamo,
AOTAutograd, Inductor, code generation, convlower's own rule selection; they sum to the
compile's total), FX-graph and AOTAutograd cache hits and misses,
rewrites per rule and the shape guards convlower added.

How: Dynamo records a ``CompilationMetrics`` entry when a compile ends; convlower notes its own
events (a graph reached the backend, the pass ran for so long, a graph break was logged) with
the compile id and a timestamp, and joins the two.  The metrics entry is written *after*
Dynamo's end-of-compile callback, so records are collected lazily: when the next compile
starts, when ``convlower.report()`` is called, at the end of ``convlower.warmup()``, or by
:func:`collect`.  Each collected record is logged on the ``convlower`` logger (one line at
INFO, the full record at DEBUG) and emitted as the structured-trace artifact
``convlower_compile_stats`` so ``TORCH_TRACE`` + tlparse show it next to PyTorch's own.

The torch internals it reads (metrics, counters, callbacks, loggers) are wrapped in
:mod:`convlower.torch_internals`; each degrades to "unknown" instead of failing a compile.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, Optional

from .. import torch_internals as ti
from . import breaks as _breaks
from . import records as _records
from .records import CompileRecord

log = logging.getLogger("convlower")

PHASES = ("dynamo", "aot_autograd", "inductor", "codegen", "convlower")
ARTIFACT = "convlower_compile_stats"


def cache_counts(before: dict, after: dict) -> dict[str, int]:
    """FX-graph and AOTAutograd cache hits / misses / bypasses between two :func:`counters`."""
    def delta(group, key):
        return after.get(group, {}).get(key, 0) - before.get(group, {}).get(key, 0)

    return {"fx_graph_hit": delta("inductor", "fxgraph_cache_hit"),
            "fx_graph_miss": delta("inductor", "fxgraph_cache_miss"),
            "fx_graph_bypass": delta("inductor", "fxgraph_cache_bypass"),
            "aot_autograd_hit": delta("aot_autograd", "autograd_cache_hit"),
            "aot_autograd_miss": delta("aot_autograd", "autograd_cache_miss"),
            "aot_autograd_bypass": delta("aot_autograd", "autograd_cache_bypass")}



# -- convlower's own events -----------------------------------------------------------------
_lock = threading.RLock()
_events: list[dict] = []           # {"t": us, "cid": str, "kind": "graph"|"pass"|"break", ...}
_convlower_ids: dict[str, int] = {}  # compile id -> when a graph of it reached the backend
_done: set[tuple] = set()          # metrics entries already turned into records
_frames: dict[str, str] = {}       # compile id -> frame, for the backward's record
_installed = False


def now_us() -> int:
    return time.time_ns() // 1000


def _event(kind: str, **data) -> None:
    with _lock:
        _events.append({"t": now_us(), "cid": ti.current_compile_id(), "kind": kind, **data})


def note_graph(graph_name: str) -> None:
    """Called by the backend for every graph it receives."""
    install()
    cid = ti.current_compile_id()
    with _lock:
        if cid is not None:
            _convlower_ids[cid] = now_us()
    _event("graph", graph=graph_name)


def note_pass(graph_name: str, seconds: float) -> None:
    """Called by the graph pass with the time it spent (proof, selection, tracing, splicing)."""
    _event("pass", graph=graph_name, seconds=seconds)


def note_kernels(built: int, loaded: int, libraries: int, seconds: float) -> None:
    """Called when a generated module's C++ kernels are built together (or loaded from
    libraries built earlier): what the kernel builds of this compile cost."""
    _event("kernels", built=built, loaded=loaded, libraries=libraries, seconds=seconds)


class _GraphBreakHandler(logging.Handler):
    """Reads Dynamo's graph-break log lines (breaks.py): location, reason, graph-break code,
    the user's frame and code line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            b = _breaks.parse(record.getMessage())
            if b is not None:
                _event("break", **b)
        except Exception:
            pass


_handler = _GraphBreakHandler(logging.DEBUG)


def _arm_graph_break_log() -> None:
    # Dynamo formats the location only when its graph_breaks log is enabled; enable it for our
    # handler alone (propagate off) unless the user already enabled it (then share it).
    lg = ti.graph_break_logger()
    if lg is None:
        return
    if _handler not in lg.handlers:
        lg.addHandler(_handler)
    if not lg.isEnabledFor(logging.DEBUG):
        lg.setLevel(logging.DEBUG)
        lg.propagate = False


def _on_start(args) -> None:
    try:
        collect()
        _arm_graph_break_log()
    except Exception as e:  # statistics must never break a compile
        log.debug("convlower stats: %r", e)


def _on_end(args) -> None:
    pass  # the metrics entry is written after this callback; collected at the next start


def install() -> None:
    """Start recording (idempotent).  Done on first use of the backend and by warm-up."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    ti.on_compile(_on_start, _on_end)
    _arm_graph_break_log()
    _records.before_snapshot.append(collect)


# -- records -------------------------------------------------------------------------------
def _s(us: Optional[int]) -> float:
    return (us or 0) / 1e6


def _phases(m, pass_s: float) -> tuple[float, dict[str, float]]:
    """Exclusive seconds per phase.  Dynamo's columns nest: frame > AOTAutograd > Inductor >
    code generation, and convlower's pass runs inside Inductor before code generation."""
    forward = m.is_forward is not False
    if forward:
        total = _s(m.dynamo_cumulative_compile_time_us)
        aot = _s(m.aot_autograd_cumulative_compile_time_us)
    else:  # the lazily compiled backward: all of it is AOTAutograd's backward compile
        total = aot = _s(m.backward_cumulative_compile_time_us)
    if not total and m.start_time_us and m.end_time_us:
        total = _s(m.end_time_us - m.start_time_us)
    inductor = _s(m.inductor_cumulative_compile_time_us)
    codegen = _s(m.inductor_code_gen_cumulative_compile_time_us)
    phases = {"dynamo": max(total - aot, 0.0), "aot_autograd": max(aot - inductor, 0.0),
              "inductor": max(inductor - codegen - pass_s, 0.0), "codegen": codegen,
              "convlower": pass_s}
    return total, {k: round(v, 6) for k, v in phases.items()}


def _frame(m) -> str:
    if not m.co_name:  # a lazily compiled backward: name the forward's frame
        return _frames.get(str(m.compile_id), "?")
    where = f"{m.co_filename}:{m.co_firstlineno}" if m.co_filename else "?"
    return f"{m.co_name or '?'} ({where})"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def summary_line(r: dict) -> str:
    p = r["phases_s"]
    c = r["cache"]
    parts = [f"convlower compile {r['compile_id']} {r['phase']} {r['frame']}: "
             f"{_plural(len(r['graphs']), 'graph')}, {_plural(len(r['graph_breaks']), 'graph break')}"
             + "".join(f" at {_breaks.short(b)}" for b in r["graph_breaks"][:1])]
    if r["recompile_reason"]:
        parts.append(f"recompile ({r['recompile_reason']})")
    parts.append(f"{r['total_s']:.2f} s = " + " + ".join(f"{k} {p[k]:.2f}" for k in PHASES))
    parts.append(f"cache fx {c['fx_graph_hit']} hit/{c['fx_graph_miss']} miss, "
                 f"aot {c['aot_autograd_hit']} hit/{c['aot_autograd_miss']} miss")
    k = r.get("kernels") or {}
    if k.get("built") or k.get("loaded"):
        n = k["libraries"]
        parts.append(f"C++ kernels: {k['built']} built in {n} librar{'y' if n == 1 else 'ies'} "
                     f"({k['seconds']:.2f} s), {k['loaded']} loaded from earlier builds")
    rw = ", ".join(f"{k} x{v}" for k, v in sorted(r["rewrites"].items())) or "none"
    parts.append(f"rewrites {rw}; {_plural(len(r['guards']), 'guard')}")
    if r["failed"]:
        parts.append(f"FAILED: {r['failed']}")
    return "; ".join(parts)


def _make_record(m, events: list[dict], convs: list) -> CompileRecord:
    phase = "backward" if m.is_forward is False else "forward"
    graphs = sorted({e["graph"] for e in events if e["kind"] in ("graph", "pass")},
                    key=lambda g: (len(g), g))
    pass_s = sum(e["seconds"] for e in events if e["kind"] == "pass")
    total, phases = _phases(m, pass_s)
    mine = [c for c in convs if c.graph in graphs and c.phase == phase]
    rewrites: dict[str, int] = {}
    for c in mine:
        if c.rule:
            rewrites[c.rule] = rewrites.get(c.rule, 0) + 1
    breaks = [{k: v for k, v in e.items() if k not in ("t", "cid", "kind")} for e in events
              if e["kind"] == "break"]
    rec = CompileRecord(
        compile_id=str(m.compile_id), phase=phase, frame=_frame(m), graphs=graphs,
        graph_breaks=breaks,
        recompile_reason=m.recompile_reason if phase == "forward" else None,
        total_s=round(total, 6), phases_s=phases,
        cache=ti.compile_cache_counts(m),
        rewrites=rewrites, guards=[g for c in mine for g in c.guards],
        failed=m.fail_reason.splitlines()[0] if m.fail_reason else None,
        end_time_us=m.end_time_us, kernels=_kernels(events))
    rec.summary = summary_line(rec)
    return rec


def _kernels(events: list[dict]) -> dict:
    evs = [e for e in events if e["kind"] == "kernels"]
    return {key: round(sum(e[key] for e in evs), 3)
            for key in ("built", "loaded", "libraries", "seconds")} if evs else {}


def collect() -> list[CompileRecord]:
    """Turn finished compiles into ``"compiles"`` report records; return the new records."""
    if not _installed:
        return []
    new = []
    with _lock:
        metrics = ti.compilation_metrics()
        convs = _records.records("convolutions")
        newest_end = 0
        for m in metrics:
            key = (str(m.compile_id), m.is_forward, m.start_time_us)
            if key in _done or m.start_time_us is None or m.end_time_us is None:
                continue
            _done.add(key)
            cid = str(m.compile_id)
            evs = [e for e in _events
                   if e["cid"] == cid and m.start_time_us <= e["t"] <= m.end_time_us]
            ours = any(e["kind"] != "break" for e in evs)
            if m.is_forward is False:  # a backward served from the cache runs no pass
                ours = ours or _convlower_ids.get(cid, m.start_time_us + 1) <= m.start_time_us
            elif not ours:
                _convlower_ids.pop(cid, None)  # ids restart after torch.compiler.reset()
            if not ours and not (evs and _convlower_ids):
                continue  # another backend's compile (or a graph-less frame before convlower ran)
            if m.co_name:
                _frames[cid] = _frame(m)
            new.append(_make_record(m, evs, convs))
            newest_end = max(newest_end, m.end_time_us)
        if newest_end:
            _events[:] = [e for e in _events if e["t"] > newest_end]
    for rec in new:
        _records.record(rec)
        log.info("%s", rec.summary)
        log.debug("convlower compile statistics: %s", json.dumps(rec.to_dict(), default=str, indent=1))
        ti.trace_artifact(ARTIFACT, rec.to_dict(), rec.compile_id)
    return new


def record_whole_compile(frame: str, total_s: float, since_us: int) -> CompileRecord:
    """The record of a compile made by torch's AOT compile (a saved compile, saved/).  torch
    writes no frame metrics for it, only Inductor's own timings without a compile id; so the
    phases are Inductor's and convlower's, and the rest of the wall time is reported under
    ``dynamo`` (Dynamo and AOTAutograd together, not split)."""
    install()
    with _lock:
        ms = [m for m in ti.compilation_metrics() if m.compile_id is None
              and (m.start_time or 0) * 1e6 >= since_us]
        evs = [e for e in _events if e["cid"] is None and e["t"] >= since_us]
    inductor = sum(m.inductor_compile_time_s or 0.0 for m in ms)
    codegen = sum(m.code_gen_time_s or 0.0 for m in ms)
    pass_s = sum(e["seconds"] for e in evs if e["kind"] == "pass")
    graphs = sorted({e["graph"] for e in evs if e["kind"] in ("graph", "pass")})
    convs = [c for c in _records.records("convolutions") if c.graph in graphs]
    rewrites: dict[str, int] = {}
    for c in convs:
        if c.rule:
            rewrites[c.rule] = rewrites.get(c.rule, 0) + 1
    phases = {"dynamo": max(total_s - inductor, 0.0), "aot_autograd": 0.0,
              "inductor": max(inductor - codegen - pass_s, 0.0), "codegen": codegen,
              "convlower": pass_s}
    rec = CompileRecord(
        compile_id="aot", phase="forward", frame=frame, graphs=graphs, graph_breaks=[],
        recompile_reason=None, total_s=round(total_s, 6),
        phases_s={k: round(v, 6) for k, v in phases.items()},
        cache={k: 0 for k in cache_counts({}, {})}, rewrites=rewrites,
        guards=[g for c in convs for g in c.guards], failed=None, end_time_us=now_us())
    rec.summary = summary_line(rec) + " (whole-graph AOT compile: dynamo includes AOTAutograd)"
    _records.record(rec)
    return rec


def totals(records: list) -> dict[str, Any]:
    """Sum a list of ``"compiles"`` records (e.g. those of one warm-up)."""
    out: dict[str, Any] = {
        "compiles": len(records),
        "graphs": len({g for r in records for g in r["graphs"]}),
        "graph_breaks": [b for r in records for b in r["graph_breaks"]],
        "recompiles": [{"compile_id": r["compile_id"], "reason": r["recompile_reason"]}
                       for r in records if r["recompile_reason"]],
        "total_s": round(sum(r["total_s"] for r in records), 6),
        "phases_s": {k: round(sum(r["phases_s"][k] for r in records), 6) for k in PHASES},
        "cache": {}, "rewrites": {}, "guards": [g for r in records for g in r["guards"]],
        "failed": [r["failed"] for r in records if r["failed"]],
    }
    for r in records:
        for k, v in r["cache"].items():
            out["cache"][k] = out["cache"].get(k, 0) + v
        for k, v in r["rewrites"].items():
            out["rewrites"][k] = out["rewrites"].get(k, 0) + v
    return out


class window:
    """``with stats.window() as w: ...`` -> ``w.records``: the compiles that ended inside."""

    def __enter__(self) -> "window":
        install()
        collect()
        self.start_us = now_us()
        self.records: list[dict] = []
        return self

    def __exit__(self, *exc) -> None:
        collect()
        self.records = [r for r in _records.records("compiles")
                        if (r.end_time_us or 0) >= self.start_us]
