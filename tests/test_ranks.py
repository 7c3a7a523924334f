"""Ranks agree on every decision (convlower/selection/ranks.py, docs/distributed.md).

In-process: the store protocol with threads standing for ranks on one store (the first offer
is every rank's answer, also when they race; the same bytes decode the same way on every
rank), and no process group means the process's own decision.

In 2 processes (the spawned group of ``test_fsdp.py``): stub timers that disagree per rank
(rank 0's numbers make it lower the Conv3d and keep the patch conv, rank 1's the opposite).
Without agreement the ranks compile different code (checked, so the test can fail); with it,
every rank compiles the same choices (each site's first rank to decide), byte for byte the same
code.  Static selection too (heuristic with a different platform per rank), and a rank that
decides first deciding for a rank whose own choice differs.
"""
from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist
from torch import nn

from convlower import selection
from convlower.lowerings import RULES
from convlower.lowerings.rule import ConvCall
from convlower.lowerings.site import site_of_call
from convlower.selection import Decision, ranks
from test_fsdp import results


def _site(shape=(1, 8, 4, 6, 6), kernel=(2, 3, 3), stride=(2, 1, 1), padding=(0, 1, 1)):
    x = torch.randn(*shape)
    w = torch.randn(8, shape[1], *kernel)
    return site_of_call(ConvCall.from_args([x, w, None, stride, padding, (1, 1, 1), False,
                                            (0, 0, 0), 1]))


FOLD, SUM = RULES["time_fold_conv2d"], RULES["time_sum_conv2d"]


# --- in-process ---------------------------------------------------------------------------

def test_no_process_group_keeps_the_process_decision():
    assert not dist.is_initialized()
    d = Decision(SUM, "mine", "forced")
    assert ranks.agree(_site(), [FOLD, SUM], d) is d


def test_settle_first_offer_is_every_ranks_answer():
    store = dist.HashStore()
    assert ranks.settle(store, "k", "rank1's") == "rank1's"  # rank 1 got there first
    assert ranks.settle(store, "k", "rank0's") == "rank1's"  # rank 0's own offer is ignored
    # racing offers: every thread ends with the same value, one of the offers
    got = {}
    go = threading.Barrier(8)

    def offer(i):
        go.wait()
        got[i] = ranks.settle(store, "race", f"offer {i}")

    threads = [threading.Thread(target=offer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(set(got.values())) == 1 and got[0] in {f"offer {i}" for i in range(8)}


def test_decode_is_the_same_on_every_rank():
    """Every rank decodes the key's bytes the same way, whatever its own decision was."""
    cands = [FOLD, SUM]
    value = ranks.encode(Decision(FOLD, "measured: fold wins", "measurement", 1.0,
                                  {"aten": 2.0}), rank=1)
    mine = {0: Decision(None, "a", "cache"), 1: Decision(FOLD, "b", "measurement")}
    got = {r: ranks.decode(value, mine[r], cands, 2) for r in (0, 1)}
    assert got[0].rule is got[1].rule is FOLD and got[0].how == got[1].how == "measurement"
    assert got[0].shared == got[1].shared == "rank 1"
    assert got[0].timings == got[1].timings == {"aten": 2.0}
    assert "rank 1's decision, the first of 2 ranks to decide" in got[0].why
    assert "this rank's own choice: the original" in got[0].why
    assert "own choice" not in got[1].why
    # a rule this rank cannot apply, or bytes that do not decode: the original on every rank
    bad = ranks.encode(Decision(RULES["patchify_mm"], "x", "forced"), rank=0)
    assert all(ranks.decode(v, mine[r], cands, 2).rule is None
               for v in (bad, "not json") for r in (0, 1))


def test_the_form_of_a_shared_decision_travels_with_it():
    """A rule's opaque form (one custom op) is part of the decision every rank takes."""
    value = ranks.encode(Decision(FOLD, "screen", "screen", 0.1, {}, opaque=True), rank=0)
    mine = Decision(FOLD, "traced here", "screen")
    got = ranks.decode(value, mine, [FOLD, SUM], 2)
    assert got.rule is FOLD and got.opaque and "own choice: time_fold_conv2d)" in got.why


def test_site_identity_names_no_node_graph_or_device_index():
    a, b = _site(), _site()
    object.__setattr__(b, "node", "convolution_7")
    object.__setattr__(b, "graph", "graph9")
    ia, ib = ranks.site_identity(a, [FOLD]), ranks.site_identity(b, [FOLD])
    assert ia == ib and "device" not in ia["call"] and ia["device"] == "cpu"
    assert ranks.site_identity(_site(shape=(2, 8, 4, 6, 6)), [FOLD]) != ia


# --- in 2 processes -----------------------------------------------------------------------

class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, 4)  # candidates: patchify_mm
        self.temporal = nn.Conv3d(8, 8, (2, 3, 3), (2, 1, 1), (0, 1, 1))  # time_* rules

    def forward(self, image, video):
        return self.patch(image).relu(), self.temporal(video).relu()


# Per-rank stub timers (seconds per call, by label): rank 0 lowers the Conv3d with
# time_fold_conv2d and keeps the patch conv; rank 1 keeps the Conv3d and lowers the patch conv
# (each with patchify_mm, the candidate it times as fastest).
TIMES = {0: {"aten": 1.0, "patchify_mm": 2.0, "patch_linear": 2.0, "time_fold_conv2d": 0.4,
             "time_unfold_conv2d": 0.5, "time_sum_conv2d": 0.6},
         1: {"aten": 1.0, "patchify_mm": 0.5, "patch_linear": 0.5, "time_fold_conv2d": 2.0,
             "time_unfold_conv2d": 2.0, "time_sum_conv2d": 2.0}}


def _measured_select() -> str:
    """The select mode that times every candidate with the injected timer."""
    from convlower.backend import options

    return "exhaustive" if "exhaustive" in options.SELECT_MODES else "measure"


def _compile(rank: int, out_dir: str, tag: str) -> dict:
    import convlower
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    convlower.reset_report()
    selection.set_cache_dir(os.path.join(out_dir, tag))  # cold, and this rank's own
    selection.clear_memory()
    torch.manual_seed(0)
    model = Two()
    f = torch.compile(model, backend="convlower", options={"select": _measured_select()})
    with torch.no_grad():
        _, code = run_and_get_code(f, torch.randn(1, 3, 8, 8), torch.randn(1, 8, 4, 6, 6))
    convs = convlower.report().convolutions
    return {"code": code, "rules": [c["rule"] for c in convs],
            "shared": [c["shared"] for c in convs], "reasons": [c["reason"] for c in convs]}


def part(rank: int, world: int, out_dir: str) -> dict:
    """Runs in each process of the spawned group (test_fsdp.group)."""
    res = {}
    stub = lambda label, fn, budget: TIMES[rank][label]
    prev = selection.set_timer(stub, compiles=False)
    own_agree = ranks.agree
    alone = lambda site, candidates, decision: decision  # what each rank would do by itself
    try:
        ranks.agree = alone
        res["alone"] = _compile(rank, out_dir, "alone")
        ranks.agree = own_agree
        res["agreed"] = _compile(rank, out_dir, "agreed")
    finally:
        ranks.agree = own_agree
        selection.set_timer(prev)
        selection.set_cache_dir(None)
        selection.clear_memory()

    # static selection: the heuristic differs by platform (cpu: keep; hip: time_unfold)
    cands = [RULES["time_unfold_conv2d"], RULES["time_sum_conv2d"]]
    platform = "cpu" if rank == 0 else "hip"
    decide = lambda site: selection.choose(site, cands, "heuristic", platform=platform)
    vae = _site(shape=(1, 8, 5, 8, 8), kernel=(3, 3, 3), stride=(1, 1, 1), padding=(1, 1, 1))
    ranks.agree = alone
    try:
        own = decide(vae)
    finally:
        ranks.agree = own_agree
    agreed = decide(vae)  # both ranks at once: whichever is first
    res["static"] = {"alone": _name(own), "agreed": _name(agreed), "shared": agreed.shared,
                     "why": agreed.why}

    # rank 1 decides first (rank 0 waits at a barrier): rank 0 takes rank 1's choice
    wan = _site(shape=(1, 8, 7, 8, 8), kernel=(3, 3, 3), stride=(1, 1, 1), padding=(1, 1, 1))
    first = decide(wan) if rank == 1 else None
    dist.barrier()
    if rank == 0:
        first = decide(wan)
    res["first"] = {"agreed": _name(first), "shared": first.shared, "why": first.why}
    return res


def _name(decision):
    return decision.rule.name if decision.rule is not None else None


def test_stub_timers_alone_would_make_the_ranks_compile_different_code():
    r0, r1 = (r["alone"] for r in results("ranks"))
    assert r0["rules"] == [None, "time_fold_conv2d"], r0["rules"]  # patch conv, Conv3d
    assert r1["rules"] == ["patchify_mm", None], r1["rules"]
    assert r0["code"] != r1["code"]
    assert r0["shared"] == r1["shared"] == ["", ""]


def test_measured_decisions_agree_every_rank_compiles_the_same_code():
    res = results("ranks")
    r0, r1 = (r["agreed"] for r in res)
    assert r0["rules"] == r1["rules"] and r0["shared"] == r1["shared"]
    assert r0["code"] == r1["code"]
    for i, shared in enumerate(r0["shared"]):
        decider = int(shared.split()[-1])  # "rank N": the first to decide; its own choice
        assert r0["rules"][i] == res[decider]["alone"]["rules"][i], (i, shared, r0["rules"])
        other = res[1 - decider]["agreed"]["reasons"][i]
        assert f"rank {decider}'s decision, the first of 2 ranks to decide; this rank's own " \
               f"choice" in other, other


def test_static_decisions_agree():
    r0, r1 = (r["static"] for r in results("ranks"))
    assert (r0["alone"], r1["alone"]) == (None, "time_unfold_conv2d")  # they would differ
    assert r0["agreed"] == r1["agreed"] and r0["shared"] == r1["shared"]
    decider = int(r0["shared"].split()[-1])
    assert r0["agreed"] == (None, "time_unfold_conv2d")[decider]


def test_the_first_rank_to_decide_decides_for_every_rank():
    r0, r1 = (r["first"] for r in results("ranks"))
    assert r0["agreed"] == r1["agreed"] == "time_unfold_conv2d"  # rank 1's; rank 0's: None
    assert r0["shared"] == r1["shared"] == "rank 1"
    assert "this rank's own choice: the original" in r0["why"]
