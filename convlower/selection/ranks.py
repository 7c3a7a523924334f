"""Decisions shared across the ranks of a process group (see docs/distributed.md).

Without an initialised default process group (or with one rank) a decision is the process's
own.  Under one, **the first rank to decide a convolution decides it for every rank**,
whatever the others measured: measured selection times each rank on its own, and under load
one rank could keep the original convolution while another lowers it, so the ranks would
compile different graphs.

How the decision travels: through the default group's key-value store (the one
``init_process_group`` rendezvoused on), never through a collective.  For each convolution
site that has candidates, every rank computes the same key: a digest of what identifies the
site (phase, sizes and strides as the graph states them, parameters, dtype, device type,
candidate rules; no node or graph names, which follow each process's compile history).  Then
every rank calls ``compare_set(key, "", its decision)``: the store writes the value only if the
key has none yet, atomically, and returns what the key holds.  The key is written once, by the
first rank to get there, and every rank takes what it holds.  Like a cached decision, the first
decision for a convolution holds for the group's lifetime: identical convolutions, recompiles,
and compiles under another ``select`` in the same group reuse it.

Why not a collective (rank 0 broadcasting): a collective issued from inside a compile is only
safe when every rank compiles the same graphs in the same order.  A rank served from Inductor's
cache, a recompile on one rank only (a rank-dependent guard), a rank-0-only evaluation, or
pipeline stages that compile different models would leave a rank waiting for ever, or paired
with another site's, or the user's, collective.  Waiting for rank 0 on the store has the same
problem in a milder form (a timeout per site on a rank whose peer never compiles it).  With
``compare_set`` no rank ever waits: one store round trip per site.

Failures: every rank decodes the same bytes the same way, so a value that cannot be used (it
names a rule this rank cannot apply, or does not parse) keeps the original on every rank
alike.  A rank whose store operation itself fails (the store lives in rank 0's process: the
job is usually failing anyway) keeps the original without knowing what the others took: the
one case agreement cannot be guaranteed, and it is warned about and recorded
(``shared == "error"``).  A rank that compiles nothing (served from its own Inductor cache)
runs whatever it compiled earlier.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Sequence

from ..lowerings.rule import Rule
from ..lowerings.site import ConvSite
from .decision import Decision, label, opaque_of

log = logging.getLogger("convlower")

PREFIX = "convlower/agree/"
FAILED = "error"  # Decision.shared when the store failed here (otherwise "rank N"; "" alone)

def agree(site: ConvSite, candidates: Sequence[Rule], decision: Decision) -> Decision:
    """The decision every rank takes for ``site``."""
    group = _group()
    if group is None or not candidates:
        # No rule is eligible: every rank keeps the original (eligibility is proven from the
        # site's shapes, the same on every rank), nothing to share.
        return decision
    store, rank, world = group
    start = time.perf_counter()
    try:
        value = settle(store, _key(site, candidates), encode(decision, rank))
    except Exception as e:  # the store failed here: the one case agreement cannot be known
        why = (f"kept the original: rank {rank} could not share the decision through the "
               f"process group's store ({type(e).__name__}: {e}); other ranks may differ")
        log.warning("convlower: %s convolution %s in %s: %s", site.phase, site.node, site.graph,
                    why)
        return _keep(decision, why, FAILED, time.perf_counter() - start)
    return decode(value, decision, candidates, world, time.perf_counter() - start)


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
    return hashlib.sha256(json.dumps(site_identity(site, candidates), sort_keys=True,
                                     default=str).encode()).hexdigest()[:40]


def settle(store, key: str, payload: str) -> str:
    """What ``key`` holds once this rank has offered ``payload``: ``compare_set`` with an empty
    expected value writes only a key that has no value, atomically, and returns the value
    stored, so the first rank's offer is every rank's answer."""
    value = store.compare_set(key, "", payload)
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def encode(decision: Decision, rank: int) -> str:
    rule = decision.rule.name if decision.rule is not None else None
    timings = {k: float(v) for k, v in decision.timings.items()}
    return json.dumps({"rank": rank, "rule": rule, "opaque": decision.opaque,
                       "why": decision.why, "how": decision.how, "timings": timings})


def decode(value: str, mine: Decision, candidates: Sequence[Rule], world: int,
           waited_s: float = 0.0) -> Decision:
    """The decision this rank takes from the key's value (the same on every rank)."""
    try:
        d = json.loads(value)
        rank, name, why, how = int(d["rank"]), d["rule"], str(d["why"]), str(d["how"])
        timings = {str(k): float(v) for k, v in dict(d["timings"]).items()}
    except Exception as e:
        return _keep(mine, f"kept the original: the shared decision could not be read "
                           f"({type(e).__name__}: {e})", "unreadable", waited_s)
    by_name = {r.name: r for r in candidates}
    if name is not None and name not in by_name:
        return _keep(mine, f"kept the original: rank {rank} chose {name}, not eligible here",
                     f"rank {rank}", waited_s)
    rule = by_name.get(name)
    opaque = opaque_of(d, rule)
    own = mine.label or "the original"
    note = f" (rank {rank}'s decision, the first of {world} ranks to decide"
    note += ")" if (label(name, opaque) or "the original") == own else \
        f"; this rank's own choice: {own})"
    return Decision(rule, why + note, how, mine.seconds + waited_s, timings,
                    shared=f"rank {rank}", opaque=opaque)


def _keep(mine: Decision, why: str, shared: str, waited_s: float) -> Decision:
    return Decision(None, why, mine.how, mine.seconds + waited_s, dict(mine.timings),
                    shared=shared)
