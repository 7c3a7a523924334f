"""Cold vs warm-cache warm-up, in separate processes: how much a persistent cache_dir saves.

For each model, one process runs ``convlower.warmup(..., cache_dir=D)`` on a fresh ``D``
(cold), then a second process runs it again on the same ``D`` (warm).  Printed side by side:
compile seconds (first step minus a steady step), the cache state each process saw, and the
ratio cold / warm.  Goal on a CPU: the warm process compiles >= 5x faster.

Models (random weights, small explicit configs, nothing downloaded):
  * qwen_patch: transformers' Qwen2.5-VL vision patch embedding (Conv3d 3->1280,
    kernel = stride = (2, 14, 14)) on 256 patches;
  * wan_decoder: a small diffusers AutoencoderKLWan, decoding a (1, 4, 3, 8, 8) latent.

    .venv/bin/python bench/bench_warmup.py [--models qwen_patch,wan_decoder] [--iters 2]

The FX graph cache key includes convlower's source files: while someone edits them, run the
bench on a frozen copy (``cp -r convlower /tmp/snap/ && PYTHONPATH=/tmp/snap ...``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def qwen_patch():
    import torch
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionPatchEmbed

    m = Qwen2_5_VisionPatchEmbed(patch_size=14, temporal_patch_size=2, in_channels=3,
                                 embed_dim=1280).eval()
    return m, (torch.randn(256, 3 * 2 * 14 * 14),)


def wan_decoder():
    import torch
    from diffusers import AutoencoderKLWan

    z = 4
    vae = AutoencoderKLWan(base_dim=16, z_dim=z, dim_mult=[1, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True], latents_mean=[0.0] * z,
                           latents_std=[1.0] * z).eval()

    class Decode(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vae = vae

        def forward(self, latents):
            return self.vae.decode(latents, return_dict=False)[0]

    return Decode(), (torch.randn(1, z, 3, 8, 8),)


MODELS = {"qwen_patch": qwen_patch, "wan_decoder": wan_decoder}


def worker(name: str, cache_dir: str, iters: int) -> None:
    import torch

    import convlower

    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    start = time.perf_counter()
    with torch.no_grad():
        compiled, r = convlower.warmup(model, inputs, cache_dir=cache_dir, iters=iters)
        ok = torch.allclose(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)
    from convlower.backend.conv_pass import ConvLowerPass
    from convlower.backend.options import parse

    print("RESULT " + json.dumps({
        "uuid": ConvLowerPass(parse(None)).uuid(), "compile_s": r.compile_s, "first_step_s": r.first_step_s, "cache": r.cache,
        "counts": r.cache_counts, "graphs": r.statistics["graphs"],
        "graph_breaks": len(r.statistics["graph_breaks"]), "verdict": r.verdict,
        "warmup_wall_s": time.perf_counter() - start, "ok": bool(ok), "warnings": r.warnings}))


def run(name: str, cache_dir: str, iters: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FORCE_DISABLE_CACHES")}
    proc = subprocess.run([sys.executable, __file__, "--worker", name, cache_dir,
                           "--iters", str(iters)], env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{name} worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "CACHE_DIR"))
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[0], args.worker[1], args.iters)
    rows = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="convlower-warmup-") as d:
            cache = os.path.join(d, "cache")
            cold = run(name, cache, args.iters)
            warm = run(name, cache, args.iters)
        ratio = cold["compile_s"] / max(warm["compile_s"], 1e-9)
        if cold["uuid"] != warm["uuid"]:
            print(f"{name}: convlower's sources changed between the two processes (the cache "
                  f"key includes them): the warm run was cold; rerun", flush=True)
        rows.append((name, cold, warm, ratio))
        print(f"{name}: cold {cold['compile_s']:.2f} s ({cold['cache']}), "
              f"warm {warm['compile_s']:.2f} s ({warm['cache']}), ratio {ratio:.1f}x", flush=True)
    print()
    print(f"{'model':<12} {'graphs':>6} {'breaks':>6} {'cold s':>8} {'warm s':>8} {'cold/warm':>9}"
          f"  {'warm cache':<10} {'fx hit/miss (warm)':<18} ok")
    for name, cold, warm, ratio in rows:
        c = warm["counts"]
        print(f"{name:<12} {cold['graphs']:>6} {cold['graph_breaks']:>6} {cold['compile_s']:>8.2f} "
              f"{warm['compile_s']:>8.2f} {ratio:>8.1f}x  {warm['cache']:<10} "
              f"{c['fx_graph_hit']}/{c['fx_graph_miss']:<16} {cold['ok'] and warm['ok']}")
    print("\ngoal: warm >= 5x faster than cold;", "met" if all(r[3] >= 5 for r in rows)
          else "NOT met for " + ", ".join(r[0] for r in rows if r[3] < 5))


if __name__ == "__main__":
    main()
