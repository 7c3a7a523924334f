"""Patch-embedding benchmark (issue: backend foundation).

Qwen2.5-VL patch embedding (Conv3d 3 -> 1280, kernel = stride = (2, 14, 14), input
[patches, 3, 2, 14, 14]) at 1024 and 8192 patches, fp32 and bf16, forward and
forward+backward: eager, backend="inductor", backend="convlower", and a bare torch.mm of the
same GEMM (the floor).  Then the DiT patch embedding ((1, 2, 2) kernel, 16 -> 1536, followed by
flatten(2).transpose(1, 2)) to show convlower does not lose there.

All variants of one shape are timed interleaved in one run (median of rounds), so the ratios
are comparable on a noisy shared machine.  Run:  .venv/bin/python bench/bench_patch_embed.py
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import convlower


def timeit(fns: dict, rounds: int, inner: int) -> dict:
    times = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]  # rotate the order
        for k in order:
            t0 = time.perf_counter()
            for _ in range(inner):
                fns[k]()
            times[k].append((time.perf_counter() - t0) / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def qwen_case(n: int, dtype, backward: bool, rounds: int, dynamic: bool = False):
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 1280, (2, 14, 14), stride=(2, 14, 14), bias=False).to(dtype)
    x = torch.randn(n, 3, 2, 14, 14, dtype=dtype, requires_grad=backward)
    flat_w = conv.weight.detach().reshape(1280, -1).t().contiguous()
    flat_x = x.detach().reshape(n, -1)
    dyn = True if dynamic else None  # dynamic: a symbolic batch (varying patch counts)
    fns = {"eager": conv,
           "inductor": torch.compile(conv, backend="inductor", dynamic=dyn),
           "convlower": torch.compile(conv, backend="convlower", dynamic=dyn)}

    def step(f):
        def run():
            y = f(x)
            if backward:
                y.backward(torch.ones_like(y))
        return run

    runs = {k: step(f) for k, f in fns.items()}
    if backward:
        gx = torch.randn(n, 1280, dtype=dtype)
        runs["bare mm"] = lambda: (flat_x @ flat_w, gx @ flat_w.t(), gx.t() @ flat_x)
    else:
        runs["bare mm"] = lambda: flat_x @ flat_w
    for r in runs.values():  # compile + warm up
        r(); r()
    lowered = sorted({e["rule"] or "-" for e in convlower.report().convolutions})
    return timeit(runs, rounds, inner=3), lowered


class DiTPatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv3d(16, 1536, (1, 2, 2), stride=(1, 2, 2))

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


def dit_case(dtype, rounds: int):
    torch.manual_seed(0)
    m = DiTPatch().to(dtype).eval()
    x = torch.randn(1, 16, 4, 32, 32, dtype=dtype)
    runs = {"eager": m, "inductor": torch.compile(m, backend="inductor"),
            "convlower": torch.compile(m, backend="convlower")}
    with torch.no_grad():
        fns = {k: (lambda f=f: f(x)) for k, f in runs.items()}
        for f in fns.values():
            f(); f()
        lowered = sorted({e["rule"] or "-" for e in convlower.report().convolutions})
        return timeit(fns, rounds, inner=3), lowered


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--patches", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--dynamic", action="store_true",
                    help="compile with a symbolic batch size (the patch count varies per image)")
    ap.add_argument("--no-dit", action="store_true", help="leave the DiT rows out")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; select="
          f"{convlower.backend.options.parse({}).select}")
    print(f"{'case':38s} {'eager ms':>9s} {'ind/cl':>7s} {'eager/cl':>8s} {'cl/mm':>6s}  lowered by")
    dtypes = [getattr(torch, d) for d in args.dtypes]
    for dtype in dtypes:
        for backward in (False, True):
            for n in args.patches:
                torch._dynamo.reset()
                convlower.reset_report()
                t, lowered = qwen_case(n, dtype, backward, args.rounds, args.dynamic)
                name = (f"qwen2.5-vl {n:5d} {str(dtype)[6:]:8s} {'fwd+bwd' if backward else 'fwd'}"
                        f"{' dyn' if args.dynamic else ''}")
                print(f"{name:38s} {t['eager'] * 1e3:9.2f} {t['inductor'] / t['convlower']:7.2f} "
                      f"{t['eager'] / t['convlower']:8.2f} {t['convlower'] / t['bare mm']:6.2f}  "
                      f"{','.join(lowered)}", flush=True)
    for dtype in ([] if args.no_dit else dtypes):
        torch._dynamo.reset()
        convlower.reset_report()
        t, lowered = dit_case(dtype, args.rounds)
        name = f"dit-patch (1,2,2) 16->1536 {str(dtype)[6:]}"
        print(f"{name:38s} {t['eager'] * 1e3:9.2f} {t['inductor'] / t['convlower']:7.2f} "
              f"{t['eager'] / t['convlower']:8.2f} {'':>6s}  {','.join(lowered)}", flush=True)
    print("ind/cl = Inductor time / convlower time (>1: convlower faster); cl/mm = convlower "
          "time / bare mm (the floor).")


if __name__ == "__main__":
    main()
