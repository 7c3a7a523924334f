"""Conv3d shapes of video VAEs (and two Conv2d rows): eager, Inductor, each rule, convlower
(default select="auto") and convlower(select="measure"), side by side.

    .venv/bin/python bench/bench_conv3d.py                 # all shapes, fp32 and bf16, + Wan decode
    .venv/bin/python bench/bench_conv3d.py --shapes mochi --dtypes bf16 --no-vae

Every variant of one shape is timed in the same rounds (interleaved), and the table prints
ratios against Inductor (``x`` > 1 means faster than Inductor), so machine load cancels out as
far as it can.  Each sample repeats a call for about 50 ms; rounds are medians.  Per row,
``auto/min`` and ``measure/min`` are convlower's time over the faster of eager and Inductor
(issue 23: <= 1.03 on every row), ``warm-up/exhaustive`` the model a ``convlower.warmup``
returns (close calls settled) over ``select="exhaustive"``'s (issue 22: <= 1.03), and
``chose`` what each picked.  Also printed per shape: the
compile-time cost of measuring (seconds spent choosing, i.e. compiling and timing the
candidates, with a cold decision cache), and for fp32 the error of the opt-in
``compute_dtype="bfloat16"`` against fp32.
For the Mochi downsample it also prints the floor of any gather + matmul form (the compiled
patch gather plus the matmul on ready patches) beside Inductor's conv.
The Conv2d rows (``SHAPES_2D``) are where Inductor's layout optimisation (channels-last copies
around the conv, on CPU with mkldnn) can make its original slower than eager's call: there
convlower may pick ``eager_conv``.
Goals on a CPU: convlower / min(eager, Inductor) time <= 1.03 everywhere, >= 1.2x faster than
Inductor on the Mochi downsample, and a whole small Wan VAE decode no slower than Inductor.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import tempfile
import time

import torch

import convlower
from convlower import selection
from convlower.selection import measure
from convlower.lowerings import RULES
from convlower.lowerings.proof import check
from convlower.lowerings.rule import ConvCall

# name: (input shape, out channels, kernel, stride, padding).  Wan pads explicitly (F.pad), so
# its convs see the padded input with padding 0: [1, 96, 6, 130, 130] is 4 frames of 128x128.
SHAPES = {
    "wan96": ([1, 96, 6, 130, 130], 96, (3, 3, 3), (1, 1, 1), (0, 0, 0)),
    "wan192": ([1, 192, 6, 66, 66], 192, (3, 3, 3), (1, 1, 1), (0, 0, 0)),
    "wan384": ([1, 384, 3, 18, 18], 384, (3, 3, 3), (1, 1, 1), (0, 0, 0)),
    "wan_time": ([1, 192, 5, 66, 66], 192, (3, 1, 1), (2, 1, 1), (0, 0, 0)),
    "mochi": ([1, 128, 14, 48, 48], 256, (2, 2, 2), (2, 2, 2), (0, 0, 0)),
    # A DiT patch embedding (Wan/Hunyuan style): patchify_mm loses on it in fp32 on CPU.
    "dit_patch": ([1, 16, 5, 60, 104], 1536, (1, 2, 2), (1, 2, 2), (0, 0, 0)),
}
# Conv2d rows: a VAE/UNet-style 3x3 conv and a 4-channel latent input conv (stride 1, pad 1).
SHAPES_2D = {
    "c2d_64": ([1, 64, 64, 64], 64, (3, 3), (1, 1), (1, 1)),
    "c2d_in4": ([1, 4, 64, 64], 128, (3, 3), (1, 1), (1, 1)),
}
ALL_SHAPES = {**SHAPES, **SHAPES_2D}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SETTLE_S = 120.0  # the warm-up's budget for measuring close calls (its default)


def compiled(mod, backend, **opts):
    # No dynamo.reset(): every variant keeps its compiled code (entries are per backend).
    f = torch.compile(mod, backend=backend, options=opts or None)
    return f


def first_call(f, x):
    t = time.perf_counter()
    with torch.no_grad():
        out = f(x)
    return out, time.perf_counter() - t


def time_side_by_side(fns: dict, x, rounds: int, min_sample_s: float = 0.05) -> dict:
    """Median seconds per call over ``rounds`` interleaved rounds; one sample repeats a short
    call until it lasts about ``min_sample_s`` (single short calls are mostly jitter)."""
    times = {k: [] for k in fns}
    with torch.no_grad():
        reps = {}
        for k, f in fns.items():  # warm-up, and how many calls make one sample
            f(x)
            t = time.perf_counter()
            f(x)
            reps[k] = max(1, int(min_sample_s / max(time.perf_counter() - t, 1e-6)))
        for _ in range(rounds):
            for k, f in fns.items():
                t = time.perf_counter()
                for _ in range(reps[k]):
                    f(x)
                times[k].append((time.perf_counter() - t) / reps[k])
    return {k: statistics.median(v) for k, v in times.items()}


@contextlib.contextmanager
def cold_measuring():
    """A cold decision cache (so "measure" really measures) and a clock on measuring: yields
    a one-item list that ends up holding the seconds spent choosing (compiling + timing)."""
    spent = [0.0]
    choose = measure.decide

    def clocked(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return choose(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as cache:
        selection.set_cache_dir(cache)
        selection.clear_memory()
        measure.decide = clocked
        try:
            yield spent
        finally:
            measure.decide = choose
            selection.set_cache_dir(None)


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def bench_shape(name, dtype_name, rounds):
    torch._dynamo.reset()  # each row compiles its own variants: Dynamo's per-code limit is per row
    shape, out_ch, k, s, p = ALL_SHAPES[name]
    dtype, nd = DTYPES[dtype_name], len(k)
    torch.manual_seed(0)
    conv = {2: torch.nn.Conv2d, 3: torch.nn.Conv3d}[nd](shape[1], out_ch, k, s, p).to(dtype).eval()
    x = torch.randn(shape, dtype=dtype)
    call = ConvCall.from_args([x, conv.weight, conv.bias, s, p, (1,) * nd, False, (0,) * nd, 1])
    rules = [r for r in RULES if RULES[r].lowers and check(RULES[r], call).eligible]
    fns, compile_s = {"eager": conv}, {}
    with torch.no_grad():
        ref = conv(x)
    fns["inductor"] = compiled(conv, "inductor")
    _, compile_s["inductor"] = first_call(fns["inductor"], x)
    for r in rules:
        fns[r] = compiled(conv, "convlower", rules=[r], select="always")
        _, compile_s[r] = first_call(fns[r], x)
    chose, errs = {}, {}
    for sel in ("auto", "measure", "exhaustive"):  # each with a cold decision cache
        with cold_measuring() as spent:
            fns[sel] = compiled(conv, "convlower", select=sel)
            convlower.reset_report()
            out, compile_s[sel] = first_call(fns[sel], x)
            chose[sel] = ",".join(e["rule"] or "original" for e in convlower.report().convolutions)
        errs[sel] = rel_err(out, ref)
    with cold_measuring(), torch.no_grad():  # issue 22: one warm-up settles auto's close calls
        convlower.reset_report()
        fns["warm-up"], res = convlower.warmup(conv, x, iters=0, settle_budget_s=SETTLE_S)
        chose["warm-up"] = convlower.report().convolutions[-1]["rule"] or "original"
        settle_s = res.settling.seconds + res.settling.recompile_s
    if dtype == torch.float32:  # opt-in bf16 compute: time and error against fp32
        fns["bf16c"] = compiled(conv, "convlower", select="always", compute_dtype="bfloat16")
        out_b, compile_s["bf16c"] = first_call(fns["bf16c"], x)
        errs["bf16c"] = rel_err(out_b, ref)
    t = time_side_by_side(fns, x, rounds)
    base, floor = t["inductor"], min(t["eager"], t["inductor"])
    cols = " ".join(f"{k}={base / v:.2f}x" for k, v in t.items() if k != "inductor")
    print(f"{name:9s} {dtype_name}  inductor {base * 1e3:8.1f} ms | {cols} | auto/min "
          f"{t['auto'] / floor:.3f} measure/min {t['measure'] / floor:.3f} (min = "
          f"{'eager' if t['eager'] < t['inductor'] else 'inductor'}) | warm-up/exhaustive "
          f"{t['warm-up'] / t['exhaustive']:.3f} (warm-up {chose['warm-up']}, exhaustive "
          f"{chose['exhaustive']}; settling {settle_s:.1f} s) | chose auto "
          f"{chose['auto']}, measure {chose['measure']}; compile inductor "
          f"{compile_s['inductor']:.1f} s, auto {compile_s['auto']:.1f} s, measure "
          f"{compile_s['measure']:.1f} s of which measuring {spent[0]:.1f} s | "
          + " ".join(f"err[{k}]={v:.1e}" for k, v in errs.items()), flush=True)


def bench_mochi_floor(dtype_name, rounds):
    """What any gather + matmul form of the Mochi downsample can reach at best: the compiled
    patch gather and the matmul on ready patches, timed beside Inductor's conv."""
    shape, out_ch, k, s, _ = SHAPES["mochi"]
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    n, c, t, h, w = shape
    x = torch.randn(shape, dtype=dtype)
    weight = torch.randn(out_ch, c, *k, dtype=dtype)
    bias = torch.randn(out_ch, dtype=dtype)

    def gather(x):  # (N*T'*H'*W', C*kT*kH*kW) patches; the reshape copies (a permuted view)
        kt, kh, kw = k
        return (x.view(n, c, t // kt, kt, h // kh, kh, w // kw, kw)
                .permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(-1, c * kt * kh * kw))

    patches, w2 = gather(x), weight.reshape(out_ch, -1).t()
    fns = {"inductor": torch.compile(lambda x: torch.nn.functional.conv3d(x, weight, bias, s)),
           "gather": torch.compile(gather),
           "mm": lambda x: torch.addmm(bias, patches, w2)}  # on ready patches: x is unused
    times = time_side_by_side(fns, x, rounds)
    floor = times["gather"] + times["mm"]
    print(f"mochi     {dtype_name}  floor of a gather+matmul form: gather "
          f"{times['gather'] * 1e3:.2f} ms + addmm {times['mm'] * 1e3:.2f} ms vs Inductor conv "
          f"{times['inductor'] * 1e3:.2f} ms: at best {times['inductor'] / floor:.2f}x Inductor's "
          f"speed", flush=True)


def bench_wan_decode(rounds):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=32, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                           attn_scales=[], temperal_downsample=[False, True],
                           latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()
    z = torch.randn(1, 4, 3, 32, 32)
    decode = lambda z: vae.decode(z).sample
    fns, compile_s = {"eager": decode}, {}
    fns["inductor"] = compiled(decode, "inductor")
    _, compile_s["inductor"] = first_call(fns["inductor"], z)
    with cold_measuring() as spent:
        fns["measure"] = compiled(decode, "convlower", select="measure")
        convlower.reset_report()
        _, compile_s["measure"] = first_call(fns["measure"], z)
        chose = collections.Counter(e["rule"] or "original" for e in convlower.report().convolutions
                                    if e["phase"] == "forward")
    with torch.no_grad():
        err = rel_err(fns["measure"](z), decode(z))
    t = time_side_by_side(fns, z, rounds)
    print(f"wan-vae decode {tuple(z.shape)}: inductor {t['inductor'] * 1e3:.0f} ms, eager "
          f"{t['inductor'] / t['eager']:.2f}x, convlower(measure) {t['inductor'] / t['measure']:.2f}x"
          f" of Inductor speed (time ratio {t['measure'] / t['inductor']:.3f}); compile "
          f"inductor {compile_s['inductor']:.0f} s, convlower(measure) {compile_s['measure']:.0f} s "
          f"of which measuring {spent[0]:.0f} s; convs: "
          + ", ".join(f"{k} x{v}" for k, v in sorted(chose.items()))
          + f"; max rel err vs eager {err:.1e}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=list(ALL_SHAPES), choices=list(ALL_SHAPES))
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-vae", action="store_true")
    a = ap.parse_args()
    torch._inductor.config.force_disable_caches = True  # honest cold compile times
    torch._dynamo.config.recompile_limit = 64  # one entry per variant on Conv3d.forward
    torch._dynamo.config.automatic_dynamic_shapes = False  # each shape compiled static
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ratios are speed "
          f"relative to Inductor (>1 = faster), median of {a.rounds} interleaved rounds")
    for dt in a.dtypes:
        for s in a.shapes:
            bench_shape(s, dt, a.rounds)
        if "mochi" in a.shapes:
            bench_mochi_floor(dt, a.rounds)
    if not a.no_vae:
        bench_wan_decode(a.rounds)


if __name__ == "__main__":
    main()
