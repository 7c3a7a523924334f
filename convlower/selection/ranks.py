"""Decisions shared across the ranks of a process group (see docs/distributed.md).

Without an initialised default process group (or with one rank) a decision is the process's
own.  Under one, **rank 0's decision is every rank's**, whatever the other ranks measured:
measured selection times each rank on its own, and under load one rank could keep the original
convolution while another lowers it, so the ranks would compile different graphs.

How the decision travels: through the default group's key-value store (the one
``init_process_group`` rendezvoused on), never through a collective.  A collective issued from
inside a compile is only safe when every rank compiles the same graphs in the same order; a
rank served from Inductor's cache, a recompile on one rank only (a rank-dependent guard), or a
rank-0-only evaluation would leave it waiting for ever (or paired with another site's, or the
user's, collective).  With the store, rank 0 never waits, and the other ranks wait a bounded
time.

For each convolution site that has candidates, every rank computes the same key: a digest of
what identifies the site (phase, sizes and strides as the graph states them, parameters,
dtype, device type, candidate rules) and how many times this process has asked about an
identical site since the group was created (so two identical convolutions, or the same one
compiled again, get their own keys).  Then, on the store, ``compare_set(key, "", value)``
writes ``value`` only if the key has none yet and returns what the key holds:

* rank 0 writes its decision;
* rank r > 0 polls for the key up to :data:`TIMEOUT_S`; if it is still missing it writes
  ``ABORT`` ("keep the original");
* every rank takes the decision the key holds.

The key is written once, by whichever rank got there first, so every rank that asks ends with
the same value: rank 0's decision in the normal case, or "keep the original" on every rank
when rank 0 was too slow (rank 0 sees the ABORT when it arrives and keeps the original too).
A timeout therefore costs a lowering, never agreement.  Every rank, rank 0 included, decodes
the same bytes the same way, so a payload that cannot be used (e.g. names a rule this rank
cannot apply) keeps the original on every rank alike.

What cannot be made to agree: a rank whose store operation itself fails (the store lives in
rank 0's process; the job is then usually failing anyway) keeps the original without knowing
what the others took, and is warned about; a rank that does not compile a graph (served from
its own Inductor cache) runs whatever it compiled earlier.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from typing import Optional, Sequence

from ..lowerings.rule import Rule
from ..lowerings.site import ConvSite
from .decision import Decision

log = logging.getLogger("convlower")

# How long a rank other than 0 waits for rank 0's decision on one site (seconds).  Ranks
# decide concurrently, so this covers how far rank 0 is behind, e.g. one measurement (bounded
# by the measure budgets) when its decision cache is colder than this rank's.
TIMEOUT_S = float(os.environ.get("CONVLOWER_RANK_TIMEOUT_S", "120"))
ABORT = "\x00convlower: keep the original"
PREFIX = "convlower/agree/"
DECIDER = 0  # the rank whose decision every rank takes

# Decision.shared values
OWN = ""            # no process group (or one rank): the process's own decision
SHARED = "rank 0"   # rank 0's decision, taken by every rank
TIMED_OUT = "timeout"  # rank 0 sent nothing in time: every rank keeps the original
FAILED = "error"    # the store failed on this rank: kept the original, agreement unknown

_lock = threading.Lock()
_counts: dict[str, int] = {}
_group_id: list = [None]


def agree(site: ConvSite, candidates: Sequence[Rule], decision: Decision) -> Decision:
    """The decision every rank takes for ``site``."""
    group = _group()
    if group is None or not candidates:
        # No rule is eligible: every rank keeps the original (eligibility is proven from the
        # site's shapes, the same on every rank), nothing to share.
        return decision
    store, rank, world = group
    key = _key(site, candidates)
    start = time.perf_counter()
    try:
        value, shared = settle(store, key, rank, encode(decision), TIMEOUT_S)
    except Exception as e:  # the store failed here: the one case agreement cannot be known
        why = (f"kept the original: rank {rank} could not share the decision through the "
               f"process group's store ({type(e).__name__}: {e}); other ranks may differ")
        log.warning("convlower: %s convolution %s in %s: %s", site.phase, site.node, site.graph,
                    why)
        return _keep(decision, why, FAILED, time.perf_counter() - start)
    return decode(value, shared, decision, candidates, rank, world,
                  time.perf_counter() - start)


def _group():
    """(store, rank, world size) of the initialised default process group, or None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    if world < 2 or dist.get_backend() == "fake":  # fake: one process stands for all ranks
        return None
    default = dist.distributed_c10d._get_default_group()
    with _lock:
        if _group_id[0] != id(default):  # a new group: occurrence counts start again
            _group_id[0] = id(default)
            _counts.clear()
    store = dist.PrefixStore(PREFIX, dist.distributed_c10d._get_default_store())
    return store, dist.get_rank(), world


def site_identity(site: ConvSite, candidates: Sequence[Rule]) -> dict:
    """What identifies a convolution site on every rank (no node or graph names: those follow
    each process's compile history; no device index: each rank has its own)."""
    call = site.call
    return {
        "phase": site.phase,
        "call": {k: v for k, v in call.describe().items() if k != "device"},
        "device": call.x.device.type,
        "inputs": [[str(s) for s in t.shape] for t in site.inputs if t is not None],
        "strides": [[str(s) for s in t.stride()] for t in site.inputs if t is not None],
        "mask": list(site.output_mask) if site.output_mask else None,
        "pad": list(site.pad_fold.pads) if site.pad_fold else None,
        "produced": site.input_produced,
        "consumed": site.output_consumed,
        "candidates": [r.name for r in candidates],
    }


def _key(site: ConvSite, candidates: Sequence[Rule]) -> str:
    digest = hashlib.sha256(json.dumps(site_identity(site, candidates), sort_keys=True,
                                       default=str).encode()).hexdigest()[:32]
    with _lock:
        n = _counts[digest] = _counts.get(digest, -1) + 1
    return f"{digest}/{n}"


def settle(store, key: str, rank: int, payload: str, timeout_s: float,
           poll_s: float = 0.002) -> tuple[str, bool]:
    """The value ``key`` ends with on the store, and whether it came from the decider.

    The decider writes ``payload``; any other rank waits up to ``timeout_s`` for the key and
    writes ABORT if it is still missing.  ``compare_set`` with an empty expected value writes
    only a missing key and returns the value stored, so the first writer wins on every rank."""
    if rank != DECIDER:
        deadline = time.monotonic() + timeout_s
        while not store.check([key]):
            if time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
            poll_s = min(poll_s * 2, 0.05)
        else:
            return _text(store.get(key)), True
        payload = ABORT
    value = _text(store.compare_set(key, "", payload))
    return value, value != ABORT


def _text(value) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def encode(decision: Decision) -> str:
    rule = decision.rule.name if decision.rule is not None else None
    timings = {k: float(v) for k, v in decision.timings.items()}
    return json.dumps({"rule": rule, "why": decision.why, "how": decision.how,
                       "timings": timings})


def decode(value: str, shared: bool, mine: Decision, candidates: Sequence[Rule], rank: int,
           world: int, waited_s: float = 0.0) -> Decision:
    """The decision this rank takes from the key's value (the same on every rank)."""
    own = mine.rule.name if mine.rule is not None else "the original"
    if not shared:
        return _keep(mine, f"kept the original: no decision from rank {DECIDER} within "
                           f"{TIMEOUT_S:.0f} s (a rank stopped waiting), so no rank lowers this "
                           f"convolution (this rank's own choice: {own})", TIMED_OUT, waited_s)
    try:
        d = json.loads(value)
        name, why, how, timings = d["rule"], str(d["why"]), str(d["how"]), dict(d["timings"])
    except Exception as e:
        return _keep(mine, f"kept the original: rank {DECIDER}'s decision could not be read "
                           f"({type(e).__name__}: {e})", SHARED, waited_s)
    by_name = {r.name: r for r in candidates}
    if name is not None and name not in by_name:
        return _keep(mine, f"kept the original: rank {DECIDER} chose {name}, not eligible here",
                     SHARED, waited_s)
    note = f" (rank {DECIDER}'s decision, shared with {world} ranks"
    note += ")" if rank == DECIDER or (name or "the original") == own else \
        f"; this rank's own choice: {own})"
    return Decision(by_name.get(name), why + note, how, mine.seconds + waited_s, timings,
                    shared=SHARED)


def _keep(mine: Decision, why: str, shared: str, waited_s: float) -> Decision:
    return Decision(None, why, mine.how, mine.seconds + waited_s, dict(mine.timings),
                    shared=shared)
