"""The ``gpu`` subset: what only a CUDA or HIP device can show.  ``bench/device_check.py`` runs it.

* every rule, forward and backward against eager, fp32 and bf16, contiguous and channels-last;
* the Snake routes with ``platform`` forced to "hip" (the eager-safe op) and to "cuda" (fused:
  a Triton kernel on a GPU);
* measured selection with the real timer (device synchronisation, plausible timings, the
  decision cache on disk and its reuse);
* ``convlower.warmup`` from a second process finding the first one's caches warm.

Without a GPU every test here is skipped, with the reason.  ``CONVLOWER_TEST_DEVICE=cpu``
(set only by ``bench/device_check.py --device cpu``) runs them on the CPU instead, so the code
paths stay alive between GPU loans; ``CONVLOWER_TEST_QUICK=1`` runs each rule once (rotating
dtype and layout) instead of the full matrix.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import convlower
from helpers import has_conv
from convlower import selection
from convlower.selection import measure
from convlower.selection.timer import plausible


def target_device(env=None, cuda_available=None):
    """(device, None) to run on, or (None, why the tests are skipped)."""
    env = os.environ if env is None else env
    forced = env.get("CONVLOWER_TEST_DEVICE")
    if forced:
        return torch.device(forced), None
    if torch.cuda.is_available() if cuda_available is None else cuda_available:
        return torch.device("cuda"), None
    return None, ("no CUDA or HIP GPU here (torch.cuda.is_available() is False); "
                  "bench/device_check.py runs this subset on a GPU")


DEVICE, SKIP_WHY = target_device()
QUICK = os.environ.get("CONVLOWER_TEST_QUICK") == "1"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE is None, reason=SKIP_WHY or "")]

BF16, F32 = torch.bfloat16, torch.float32
TOL = {F32: 1e-4, BF16: 3e-2}  # max |diff| / max |reference|
SIN = re.compile(r"\b(sin|cos)\b")


@pytest.fixture(autouse=True)
def _kernel_cache_only():
    """Graphs always compile (the pass runs and reports), but compiled kernels are reused
    from Inductor's cache directory: conftest's force_disable_caches would rebuild every
    kernel in a fresh directory, which costs minutes on a small CPU.  Exact fp32 on CUDA:
    cuDNN's TF32 would otherwise make eager convs differ from the rules' fp32 matmuls."""
    from torch._functorch import config as functorch_config

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._inductor.config.patch(
            force_disable_caches=False, fx_graph_cache=False, fx_graph_remote_cache=False))
        stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        tf32 = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False
        stack.callback(setattr, torch.backends.cudnn, "allow_tf32", tf32)
        yield


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


# ---------------------------------------------------------------------------- each rule

# rule -> (Conv3d args, input shape): a site the rule is eligible for
RULE_SITES = {
    "patch_linear": (dict(in_channels=3, out_channels=16, kernel_size=(2, 4, 4), stride=(2, 4, 4)),
                     (3, 3, 2, 4, 4)),  # Qwen2.5-VL's patch embedding, scaled down
    "patchify_mm": (dict(in_channels=4, out_channels=8, kernel_size=(1, 2, 2), stride=(1, 2, 2)),
                    (2, 4, 3, 6, 6)),  # DiT-style
    "time_fold_conv2d": (dict(in_channels=4, out_channels=6, kernel_size=(2, 3, 3), stride=(2, 1, 1),
                              padding=(0, 1, 1)), (1, 4, 4, 6, 6)),  # Mochi-style, kT == sT
    "time_unfold_conv2d": (dict(in_channels=4, out_channels=6, kernel_size=3, padding=1),
                           (1, 4, 5, 6, 6)),  # Wan 3x3x3
    "time_sum_conv2d": (dict(in_channels=4, out_channels=6, kernel_size=3, padding=1),
                        (1, 4, 5, 6, 6)),
}
VARIANTS = [(F32, "contiguous"), (BF16, "contiguous"), (F32, "channels_last"),
            (BF16, "channels_last")]


def rule_cases():
    for i, rule in enumerate(RULE_SITES):
        variants = [VARIANTS[i % len(VARIANTS)]] if QUICK else VARIANTS
        for dtype, layout in variants:
            yield pytest.param(rule, dtype, layout, id=f"{rule}-{str(dtype)[6:]}-{layout}")


def fwd_bwd(module, x):
    out = module(x)
    g = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape).to(out.dtype)
    grads = torch.autograd.grad(out, [x] + list(module.parameters()), g)
    return out, grads


@pytest.mark.parametrize("rule, dtype, layout", list(rule_cases()))
def test_rule_forward_backward_matches_eager(rule, dtype, layout):
    args, shape = RULE_SITES[rule]
    torch.manual_seed(0)
    conv = nn.Conv3d(**args).to(DEVICE, dtype)
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    x.requires_grad_()
    ref, ref_grads = fwd_bwd(conv, x)
    compiled = torch.compile(conv, backend="convlower", options={"rules": [rule], "select": "always"})
    (out, grads), code = run_and_get_code(lambda: fwd_bwd(compiled, x))
    assert out.shape == ref.shape and out.dtype == dtype and out.device == x.device
    assert rel_err(out, ref) <= TOL[dtype], ("output", rel_err(out, ref))
    for name, g, r in zip(["x", "weight", "bias"], grads, ref_grads):
        assert rel_err(g, r) <= TOL[dtype], (name, rel_err(g, r))
    used = {(c.phase, c.rule) for c in convlower.report().convolutions}
    assert used == {("forward", rule), ("backward", rule)}, used
    if rule in ("patch_linear", "patchify_mm"):  # exact patch rules leave no convolution
        assert not has_conv(code), "a convolution call is left in the generated code"


# ---------------------------------------------------------------------------- Snake routes


class SnakeNet(nn.Module):
    """Conv1d + a DAC-style Snake (``x + 1/(alpha + 1e-9) * sin(alpha x)^2``)."""

    def __init__(self, c=8):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)
        self.alpha = nn.Parameter(torch.rand(1, c, 1) + 0.5)

    def forward(self, x):
        y = self.conv(x)
        return y + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * y).pow(2)


@pytest.mark.parametrize("platform, route", [("hip", "eager"), ("cuda", "fused")])
def test_snake_route_with_forced_platform(platform, route):
    torch.manual_seed(0)
    m = SnakeNet().to(DEVICE, BF16)
    x = torch.randn(2, 8, 64, device=DEVICE, dtype=BF16, requires_grad=True)
    ref, ref_grads = fwd_bwd(m, x)
    compiled = torch.compile(m, backend="convlower", options={"platform": platform})
    (out, grads), code = run_and_get_code(lambda: fwd_bwd(compiled, x))
    # bf16 both ways; the eager-safe op computes in fp32, so compare loosely
    assert rel_err(out, ref) <= 5e-2
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= 5e-2
    sites = convlower.report().snake
    assert [s.route for s in sites] == [route], [(s.route, s.why) for s in sites]
    text = "\n".join(code)
    if route == "eager":
        assert "torch.ops.convlower.snake.default(" in code[0]
        assert "torch.ops.convlower.snake_backward.default(" in code[-1]
        assert not SIN.search(text), "a generated kernel computes sin/cos on the HIP route"
    else:
        assert "convlower.snake" not in text and SIN.search(text)
        if DEVICE.type == "cuda":
            assert "@triton.jit" in text, "the fused Snake is not a Triton kernel"


# ---------------------------------------------------------------------------- measurement


def test_measured_selection_with_the_real_timer(tmp_path, monkeypatch):
    # select="exhaustive" compiles and times every candidate with the real (synchronising)
    # timer; a Mochi-style downsample is eligible for several rules and won by none by proof
    monkeypatch.setattr(measure, "MIN_CONV_S", 0.0)  # measure even a small conv
    selection.set_cache_dir(tmp_path)
    selection.clear_memory()
    prev = selection.set_timer(None)
    options = {"select": "exhaustive"}
    try:
        torch.manual_seed(0)
        conv = nn.Conv3d(8, 16, 2, stride=2).to(DEVICE).eval()
        x = torch.randn((1, 8, 4, 8, 8) if QUICK else (1, 64, 8, 32, 32), device=DEVICE)
        if not QUICK:
            conv = nn.Conv3d(64, 128, 2, stride=2).to(DEVICE).eval()
        with torch.no_grad():
            out = torch.compile(conv, backend="convlower", options=options)(x)
            ref = conv(x)
        assert rel_err(out, ref) <= TOL[F32]
        (rec,) = convlower.report().convolutions
        assert rec.how == "measurement", rec.reason
        assert "aten" in rec.timings and len(rec.timings) >= 2, (rec.timings, rec.reason)
        for name, seconds in rec.timings.items():
            assert plausible(seconds) is None, (name, seconds)
        assert json.loads((tmp_path / "decisions.json").read_text()), "no decision on disk"
        # a fresh compile reads the decision back from disk instead of measuring again
        torch._dynamo.reset()
        selection.clear_memory()
        convlower.reset_report()
        with torch.no_grad():
            torch.compile(conv, backend="convlower", options=options)(x)
        (again,) = convlower.report().convolutions
        assert again.how == "cache" and again.rule == rec.rule, (again.how, again.reason)
    finally:
        selection.set_timer(prev)
        selection.set_cache_dir(None)
        selection.clear_memory()


# ---------------------------------------------------------------------------- warm-up


ZOO_MODEL = os.environ.get("CONVLOWER_TEST_ZOO_MODEL", "mochi-downsample")
ZOO_SIZE = os.environ.get("CONVLOWER_TEST_ZOO_SIZE", "tiny" if QUICK else "small")

WORKER = textwrap.dedent(r"""
    import json, sys, time, torch, convlower
    from convlower.tools import zoo
    cache_dir, device, name, size = sys.argv[1:5]
    torch.backends.cudnn.allow_tf32 = False
    model, inputs = zoo.build(name, size)
    model = model.to(device)
    inputs = tuple(t.to(device) for t in inputs)
    with torch.no_grad():
        f, r = convlower.warmup(model, inputs, cache_dir=cache_dir, iters=2,
                                save_compiled=False)  # Inductor's caches (saved: test_saved)
        out, ref = f(*inputs), model(*inputs)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    from convlower.backend.conv_pass import ConvLowerPass
    from convlower.backend.options import parse
    print("RESULT " + json.dumps({
        "ok": err <= 1e-3, "max_rel_err": err, "uuid": ConvLowerPass(parse({})).uuid(),
        "cache": r.cache, "warm": r.warm, "compile_s": r.compile_s,
        "first_step_s": r.first_step_s, "counts": r.cache_counts, "warnings": r.warnings,
        "graphs": r.statistics.get("graphs"), "rewrites": r.statistics.get("rewrites"),
        "verdict": r.verdict}))
""")


def _warmup_process(cache_dir) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FORCE_DISABLE_CACHES",
                        "CONVLOWER_CACHE_DIR")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", WORKER, str(cache_dir), str(DEVICE), ZOO_MODEL,
                           ZOO_SIZE], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    result["process_wall_s"] = time.perf_counter() - start
    return result


def test_warmup_from_a_second_process(tmp_path):
    """The second process finds the first one's caches warm.  Under bench/device_check.py
    (CONVLOWER_DEVICE_CHECK_RESULTS) the two processes' figures are its compile table."""
    cold = _warmup_process(tmp_path / "cache")
    warm = _warmup_process(tmp_path / "cache")
    results = os.environ.get("CONVLOWER_DEVICE_CHECK_RESULTS")
    if results:
        with open(os.path.join(results, "warmup.json"), "w", encoding="utf-8") as f:
            json.dump({"model": ZOO_MODEL, "size": ZOO_SIZE, "device": str(DEVICE),
                       "cold": cold, "warm": warm}, f, indent=1)
    print(f"\nwarm-up of {ZOO_MODEL} ({ZOO_SIZE}) on {DEVICE}: compile cold "
          f"{cold['compile_s']:.2f} s, warm {warm['compile_s']:.2f} s")
    assert cold["ok"] and warm["ok"], (cold["max_rel_err"], warm["max_rel_err"])
    assert cold["uuid"] == warm["uuid"], "convlower's sources changed between the two processes"
    assert cold["cache"] == "cold" and not cold["warm"], cold
    assert warm["cache"] == "warm" and warm["warm"], warm
    assert warm["counts"]["fx_graph_hit"] >= 1 and warm["counts"]["fx_graph_miss"] == 0
    assert cold["warnings"] == [] and warm["warnings"] == []
