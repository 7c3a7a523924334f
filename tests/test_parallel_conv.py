"""A spatially parallel Conv3d (as video VAE decoders run it): each rank holds a slice of the
frames' height, exchanges halo rows with its neighbours (an ``all_gather`` of its border rows,
a functional collective that Dynamo keeps in the graph), then convolves its slice with
padding 0 in the split dimension.

Compiled by convlower on 2 ranks (gloo, CPU; in the spawned group of ``test_fsdp.py``): the
gathered output equals a single-process eager conv over the whole input; the input-slice
gradients and the all-reduced weight and bias gradients equal that conv's gradients; the
exchange stays in the compiled forward (``all_gather_into_tensor``) and backward
(``reduce_scatter_tensor``, the all-gather's gradient); the local conv was lowered in both.
convlower rewrites ``aten.convolution`` nodes, never modules: a Conv3d subclass keeps its
``forward``, halo exchange included.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from test_fsdp import results

H = 8  # the whole input's height, split evenly across the ranks


class HaloConv3d(nn.Conv3d):
    """A Conv3d whose input is this rank's slice of the height (dim 3): the rows the kernel
    reads beyond the slice come from the neighbouring ranks (zeros at the ends, which is the
    whole conv's own zero padding).  Height stride must be 1."""

    def __init__(self, *args, rank: int, world: int, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.stride[1] == 1 and isinstance(self.padding, tuple)
        k, d, p = self.kernel_size[1], self.dilation[1], self.padding[1]
        self.above, self.below = p, d * (k - 1) - p  # rows needed from rank - 1 / rank + 1
        self.rank, self.world = rank, world

    def forward(self, x):
        from torch.distributed import _functional_collectives as funcol

        n, c, t, h, w = x.shape
        up, down = self.above, self.below
        # what the neighbours need: my first `down` rows (for rank - 1), my last `up` rows
        # (for rank + 1); every rank gathers every rank's borders
        borders = torch.cat([x[:, :, :, :down], x[:, :, :, h - up:]], dim=3).contiguous()
        everyone = funcol.all_gather_single_autograd(borders, 0, dist.group.WORLD)
        everyone = everyone.view(self.world, n, c, t, down + up, w)
        zeros = lambda rows: x.new_zeros(n, c, t, rows, w)
        above = everyone[self.rank - 1, :, :, :, down:] if self.rank > 0 else zeros(up)
        below = everyone[self.rank + 1, :, :, :, :down] if self.rank < self.world - 1 \
            else zeros(down)
        x = torch.cat([above, x, below], dim=3)
        padding = (self.padding[0], 0, self.padding[2])
        return F.conv3d(x, self.weight, self.bias, self.stride, padding, self.dilation,
                        self.groups)


def _all_gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


def _run(conv: HaloConv3d, fn, x_whole, g_whole, rank: int, world: int):
    rows = slice(rank * H // world, (rank + 1) * H // world)
    x = x_whole[:, :, :, rows].clone().requires_grad_()
    conv.zero_grad()
    out = fn(x)
    (out * g_whole[:, :, :, rows]).sum().backward()
    wg, bg = conv.weight.grad.clone(), conv.bias.grad.clone()
    dist.all_reduce(wg)  # the data-parallel reduction of the weight gradient
    dist.all_reduce(bg)
    return {"out": _all_gather(out.detach(), 3), "x_grad": _all_gather(x.grad, 3),
            "w_grad": wg, "b_grad": bg}


def part(rank: int, world: int, out_dir: str) -> dict:
    """Runs in each process of the spawned group (test_fsdp.group)."""
    import convlower
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)  # the same weights and whole input on every rank
    conv = HaloConv3d(4, 6, (2, 3, 3), stride=(2, 1, 1), padding=(0, 1, 1), rank=rank,
                      world=world)
    x_whole = torch.randn(2, 4, 4, H, 5)
    # the single-process reference: eager conv over the whole input
    xr = x_whole.clone().requires_grad_()
    w, b = (p.detach().clone().requires_grad_() for p in (conv.weight, conv.bias))
    ref = F.conv3d(xr, w, b, (2, 1, 1), (0, 1, 1))
    g_whole = torch.randn_like(ref)
    (ref * g_whole).sum().backward()
    reference = {"out": ref.detach(), "x_grad": xr.grad, "w_grad": w.grad, "b_grad": b.grad}

    eager = _run(conv, conv, x_whole, g_whole, rank, world)  # the module itself is right
    torch._dynamo.utils.counters.clear()
    compiled_conv = torch.compile(conv, backend="convlower", options={"select": "always"})
    compiled, code = run_and_get_code(
        lambda: _run(conv, compiled_conv, x_whole, g_whole, rank, world))
    rep = convlower.report()
    return {"reference": reference, "eager": eager, "compiled": compiled, "code": code,
            "convs": [(c["phase"], c["rule"], c["shared"]) for c in rep.convolutions],
            "graph_breaks": dict(torch._dynamo.utils.counters["graph_break"])}


def test_halo_conv_eager_equals_whole_conv():
    """The test's own module is right before anything is compiled."""
    for rank, r in enumerate(results("parallel_conv")):
        for k, want in r["reference"].items():
            torch.testing.assert_close(r["eager"][k], want, rtol=1e-5, atol=1e-5,
                                       msg=f"rank {rank}: {k}")


def test_halo_conv_compiled_equals_whole_conv_forward_and_backward():
    for rank, r in enumerate(results("parallel_conv")):
        for k, want in r["reference"].items():
            torch.testing.assert_close(r["compiled"][k], want, rtol=1e-5, atol=1e-5,
                                       msg=f"rank {rank}: {k}")


def test_halo_exchange_stays_in_the_compiled_graphs():
    for rank, r in enumerate(results("parallel_conv")):
        assert not r["graph_breaks"], r["graph_breaks"]
        fwd = [c for c in r["code"] if "all_gather_into_tensor" in c]
        bwd = [c for c in r["code"] if "reduce_scatter_tensor" in c]
        assert fwd and bwd, f"rank {rank}: {len(r['code'])} sources, no collective in them"
        assert all("wait_tensor" in c for c in fwd + bwd)


def test_halo_conv_local_conv_lowered_alike_on_every_rank():
    res = results("parallel_conv")
    for rank, r in enumerate(res):
        assert [c[:2] for c in r["convs"]] == [("forward", "time_fold_conv2d"),
                                               ("backward", "time_fold_conv2d")], r["convs"]
    # the ranks' graphs differ (each pads its own end), their conv decisions were shared
    assert res[0]["convs"] == res[1]["convs"] and res[0]["convs"][0][2] in ("rank 0", "rank 1")
