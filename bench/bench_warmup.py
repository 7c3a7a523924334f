"""Cold compile vs warm load in fresh processes: what a later session pays (issue 21).

For each zoo model and plan, one process compiles on an empty cache folder (cold; the machine's
once-only ISA probe pre-made, see fresh_process.py), a second
process compiles again on the same folder (warm load).  Plans: ``inductor`` (Inductor's own
caches in the folder), ``convlower`` (``convlower.warmup(..., cache_dir=D)``: the second
process loads the saved compile), ``traced`` (the same with ``save_compiled=False``: Dynamo
traces again, Inductor's caches serve the graphs), ``regions`` (``options={"regions":
"auto"}``).  Printed side by side: cold and warm compile seconds (first call minus a steady
step), warm / cold, warm / Inductor's warm, cold / warm, two whole ``convlower.warmup`` calls'
ratio (goal >= 10x) and the warm load split by phase (Dynamo, AOTAutograd, Inductor, code
generation and loading, convlower's pass; ``saved load`` for a loaded compile).

    .venv/bin/python bench/bench_warmup.py --models vit-patch-embed,sdxl-unet [--size small]
    .venv/bin/python bench/bench_warmup.py --models wan-dit-patch --plans inductor,convlower --dtype bfloat16

The FX graph cache key includes convlower's source files: while someone edits them, run the
bench on a frozen copy (``cp -r convlower /tmp/snap/ && PYTHONPATH=/tmp/snap ...``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from fresh_process import machine_line, new_cache, run_worker  # noqa: E402

PLANS = ("inductor", "convlower", "traced", "regions")
DEFAULT_MODELS = ("qwen2.5-vl-patch-embed", "vit-patch-embed", "wan-dit-stack", "sdxl-unet")


def _first_and_step(fn, inputs):
    start = time.perf_counter()
    fn(*inputs)
    first = time.perf_counter() - start
    steps = []
    for _ in range(2):
        start = time.perf_counter()
        fn(*inputs)
        steps.append(time.perf_counter() - start)
    return first, min(steps)


def worker(model: str, size: str, plan: str, cache_dir: str, dtype: str = "float32") -> dict:
    import torch

    from convlower.tools import zoo

    m, inputs = zoo.build(model, size)
    m = m.to(getattr(torch, dtype))
    inputs = tuple(t.to(getattr(torch, dtype)) if t.is_floating_point() else t for t in inputs)
    with torch.no_grad():
        if plan == "inductor":
            start = time.perf_counter()
            compiled = torch.compile(m, backend="inductor")
            setup = time.perf_counter() - start
            first, step = _first_and_step(compiled, inputs)
            return {"compile_s": max(first + setup - step, 0.0), "phases": {}}
        import convlower

        options = {"regions": "auto"} if plan == "regions" else None
        start = time.perf_counter()
        _, r = convlower.warmup(m, inputs, options=options, cache_dir=cache_dir, iters=2,
                                save_compiled=plan != "traced")
        phases = r.statistics.get("phases_s", {})
        if r.saved.state == "loaded":
            phases = {"saved load": r.saved.load_s}
        return {"compile_s": r.compile_s, "phases": phases, "saved": str(r.saved),
                "cache": r.cache, "warmup_s": time.perf_counter() - start,
                "settle_s": r.settling.seconds + r.settling.recompile_s}


def run(model, size, plan, cache_dir, timeout, dtype="float32") -> dict:
    inductor = os.path.join(cache_dir, "inductor")  # where convlower.warmup points Inductor
    if not os.path.exists(inductor):
        new_cache(inductor)
    env = {"TORCHINDUCTOR_CACHE_DIR": inductor if plan == "inductor" else None,
           "TORCHINDUCTOR_FORCE_DISABLE_CACHES": None, "CONVLOWER_CACHE_DIR": None}
    return run_worker([sys.executable, __file__, "--worker", model, size, plan, cache_dir, dtype],
                      env, timeout, marker="RESULT ")


def _phases(ph: dict) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in ph.items() if v >= 0.005) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--size", default="small")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--worker", nargs=5, metavar=("MODEL", "SIZE", "PLAN", "CACHE_DIR", "DTYPE"))
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(*args.worker)))
        return
    print("| model | plan | cold s | warm s | warm / cold | warm / Inductor warm | cold / warm "
          "| warm-up call 1st / 2nd | warm load by phase (s) |\n|---|---|---|---|---|---|---|---|---|",
          flush=True)
    for model in args.models.split(","):
        inductor_warm = None
        for plan in args.plans.split(","):
            with tempfile.TemporaryDirectory(prefix="convlower-warmup-") as d:
                cache = os.path.join(d, "cache")
                cold = run(model, args.size, plan, cache, args.timeout, args.dtype)
                warm = run(model, args.size, plan, cache, args.timeout, args.dtype) \
                    if "error" not in cold else cold
            if "error" in warm:
                print(f"| {model} | {plan} | error: {warm['error']} |", flush=True)
                continue
            if plan == "inductor":
                inductor_warm = warm["compile_s"]
            vs = f"{warm['compile_s'] / inductor_warm:.2f}" if inductor_warm else "–"
            calls = f"{cold['warmup_s'] / warm['warmup_s']:.1f}x" if "warmup_s" in warm else "–"
            print(f"| {model} | {plan} | {cold['compile_s']:.2f} | {warm['compile_s']:.2f} | "
                  f"{warm['compile_s'] / cold['compile_s']:.3f} | {vs} | "
                  f"{cold['compile_s'] / max(warm['compile_s'], 1e-9):.1f}x | {calls} | "
                  f"{_phases(warm['phases'])} |", flush=True)
    print(machine_line())


if __name__ == "__main__":
    main()
