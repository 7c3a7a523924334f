"""What convlower records: one dataclass per convolution, per Snake site and per compile.

The graph passes append records while a graph compiles, the statistics append one per
compile, and :func:`convlower.report` takes a snapshot.  Records read like the dicts of
earlier releases too (``rec["rule"]``, ``rec.get("guards")``), so code written against the
dict report keeps working; ``to_dict()`` is the JSON form.
"""
from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any, Optional


class _Record:
    """Read-only mapping access over a dataclass's fields, and ``to_dict()``."""

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default) if key in self.__dataclass_fields__ else default

    def __contains__(self, key: str) -> bool:
        return key in self.__dataclass_fields__

    def keys(self):
        return self.__dataclass_fields__.keys()

    def to_dict(self) -> dict:
        return copy.deepcopy(dataclasses.asdict(self))


@dataclasses.dataclass
class ConvRecord(_Record):
    """One ``aten.convolution`` (forward) or ``aten.convolution_backward`` node."""

    graph: str
    phase: str                      # "forward" | "backward"
    node: str
    call: dict                      # ConvCall.describe(): sizes as strings (SymInts too)
    rule: Optional[str] = None      # the rule that lowered it, or None (original kept)
    opaque: bool = False            # in the rule's opaque form (one custom op, no kernels)
    reason: str = ""                # why this rule, or why none
    how: str = ""                   # how the decision was made (see selection.HOW)
    decision_s: float = 0.0         # seconds the decision cost (measuring, screening)
    verdicts: list = dataclasses.field(default_factory=list)  # each rule's proof verdict
    guards: list = dataclasses.field(default_factory=list)    # shape guards installed
    timings: dict = dataclasses.field(default_factory=dict)   # seconds per candidate
    output_mask: Optional[list] = None   # backward: which gradients the node computes
    input_produced: bool = True     # input made by an op of the graph (not a graph input)
    output_consumed: bool = True    # forward output read by an op of the graph
    pad_folded: Optional[list] = None    # the constant_pad_nd folded into the conv's padding
    from_cache: bool = False        # recorded by an earlier compile of a cached graph (persist.py)
    shared: str = ""                # across ranks: "" own, "rank N" whose (selection/ranks.py)


@dataclasses.dataclass
class SnakeRecord(_Record):
    graph: str
    node: str
    variant: str
    dtype: str
    route: str                      # "eager" | "fused"
    why: str


@dataclasses.dataclass
class CompileRecord(_Record):
    """One compile convlower took part in (a frame, or a training graph's lazy backward)."""

    compile_id: str
    phase: str
    frame: str
    graphs: list
    graph_breaks: list              # breaks.parse(): reason, location, code, frame, source...
    recompile_reason: Optional[str]
    total_s: float
    phases_s: dict                  # exclusive seconds per phase (stats.PHASES)
    cache: dict
    rewrites: dict                  # rule -> count
    guards: list
    failed: Optional[str]
    end_time_us: Optional[int]
    summary: str = ""
    # C++ kernels built together / loaded from libraries built earlier (torch_kernel_batch)
    kernels: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RegionRecord(_Record):
    """One part of a graph split into regions (regions/): compiled, reused or run as is."""

    graph: str
    part: str
    block: str                      # the region's module class, "(glue)" between regions
    signature: str                  # parts with one signature share one compiled function
    nodes: int
    how: str                        # "compiled" | "reused" | "runs as is (views only)" |
                                    # "compiled whole: ..." (why)
    compile_s: float
    shared_from: str = ""           # the part that compiled the code a reused part calls
    channels_last_out: int = 0      # outputs handed to the next part channels-last (seams.py)
    inputs_converted: int = 0       # inputs the split graph converts to its layout per call
    whole: bool = False             # not split: "auto" found too little repeated (the graph)
    direct: Optional[bool] = None   # inference calls go straight to Inductor's code
                                    # (torch_direct.py); None until its first call


KINDS = {"convolutions": ConvRecord, "snake": SnakeRecord, "compiles": CompileRecord,
         "regions": RegionRecord}

_lock = threading.Lock()
_records: dict[str, list] = {kind: [] for kind in KINDS}
# Run before a snapshot or a reset: compile statistics are collected lazily (stats.py).
before_snapshot: list = []


def record(rec: _Record) -> None:
    kind = next(k for k, cls in KINDS.items() if isinstance(rec, cls))
    with _lock:
        _records[kind].append(rec)


def records(kind: str) -> list:
    """A copy of the records of one kind (no collection hooks run)."""
    with _lock:
        return copy.deepcopy(_records[kind])


def snapshot() -> dict[str, list]:
    for hook in before_snapshot:
        hook()
    with _lock:
        return copy.deepcopy(_records)


def clear() -> None:
    for hook in before_snapshot:
        hook()
    with _lock:
        for v in _records.values():
            v.clear()
