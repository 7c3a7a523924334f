"""FSDP2 (``fully_shard``): 2 CPU processes (gloo) train a model whose patch embedding and
Conv3d convlower lowers; losses, gradients and parameters equal the same training under eager
FSDP2, in fp32 (tight), with activation checkpointing, and with bf16 parameters reduced in fp32
(looser).  Parameters stay ``DTensor``s sharded on dim 0, and no gathered copy outlives a step.

All multi-process checks of this suite run in **one** spawned group (:func:`group`), started
once per session, because starting processes and compiling dominate their cost:

* this file: FSDP2 training (3 compiled runs);
* ``test_parallel_conv.py``: a spatially parallel Conv3d (halo exchange) compiled by convlower;
* ``test_ranks.py``: ranks agree on every decision (stub timers that disagree per rank).

Each part runs in both processes and saves what its tests check; a part that fails saves its
traceback, and its tests fail with it.  ``tests/test_ddp.py`` (DDP) starts its own group.
"""
from __future__ import annotations

import atexit
import functools
import gc
import os
import shutil
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

STEPS = 3
GROUP_TIMEOUT_S = float(os.environ.get("CONVLOWER_TEST_GROUP_TIMEOUT_S", "900"))
# run in this order in each process (CONVLOWER_TEST_PARTS: a subset, when working on one)
PARTS = tuple(os.environ.get("CONVLOWER_TEST_PARTS", "fsdp,parallel_conv,ranks").split(","))


# --- the spawned group --------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _part(name: str):
    if name == "fsdp":
        return fsdp_part
    if name == "parallel_conv":
        import test_parallel_conv
        return test_parallel_conv.part
    import test_ranks
    return test_ranks.part


def _worker(rank: int, world: int, port: int, out_dir: str):
    import convlower

    torch.set_num_threads(1)
    # The tests read per-conv report records, which a graph served from Inductor's FX graph or
    # AOTAutograd cache does not produce: those caches are off.  The compiled-kernel cache
    # stays on (it only saves the C++ compiler's time).  One compile thread: no worker pool.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.compile_threads = 1
    # Scalar C++ kernels: Inductor's vectorised codegen costs seconds per graph on this CPU
    # and is not what these tests are about (convlower's pass runs before it).
    torch._inductor.config.cpp.vec_isa_ok = False
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        for name in PARTS:
            torch._dynamo.reset()
            convlower.reset_report()
            start = time.perf_counter()
            try:
                res = _part(name)(rank, world, os.path.join(out_dir, f"{name}{rank}"))
            except Exception:
                res = {"error": traceback.format_exc()}
            res["seconds"] = time.perf_counter() - start
            torch.save(res, os.path.join(out_dir, f"{name}.rank{rank}.pt"))
            dist.barrier()  # a failed part must not leave the other rank inside a collective
    finally:
        dist.destroy_process_group()


def run_group(out_dir: str, world: int = 2, timeout_s: float = GROUP_TIMEOUT_S) -> dict:
    """{part: [rank 0's results, rank 1's, ...]}; the processes are killed past timeout_s."""
    start = time.perf_counter()
    ctx = mp.spawn(_worker, args=(world, free_port(), out_dir), nprocs=world, join=False)
    while not ctx.join(timeout=1):
        if time.perf_counter() - start > timeout_s:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"the spawned group ran past {timeout_s:.0f} s (a hang?)")
    out = {}
    for name in PARTS:
        out[name] = [torch.load(os.path.join(out_dir, f"{name}.rank{r}.pt"), weights_only=False)
                     for r in range(world)]
    out["seconds"] = time.perf_counter() - start
    return out


@functools.lru_cache(maxsize=None)
def group() -> dict:
    """The group's results, computed once per test session (whichever test asks first)."""
    out_dir = tempfile.mkdtemp(prefix="convlower-group-")
    atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    return run_group(out_dir)


def results(part: str) -> list[dict]:
    res = group()[part]
    for rank, r in enumerate(res):
        assert "error" not in r, f"rank {rank}, part {part}:\n{r['error']}"
    return res


# --- FSDP2 --------------------------------------------------------------------------------

class Block(nn.Module):
    """A patch embedding (Conv3d, kernel == stride: patchify_mm) and a temporal Conv3d
    ((2,3,3) stride (2,1,1): time_fold_conv2d).  With ``ac`` both run under activation
    checkpointing: the backward recomputes the patch embedding."""

    def __init__(self, ac: bool):
        super().__init__()
        self.ac = ac
        self.embed = nn.Conv3d(3, 8, (1, 2, 2), stride=(1, 2, 2))
        self.temporal = nn.Conv3d(8, 8, (2, 3, 3), stride=(2, 1, 1), padding=(0, 1, 1))

    def body(self, x):
        return self.temporal(F.gelu(self.embed(x)))

    def forward(self, x):
        if self.ac:
            return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


class Net(nn.Module):
    def __init__(self, ac: bool):
        super().__init__()
        self.block = Block(ac)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.block(x).mean((2, 3, 4)))


def _resharded(model: nn.Module) -> bool:
    """Every FSDP parameter is back to its shard and the all-gathered storage is freed."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    for module in (model, model.block):
        for pg in module._get_fsdp_state()._fsdp_param_groups:
            for fp in pg.fsdp_params:
                if fp.sharded_state != ShardedState.SHARDED or any(
                        t.untyped_storage().size() for t in fp.all_gather_outputs):
                    return False
    return True


def _gathered_copies(full_shapes: set) -> int:
    """Live plain tensors with a conv weight's unsharded shape and memory behind them."""
    gc.collect()
    n = 0
    for obj in gc.get_objects():
        try:
            if type(obj) in (torch.Tensor, nn.Parameter) and tuple(obj.shape) in full_shapes \
                    and obj.untyped_storage().size() > 0:
                n += 1
        except Exception:  # objects that are half torn down
            pass
    return n


def _fsdp_train(rank: int, compiled: bool, ac: bool, bf16: bool) -> dict:
    import convlower
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Shard

    torch.manual_seed(0)  # the same initial weights on every rank (FSDP shards them)
    model = Net(ac)
    full_shapes = {tuple(m.weight.shape) for m in (model.block.embed, model.block.temporal)}
    policy = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else {}
    fully_shard(model.block, mp_policy=MixedPrecisionPolicy(**policy))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32
                                                     if bf16 else None))
    if compiled:  # per block, as torchtitan does: FSDP2's hooks stay eager around it
        convlower.reset_report()
        model.block.forward = torch.compile(model.block.forward, backend="convlower",
                                            options={"select": "always"})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    out = {"losses": [], "grads": [], "resharded": [], "dtensor": []}
    start = time.perf_counter()
    for _ in range(STEPS):
        x = torch.randn(2, 3, 4, 8, 8, generator=g)
        y = torch.randn(2, 4, generator=g)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out["losses"].append(loss.detach().clone())
        out["grads"].append([p.grad.to_local().clone() for p in model.parameters()])
        opt.step()
        out["resharded"].append(_resharded(model))
        out["dtensor"].append(all(isinstance(p, DTensor) and p.placements == (Shard(0),)
                                  for p in model.parameters()))
    out["seconds"] = time.perf_counter() - start
    if compiled:  # (a scan of every live object costs seconds: once, after the last step)
        del x, y, loss
        out["copies"] = _gathered_copies(full_shapes)
    out["params"] = [p.to_local().detach().clone() for p in model.parameters()]
    out["shapes"] = [(tuple(p.shape), tuple(p.to_local().shape)) for p in model.parameters()]
    if compiled:
        rep = convlower.report()
        out["lowered"] = [(c["phase"], c["rule"], c["shared"]) for c in rep.lowered()]
        out["convs"] = [(c["phase"], c["rule"]) for c in rep.convolutions]
    return out


CONFIGS = {"fp32": (False, False), "fp32+ac": (True, False), "bf16": (False, True)}


def fsdp_part(rank: int, world: int, out_dir: str) -> dict:
    probe = torch.zeros(8, 8, 2, 3, 3)  # the scan finds a gathered-size tensor when one lives
    res = {"probe": _gathered_copies({tuple(probe.shape)})}
    del probe
    for name, (ac, bf16) in CONFIGS.items():
        res[name] = {"eager": _fsdp_train(rank, False, ac, bf16),
                     "compiled": _fsdp_train(rank, True, ac, bf16)}
        torch._dynamo.reset()
    return res


# --- tests --------------------------------------------------------------------------------

TOL = {"fp32": dict(rtol=1e-4, atol=1e-5), "fp32+ac": dict(rtol=1e-4, atol=1e-5),
       "bf16": dict(rtol=3e-2, atol=3e-3)}


def _check_equal(name: str):
    for rank, res in enumerate(results("fsdp")):
        assert res["probe"] == 1, res["probe"]
        eager, comp = res[name]["eager"], res[name]["compiled"]
        tol, msg = TOL[name], f"{name}, rank {rank}"
        for a, b in zip(comp["losses"], eager["losses"]):
            torch.testing.assert_close(a, b, **tol, msg=msg)
        for step, (ga, gb) in enumerate(zip(comp["grads"], eager["grads"])):
            for a, b in zip(ga, gb):
                torch.testing.assert_close(a, b, **tol, msg=f"{msg}, step {step} grads")
        for a, b in zip(comp["params"], eager["params"]):
            torch.testing.assert_close(a, b, **tol, msg=f"{msg} params")
        # sharded: each rank holds half of every dim 0, as eager FSDP2 does
        assert comp["shapes"] == eager["shapes"], (comp["shapes"], eager["shapes"])
        assert all(full[0] == world_local[0] * 2 for full, world_local in comp["shapes"])
        assert all(comp["dtensor"]) and all(comp["resharded"]), msg
        assert comp["copies"] == 0, (comp["copies"], msg)
        lowered = {(p, r) for p, r, _ in comp["lowered"]}
        assert {("forward", "patchify_mm"), ("forward", "time_fold_conv2d"),
                ("backward", "patchify_mm"), ("backward", "time_fold_conv2d")} <= lowered, \
            (msg, comp["convs"])
        assert all(s in ("rank 0", "rank 1") for _, _, s in comp["lowered"]), comp["lowered"]
        assert len(comp["lowered"]) == len(comp["convs"]), comp["convs"]  # none kept
    return results("fsdp")


def test_fsdp2_fp32_equals_eager_fsdp2():
    _check_equal("fp32")
    a, b = (r["fp32"]["compiled"]["lowered"] for r in results("fsdp"))
    assert a == b  # the same rules, decided once for both ranks (test_ranks.py)


def test_fsdp2_activation_checkpointing_equals_eager_fsdp2():
    res = _check_equal("fp32+ac")
    for r in res:
        fwd = lambda name: sum(p == "forward" for p, _ in r[name]["compiled"]["convs"])
        # the backward graph recomputes the checkpointed convolutions, lowered there too
        assert fwd("fp32+ac") > fwd("fp32"), (r["fp32+ac"]["compiled"]["convs"],
                                              r["fp32"]["compiled"]["convs"])


def test_fsdp2_bf16_params_fp32_reduce_equals_eager_fsdp2():
    _check_equal("bf16")
    for r in results("fsdp"):
        # the gradients FSDP reduced (and kept) are fp32, the parameters too
        assert all(g.dtype == torch.float32 for g in r["bf16"]["compiled"]["grads"][0])
        assert all(p.dtype == torch.float32 for p in r["bf16"]["compiled"]["params"])


def test_group_timings():
    """Not a check: prints what the spawned group cost (pytest -s), part by part."""
    g = group()
    print(f"\nspawned group: {g['seconds']:.0f} s; parts (slower rank): " + ", ".join(
        f"{p} {max(r['seconds'] for r in g[p]):.0f} s" for p in PARTS))
