"""Compile cost against Inductor, in fresh processes with empty caches, and the step time kept.

For each model (zoo entries, fp32 and bf16; a Wan VAE encoder trained forward+backward; one
recompile under dynamic shapes) three fresh processes run, each with an empty Inductor cache
directory:

* ``inductor``  - Inductor's cold compile;
* ``cold``      - convlower's cold compile with an empty decision cache;
* ``warm``      - convlower's compile with the decisions the cold run left (Inductor still
  cold), then the steady-state step of convlower and Inductor, interleaved in that process.

Compile time is ``torch.compile()`` plus the first call, minus one steady step (Inductor's
import happens in ``torch.compile(backend="inductor")``, convlower's at its first call).
"kernels" counts the kernels Inductor generated (C++ on CPU, Triton on GPU), each built by a
compiler at cold compile.  Ratios: cold/Inductor and warm/Inductor compile time (goal <= 1.15),
and Inductor step / convlower step (> 1: convlower faster).

    .venv/bin/python bench/bench_compile_cost.py                       # every zoo model, small
    .venv/bin/python bench/bench_compile_cost.py --models wan-vae --dtypes float32 --select measure
    .venv/bin/python bench/bench_compile_cost.py --train --dtypes float32   # forward+backward rows
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from fresh_process import machine_line, new_cache, run_worker  # noqa: E402

HERE = os.path.abspath(__file__)
EXTRA = ("wan-vae-encoder-train", "wan-vae-dynamic")


# -- one fresh process ---------------------------------------------------------------------------
def _model(name: str, size: str, dtype):
    import torch
    from convlower.tools import zoo

    if name in EXTRA:
        from diffusers import AutoencoderKLWan

        cfg = dict(zoo.ZOO["wan-vae"].configs[size])
        latent = cfg.pop("latent")
        torch.manual_seed(0)
        vae = AutoencoderKLWan(**cfg).to(dtype)
        frames = 1 + 4 * (latent[2] - 1)
        x = torch.randn(1, 3, frames, latent[3] * 8, latent[4] * 8, dtype=dtype)
        return (lambda v: vae.encode(v).latent_dist.mode()), (x,), vae
    model, inputs = zoo.build(name, size)
    model = model.to(dtype)
    inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    return model, inputs, model


def _step(fn, inputs, backward: bool, params) -> None:
    import torch

    if not backward:
        with torch.no_grad():
            fn(*inputs)
        return
    for p in params:
        p.grad = None
    fn(*inputs).float().sum().backward()


def _first_and_steady(fn, inputs, backward, params, steps=3):
    t0 = time.perf_counter()
    _step(fn, inputs, backward, params)
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _step(fn, inputs, backward, params)
        times.append(time.perf_counter() - t0)
    return first, min(times)


def worker(args) -> dict:
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    fn, inputs, module = _model(args.model, args.size, dtype)
    backward = args.model == "wan-vae-encoder-train" or args.train
    params = [p for p in module.parameters()] if backward else []
    for p in module.parameters():
        p.requires_grad_(backward)
    backend = "inductor" if args.run == "inductor" else "convlower"
    opts = {"options": {"select": args.select}} if backend == "convlower" else {}
    # torch.compile() itself is timed too: backend="inductor" imports Inductor there, while a
    # backend looked up by name (convlower) imports it at the first call.
    t0 = time.perf_counter()
    compiled = torch.compile(fn, backend=backend, **opts)
    setup = time.perf_counter() - t0
    first, step = _first_and_steady(compiled, inputs, backward, params)
    first += setup
    from torch._inductor import metrics

    out = {"compile_s": max(first - step, 0.0), "kernels": metrics.generated_kernel_count}
    if args.model == "wan-vae-dynamic":  # a second frame count: the recompile's cost
        x = inputs[0]
        longer = (torch.randn(*x.shape[:2], x.shape[2] + 4, *x.shape[3:], dtype=dtype),)
        first, step = _first_and_steady(compiled, longer, backward, params)
        out["compile_s"] = max(first - step, 0.0)
    if args.run == "warm":
        out.update(_steady_ratio(fn, compiled, inputs, backward, params))
    if backend == "convlower":
        import convlower

        rep = convlower.report()
        out["lowered"] = len(rep.lowered())
        out["how"] = sorted({c.how for c in rep.convolutions})
        out["decision_s"] = sum(c.decision_s for c in rep.convolutions)
    return out


def _steady_ratio(fn, compiled, inputs, backward, params, rounds=7) -> dict:
    import torch

    inductor = torch.compile(fn, backend="inductor")
    _step(inductor, inputs, backward, params)
    times = {"inductor": [], "convlower": []}
    for r in range(rounds):  # interleaved, alternating order
        for name in (("inductor", "convlower") if r % 2 else ("convlower", "inductor")):
            f = inductor if name == "inductor" else compiled
            t0 = time.perf_counter()
            _step(f, inputs, backward, params)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"step_ratio": med["inductor"] / med["convlower"]}


# -- the driver ----------------------------------------------------------------------------------
def run_fresh(model, dtype, size, run, decisions, select, timeout, train=False) -> dict:
    with tempfile.TemporaryDirectory() as root:
        cache = new_cache(os.path.join(root, "inductor"))
        cmd = [sys.executable, HERE, "--worker", "--model", model, "--dtype", dtype,
               "--size", size, "--run", run, "--select", select] + (["--train"] if train else [])
        return run_worker(cmd, {"TORCHINDUCTOR_CACHE_DIR": cache, "CONVLOWER_CACHE_DIR": decisions},
                          timeout)


def row(model, dtype, size, select, timeout, train=False, repeat=1) -> dict:
    """One row; with ``repeat`` > 1 the Inductor and convlower cold compiles run that many times,
    alternating (each convlower one on an empty decision cache), and the medians count: a 2 s
    compile moved 0.9-1.3x between runs on the 2-core machine."""
    res, colds = {}, {"inductor": [], "cold": []}
    for i in range(repeat):
        with tempfile.TemporaryDirectory() as decisions:
            for r in ("inductor", "cold", "warm") if i == repeat - 1 else ("inductor", "cold"):
                res[r] = run_fresh(model, dtype, size, r, decisions, select, timeout, train)
                if r in colds and "compile_s" in res[r]:
                    colds[r].append(res[r]["compile_s"])
    for r, seconds in colds.items():
        if len(seconds) == repeat:
            res[r]["compile_s"] = statistics.median(seconds)
    out = {"model": model + (" fwd+bwd" if train else ""), "dtype": dtype,
           **{f"{r}_s": res[r].get("compile_s") for r in res}}
    errors = [f"{r}: {res[r]['error']}" for r in res if "error" in res[r]]
    if errors:
        return dict(out, error="; ".join(errors))
    ind = res["inductor"]["compile_s"]
    return dict(out, cold_ratio=res["cold"]["compile_s"] / ind,
                warm_ratio=res["warm"]["compile_s"] / ind, step_ratio=res["warm"]["step_ratio"],
                lowered=res["cold"]["lowered"], how="/".join(res["cold"]["how"]),
                decision_s=res["cold"]["decision_s"],
                kernels=f"{res['inductor']['kernels']}/{res['cold']['kernels']}")


def table(rows) -> str:
    head = ("| model | dtype | Inductor cold s | convlower cold s | warm decisions s | cold/ind "
            "| warm/ind | step ind/cl | convs lowered | decided by | deciding s | kernels ind/cl |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['dtype']} | error: {r['error']} |")
            continue
        lines.append(f"| {r['model']} | {r['dtype']} | {r['inductor_s']:.2f} | {r['cold_s']:.2f} "
                     f"| {r['warm_s']:.2f} | {r['cold_ratio']:.2f} | {r['warm_ratio']:.2f} "
                     f"| {r['step_ratio']:.2f} | {r['lowered']} | {r['how']} "
                     f"| {r['decision_s']:.2f} | {r['kernels']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run", default="inductor", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="")
    ap.add_argument("--models", default="", help="comma-separated (default: every zoo model + "
                                                  + ", ".join(EXTRA) + ")")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--size", default="small", choices=("tiny", "small"))
    ap.add_argument("--select", default="auto")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per process")
    ap.add_argument("--repeat", type=int, default=1,
                    help="cold compiles per plan, alternating; medians (the noise of short ones)")
    ap.add_argument("--train", action="store_true",
                    help="forward+backward (every model; the training row is one anyway)")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    from convlower.tools import zoo

    models = args.models.split(",") if args.models else list(zoo.ZOO) + list(EXTRA)
    rows = []
    for model in models:
        for dtype in args.dtypes.split(","):
            if model in EXTRA and (dtype != "float32" or args.train):
                continue  # the training and recompile rows: fp32 only
            print(f"[bench] {model} {dtype} ...", file=sys.stderr, flush=True)
            rows.append(row(model, dtype, args.size, args.select, args.timeout, args.train,
                            args.repeat))
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(f"select={args.select}, size={args.size}, fresh processes"
          f"{f', medians of {args.repeat} cold compiles each' if args.repeat > 1 else ''}; "
          f"{machine_line()}")
    print(table(rows))


if __name__ == "__main__":
    main()
