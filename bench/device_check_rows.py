"""The device check's performance rows (``bench/device_check.py`` runs them through
``Check.row``, which bounds each in time and records its error): the Qwen2.5-VL patch
embedding (with what one call runs, and the generated code), the Conv3d rows of bench_conv3d, a Wan VAE
decode, the Oobleck decoder's Snake; on request, an SDXL-layout UNet whole against regions."""
from __future__ import annotations

import collections
import contextlib
import os
import time

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Wan VAE decode (diffusers AutoencoderKLWan): the bench_conv3d model at 256x256 output on a
# GPU; on CPU (quick) the smallest configuration that still runs the same decode.
WAN = {
    "full": dict(base_dim=32, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[],
                 temperal_downsample=[False, True], latent=[1, 4, 3, 64, 64]),
    "quick": dict(base_dim=4, z_dim=2, dim_mult=[1], num_res_blocks=0, attn_scales=[],
                  temperal_downsample=[], latent=[1, 2, 1, 4, 4]),
}
# Oobleck decoder (Snake activations): bench_snake's default decoder on a GPU; tiny on CPU.
OOBLECK_QUICK = dict(encoder_hidden_size=8, downsampling_ratios=[2], channel_multiples=[1],
                     decoder_channels=8, decoder_input_channels=4, audio_channels=2)
CODE_FILE = "patch_embed_code.txt"  # generated code of each convlower patch-embed compile, in --out


def _rel_err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def _inference(f, *args):
    """``f(*args)`` without autograd, as a zero-argument call to time."""
    def run():
        with torch.no_grad():
            return f(*args)
    return run


@contextlib.contextmanager
def warnings_off():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ------------------------------------------------------------------------------ patch embedding
def patch_embed_rows(check) -> None:
    n = check.plan["patches"]
    for dtype_name, backward in check.plan["patch_cases"]:
        check.row("patch_embed", f"Qwen2.5-VL patch embed, {n} patches", dtype_name,
                  "fwd+bwd" if backward else "fwd",
                  lambda d=dtype_name, b=backward: patch_embed(check, n, DTYPES[d], b))


class FlatMM(nn.Module):
    """What patch_linear emits, written by hand: flatten + mm against the conv's own weight."""

    def __init__(self, conv):
        super().__init__()
        self.weight = conv.weight

    def forward(self, x):
        w = self.weight
        out = x.reshape(x.shape[0], -1) @ w.reshape(w.shape[0], -1).t()
        return out.view(x.shape[0], w.shape[0], 1, 1, 1)


def patch_embed(check, n: int, dtype, backward: bool) -> dict:
    """Conv3d 3 -> 1280, kernel = stride = (2, 14, 14) on [n, 3, 2, 14, 14] (bench_patch_embed):
    eager, Inductor, convlower, the same flatten + mm compiled by Inductor, and a bare mm."""
    dev = check.device
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 1280, (2, 14, 14), stride=(2, 14, 14), bias=False).to(dev, dtype)
    x = torch.randn(n, 3, 2, 14, 14, device=dev, dtype=dtype, requires_grad=backward)
    w = conv.weight
    gy = torch.randn(n, 1280, 1, 1, 1, device=dev, dtype=dtype)
    flat_w = w.detach().reshape(1280, -1).t().contiguous()
    flat_x = x.detach().reshape(n, -1)
    gy2 = gy.reshape(n, 1280)
    mods = {"eager": conv, "inductor": torch.compile(conv, backend="inductor"),
            "convlower": torch.compile(conv, backend="convlower"),
            "compiled mm": torch.compile(FlatMM(conv), backend="inductor")}

    def step(f):
        if backward:
            return lambda: torch.autograd.grad(f(x), (x, w), gy)
        return _inference(f, x)

    if dev.type == "cuda" and not backward:  # what CUDA graphs leave of the per-call cost
        mods["convlower cudagraphs"] = torch.compile(conv, backend="convlower",
                                                     mode="reduce-overhead")
    fns = {k: step(f) for k, f in mods.items()}
    if backward:
        fns["bare mm"] = lambda: (flat_x @ flat_w, gy2 @ flat_w.t(), gy2.t() @ flat_x)
    else:
        fns["bare mm"] = _inference(lambda: flat_x @ flat_w)  # the same no_grad wrapper
    variants = check.compare(fns)
    with torch.no_grad():
        err = _rel_err(mods["convlower"](x), conv(x))
    name = {v: k for k, v in DTYPES.items()}[dtype]
    key = f"patch embed {name} {'fwd+bwd' if backward else 'fwd'}"
    if check.plan["diagnose_all"] or (dtype == torch.bfloat16 and not backward):
        check.diagnose(key, lambda: patch_embed_diagnosis(check, conv, x, gy, fns, backward))
    return {"variants": variants, "primary": "convlower", "floor": ["bare mm", "compiled mm"],
            "max_rel_err_convlower": err}


def patch_embed_diagnosis(check, conv, x, gy, fns: dict, backward: bool) -> dict:
    """The generated code of a fresh convlower compile (appended to CODE_FILE in --out) and,
    per variant, the kernels one call runs (profiler) and the host time to launch one call."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fresh = torch.compile(conv, backend="convlower")
    call = (lambda: torch.autograd.grad(fresh(x), (x, conv.weight), gy)) if backward \
        else _inference(fresh, x)
    _, codes = run_and_get_code(call)
    path = os.path.join(check.out, CODE_FILE)
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"#### {x.dtype} {'fwd+bwd' if backward else 'fwd'}, input {list(x.shape)}, "
                f"torch {torch.__version__}, {len(codes)} generated module(s)\n")
        for c in codes:
            f.write(c.rstrip() + "\n\n")
    keep = [k for k in ("convlower", "compiled mm", "bare mm") if k in fns]
    return {"code_file": CODE_FILE,
            "profile": {k: profile_calls(fns[k], check.device) for k in keep}}


def profile_calls(fn, device, calls: int = 20) -> dict:
    """Kernels per call (name, count, device us) and host us to launch one call."""
    from torch.profiler import ProfilerActivity, profile

    from convlower.device import sync

    try:
        fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - t0) / calls
        sync(device)
        gpu = device.type == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with profile(activities=acts) as prof:
            for _ in range(calls):
                fn()
            sync(device)
        return _kernels(prof, calls, gpu) | {"host_us_per_call": round(host * 1e6, 2)}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def _kernels(prof, calls: int, gpu: bool) -> dict:
    """Device kernels (GPU) or top-level aten ops (CPU) of a profile, per call."""
    rows = []
    for a in prof.key_averages():
        if gpu:
            is_kernel = str(getattr(a, "device_type", "")).endswith("CUDA")
            us = getattr(a, "self_device_time_total", None)
            if us is None:
                us = getattr(a, "self_cuda_time_total", 0)
        else:
            is_kernel = a.key.startswith("aten::") or "convlower" in a.key
            us = a.self_cpu_time_total
        if is_kernel and a.count:
            rows.append({"name": a.key, "count_per_call": round(a.count / calls, 2),
                         "us_per_call": round(us / calls, 2)})
    rows.sort(key=lambda k: -k["us_per_call"])
    return {"unit": "GPU kernels" if gpu else "CPU ops (self time)", "kernels": rows[:20],
            "device_us_per_call": round(sum(k["us_per_call"] for k in rows), 2),
            "launches_per_call": round(sum(k["count_per_call"] for k in rows), 2)}


# ------------------------------------------------------------------------------ Conv3d rows
def conv3d_shapes(check) -> dict:
    from bench_conv3d import SHAPES  # noqa: E402  (bench/ is on sys.path)

    names = check.plan["conv3d_shapes"] or list(SHAPES)
    shapes = {k: SHAPES[k] for k in names if k in SHAPES}
    if check.args.quick:
        shapes = {k: shrink(*v) for k, v in shapes.items()}
    return shapes


def shrink(shape, out_ch, k, s, p):
    """A tiny version of a bench_conv3d shape with the same kernel, stride and padding."""
    n, c, *dims = shape
    dims = [min(d, 4 * kk) for d, kk in zip(dims, k)]
    return [1, max(4, c // 16)] + dims, max(4, out_ch // 16), k, s, p


def conv3d_rows(check) -> None:
    dtype_name = check.plan["conv3d_dtype"]
    for name, spec in conv3d_shapes(check).items():
        shape = "x".join(map(str, spec[0]))
        check.row("conv3d", f"{name} {shape} -> {spec[1]} k{''.join(map(str, spec[2]))}",
                  dtype_name, "fwd", lambda spec=spec: conv3d(check, spec, DTYPES[dtype_name]))


def conv3d(check, spec, dtype) -> dict:
    """bench_conv3d's row: eager, Inductor, each eligible rule, convlower, select=measure."""
    from convlower.lowerings import RULES
    from convlower.lowerings.proof import check as prove
    from convlower.lowerings.rule import ConvCall

    shape, out_ch, k, s, p = spec
    torch.manual_seed(0)
    conv = nn.Conv3d(shape[1], out_ch, k, s, p).to(check.device, dtype).eval()
    x = torch.randn(shape, device=check.device, dtype=dtype)
    call = ConvCall.from_args([x, conv.weight, conv.bias, s, p, (1, 1, 1), False, (0, 0, 0), 1])
    # lowerings only: eager_conv is never forced (select="always"); "convlower" shows if chosen
    rules = [r for r in RULES if RULES[r].lowers and prove(RULES[r], call).eligible]
    if check.plan["conv3d_max_rules"] is not None:
        rules = rules[:check.plan["conv3d_max_rules"]]
    mods = {"eager": conv, "inductor": torch.compile(conv, backend="inductor")}
    for r in rules:
        mods[r] = torch.compile(conv, backend="convlower", options={"rules": [r], "select": "always"})
    mods["convlower"] = torch.compile(conv, backend="convlower")
    mods["measure"] = torch.compile(conv, backend="convlower", options={"select": "measure"})

    fns = {k: _inference(f, x) for k, f in mods.items()}
    variants = check.compare(dict(fns))
    with torch.no_grad():
        ref = conv(x)
        errs = {k: _rel_err(mods[k](x), ref) for k in mods if k != "eager"
                and not variants[k].get("error")}
    # Per call, device time apart from host time: a batch-1 row on a GPU is launch-bound (its
    # wall time is the compiled call's host cost); "convlower >= 0.97x eager" per conv is read
    # on the device time (issue 23).
    live = [k for k in ("eager", "inductor", "convlower") if not variants[k].get("error")]
    check.diagnose(f"conv3d {'x'.join(map(str, shape))} k{''.join(map(str, k))} {dtype}",
                   lambda: {"profile": {n: profile_calls(fns[n], check.device) for n in live}})
    return {"variants": variants, "primary": "convlower", "eligible_rules": rules,
            "max_rel_err": errs}


# ------------------------------------------------------------------------------ models
def wan_vae_rows(check) -> None:
    cfg = WAN["quick" if check.args.quick else "full"]
    latent = "x".join(map(str, cfg["latent"]))
    check.row("wan_vae", f"Wan VAE decode, latent {latent}", "bf16", "fwd",
              lambda: wan_vae(check, dict(cfg)))


def wan_vae(check, cfg: dict) -> dict:
    from diffusers import AutoencoderKLWan

    latent = cfg.pop("latent")
    torch.manual_seed(0)
    z_dim = cfg["z_dim"]
    with warnings_off():
        vae = AutoencoderKLWan(**cfg, latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)
        vae = vae.eval().to(check.device, torch.bfloat16)
    z = torch.randn(latent, device=check.device, dtype=torch.bfloat16)

    def decode(z):
        return vae.decode(z).sample

    mods = {"eager": decode, "inductor": torch.compile(decode, backend="inductor"),
            "convlower": torch.compile(decode, backend="convlower")}

    variants = check.compare({k: _inference(f, z) for k, f in mods.items()})
    with torch.no_grad():
        err = _rel_err(mods["convlower"](z), decode(z))
    return {"variants": variants, "primary": "convlower", "max_rel_err_convlower": err}


def snake_rows(check) -> None:
    frames = check.plan["snake_frames"]
    what = "tiny Oobleck decoder" if check.args.quick else "Oobleck decoder (78M)"
    check.row("snake", f"{what}, {frames} latent frames", "bf16", "fwd",
              lambda: snake(check, frames))


def snake(check, frames: int) -> dict:
    """bench_snake's variants: eager, Inductor, convlower snake="fused", snake="eager"."""
    import bench_snake  # noqa: E402  (bench/ is on sys.path)

    dtype = torch.bfloat16
    if check.args.quick:
        from diffusers import AutoencoderOobleck

        torch.manual_seed(0)
        with warnings_off():
            dec = AutoencoderOobleck(**OOBLECK_QUICK).decoder.to(dtype).eval()
    else:
        with warnings_off():
            dec = bench_snake.decoder(dtype)
    dec = dec.to(check.device)
    z = torch.randn(1, dec.conv1.in_channels, frames, device=check.device, dtype=dtype)
    mods = bench_snake.variants(dec)

    variants = check.compare({k: _inference(f, z) for k, f in mods.items()})
    expect = {"fused": "fused", "eager-safe": "eager"}
    for k, route in expect.items():
        got = variants.get(k, {}).get("snake_routes")
        if got is not None and set(got) != {route}:
            variants[k]["error"] = f"expected every Snake on the {route} route, got {got}"
    return {"variants": variants, "primary": "fused", "compare_to": "eager-safe"}


# SDXL-layout UNet for regions (issue 20): SDXL's widths and conditioning, transformer depth
# 1/2/4 (SDXL's 1/2/10), the latent of a 512x512 image, batch 2 (classifier-free guidance);
# each a change to the zoo's sdxl-unet "tiny" config (its layout and the keys its builder
# reads).  Quick: that tiny UNet on the CPU.  Steps in samples of ~0.2 s of consecutive calls
# (a generate loop's: the host runs ahead of the GPU within a sample), 15 rounds.
UNET = {
    "full": dict(block_out_channels=(320, 640, 1280), norm_num_groups=32,
                 attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 4),
                 cross_attention_dim=2048, addition_time_embed_dim=256, text_embeds_dim=1280,
                 tokens=77, latent=[2, 4, 64, 64]),
    "quick": {},
}
UNET_RUN = {"full": dict(dtype="bf16", rounds=15, min_sample_s=0.2),
            "quick": dict(dtype="fp32", rounds=None, min_sample_s=None)}  # None: the plan's


def regions_rows(check) -> None:
    size = "quick" if check.args.quick else "full"
    run = UNET_RUN[size]
    what = ("zoo sdxl-unet (tiny)" if check.args.quick
            else "SDXL-layout UNet, depth 1/2/4, 2x4x64x64")
    check.row("regions", what, run["dtype"], "fwd", lambda: regions(check, UNET[size], run))


def unet_config(overrides: dict) -> dict:
    """The zoo's tiny sdxl-unet config with ``overrides``."""
    from convlower.tools import zoo

    return dict(zoo.ZOO["sdxl-unet"].configs["tiny"], **overrides)


def regions(check, overrides: dict, run: dict) -> dict:
    """Regions against the whole graph where a GPU runs the kernels.  On the 2-core CPU regions
    cost 3-5% of a UNet step: host work per part call (interpreter, allocator, OpenMP), run
    in series with the kernels; a GPU's asynchronous launches may hide it.  First calls
    (compile seconds) run in one process in the order of ``mods``: regions pays the process's
    one-time costs (its first Inductor and Triton compiles, the compile workers, the first
    trace of the diffusers code, convlower's probe and cold selection), so its ratio to
    Inductor errs against regions; convlower's whole graph comes last and reuses what the
    two before it built (same-named kernels, conv decisions): its first call is no cold
    compile (the report says so)."""
    from convlower.tools import zoo

    dtype = DTYPES[run["dtype"]]
    torch.manual_seed(0)
    with warnings_off(), torch.device(check.device):   # weights made where they run
        model, inputs = zoo.ZOO["sdxl-unet"].builder(unet_config(overrides))
    model = model.to(dtype).eval()
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    mods = {"eager": model,
            "regions": torch.compile(model, backend="convlower", options={"regions": "auto"}),
            "inductor": torch.compile(model, backend="inductor"),
            "convlower": torch.compile(model, backend="convlower")}
    variants = check.compare({k: _inference(f, *inputs) for k, f in mods.items()},
                             rounds=run["rounds"], min_sample_s=run["min_sample_s"])
    reg = variants["regions"]
    if not reg.get("error") and not (reg.get("region_parts") or {}).get("reused"):
        # convlower falls back to the whole graph when splitting fails: not a regions figure
        reg["error"] = f"regions reused no part: {reg.get('region_parts')}"
    with torch.no_grad():
        ref = model(*inputs)
        errs = {k: _rel_err(mods[k](*inputs), ref) for k in ("regions", "inductor", "convlower")
                if not variants[k].get("error")}
    return {"variants": variants, "primary": "regions", "compare_to": ["convlower", "inductor"],
            "max_rel_err": errs}


RUNNERS = {"patch_embed": patch_embed_rows, "conv3d": conv3d_rows, "wan_vae": wan_vae_rows,
           "snake": snake_rows, "regions": regions_rows}
