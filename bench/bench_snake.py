"""What the eager-safe Snake route costs: Oobleck VAE decode, eager / Inductor / convlower.

    .venv/bin/python bench/bench_snake.py                       # fp32 and bf16, 1 latent frame
    .venv/bin/python bench/bench_snake.py --frames 4 --rounds 10 --dtypes bf16

diffusers ``AutoencoderOobleck`` decoder (default config: 78M parameters, random weights) on a
short latent, inference.  Variants: eager; Inductor; convlower with ``snake="fused"`` (the
default off HIP); convlower with ``snake="eager"`` (what "auto" picks on HIP + bf16: every
Snake is the opaque op ``convlower::snake``).  All variants of one dtype are timed in the same
rounds, interleaved, so machine load cancels out as far as it can.  Printed: median ms, speed
against eager (``x`` > 1 is faster), and the eager-safe route's time over the fused route's.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import convlower

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def decoder(dtype):
    from diffusers import AutoencoderOobleck

    torch.manual_seed(0)
    return AutoencoderOobleck().decoder.to(dtype).eval()


def variants(dec):
    # one module (weight_norm hooks forbid deepcopy); each backend gets its own Dynamo entry
    def convlower_with(snake):
        return torch.compile(dec, backend="convlower", options={"snake": snake})

    return {"eager": dec, "inductor": torch.compile(dec, backend="inductor"),
            "fused": convlower_with("fused"), "eager-safe": convlower_with("eager")}


def bench(dtype_name, frames, rounds):
    dtype = DTYPES[dtype_name]
    dec = decoder(dtype)
    z = torch.randn(1, 64, frames, dtype=dtype)
    fns = variants(dec)
    compile_s, outs = {}, {}
    with torch.no_grad():
        for k, f in fns.items():  # first call: compile (and one warm-up for eager)
            convlower.reset_report()
            t = time.perf_counter()
            outs[k] = f(z)
            compile_s[k] = time.perf_counter() - t
            if k.startswith(("fused", "eager-safe")):
                routes = [s["route"] for s in convlower.report().snake]
                assert routes and set(routes) == {"eager" if k == "eager-safe" else "fused"}, routes
                compile_s[k + " sites"] = len(routes)
        times = {k: [] for k in fns}
        for _ in range(rounds):
            for k, f in fns.items():
                t = time.perf_counter()
                f(z)
                times[k].append(time.perf_counter() - t)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    err = max((outs[k].float() - outs["eager"].float()).abs().max().item() for k in fns)
    cols = "  ".join(f"{k} {ms[k]:8.1f} ms ({ms['eager'] / ms[k]:4.2f}x)" for k in fns)
    print(f"{dtype_name}  z={tuple(z.shape)} -> {tuple(outs['eager'].shape)}  {cols}  | "
          f"eager-safe / fused = {ms['eager-safe'] / ms['fused']:.2f}  | "
          f"{compile_s['fused sites']} Snake sites; compile s: "
          + ", ".join(f"{k} {compile_s[k]:.0f}" for k in fns if k != "eager")
          + f"; max |diff| vs eager {err:.2g}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--frames", type=int, default=1, help="latent frames (x2048 audio samples)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64  # one entry per variant and dtype
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of "
          f"{args.rounds} interleaved rounds; (x) = speed against eager", flush=True)
    for name in args.dtypes:
        bench(name, args.frames, args.rounds)


if __name__ == "__main__":
    main()
