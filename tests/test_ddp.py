"""DistributedDataParallel: 2 CPU processes (gloo, loopback) train a small model whose convs
convlower lowers; gradients and parameters after a few steps equal the eager DDP run.

A tiny ``bucket_cap_mb`` makes DDPOptimizer split the Dynamo graph at bucket boundaries, so
convlower sees several graphs (each compiled separately, lowered inside each split).  The
processes are started by the test itself (``torch.multiprocessing.spawn``).
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Conv2d(3, 16, 2, 2)      # patchify_mm
        self.mix = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.point = torch.nn.Conv2d(16, 16, 1)        # patchify_mm (pointwise)
        self.head = torch.nn.Conv2d(16, 4, 4)          # patch_linear (4x4 input)

    def forward(self, x):
        x = torch.relu(self.embed(x))
        x = torch.relu(self.point(torch.relu(self.mix(x))))
        return self.head(x).flatten(1)


def _train(rank: int, compiled: bool):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)  # same initial weights on both ranks
    model = DDP(Net(), bucket_cap_mb=0.005)  # ~5 KB buckets: several graph splits
    step_fn = torch.compile(model, backend="convlower", options={"select": "always"}) \
        if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(STEPS):
        x = torch.randn(4, 3, 8, 8, generator=g)
        y = torch.randn(4, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(step_fn(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def _worker(rank: int, world: int, port: int, out_dir: str):
    import convlower

    torch.set_num_threads(1)
    # The test reads per-conv report records, which a graph served from Inductor's cache (e.g.
    # written by the other rank a moment earlier) does not produce: compile for real.
    torch._inductor.config.force_disable_caches = True
    # DDPOptimizer requires first bucket <= bucket cap; its default first bucket is 1 MB
    dist._DEFAULT_FIRST_BUCKET_BYTES = 1000
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        eager = _train(rank, compiled=False)
        compiled = _train(rank, compiled=True)
        rep = convlower.report()
        torch.save({"eager": eager, "compiled": compiled,
                    "graphs": sorted({c["graph"] for c in rep.convolutions}),
                    "lowered": [(c["phase"], c["rule"]) for c in rep.lowered()],
                    "fallbacks": [c["reason"] for c in rep.convolutions if "fell back" in c["reason"]]},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ddp(out_dir: str, world: int = 2) -> list[dict]:
    mp.spawn(_worker, args=(world, free_port(), out_dir), nprocs=world, join=True)
    return [torch.load(f"{out_dir}/rank{r}.pt") for r in range(world)]


def test_ddp_with_convlower_equals_eager_ddp(tmp_path):
    results = run_ddp(str(tmp_path))
    for rank, res in enumerate(results):
        (eg, ep), (cg, cp) = res["eager"], res["compiled"]
        for a, b in zip(cg + cp, eg + ep):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"rank {rank}")
        assert not res["fallbacks"], res["fallbacks"]
        assert ("forward", "patchify_mm") in res["lowered"] and \
            ("backward", "patchify_mm") in res["lowered"], res["lowered"]
        assert len(res["graphs"]) > 1, res["graphs"]  # DDPOptimizer split the graph
    # both ranks hold the same parameters (gradients were all-reduced)
    for a, b in zip(results[0]["compiled"][1], results[1]["compiled"][1]):
        torch.testing.assert_close(a, b)
