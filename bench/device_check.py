"""The device check: one prepared command for the few minutes a GPU machine is lent.

    python bench/device_check.py --out DIR                    # on a CUDA or HIP GPU, < 8 min
    python bench/device_check.py --device cpu --quick --out DIR   # the same code paths on CPU

It answers, in one run, and writes ``DIR/device_check.json`` and ``DIR/device_check.md``
(the markdown table, also printed):

1. **The ``gpu`` test subset** (``tests/test_gpu.py``, pytest marker ``gpu``), in a child
   pytest: every rule forward and backward against eager in fp32 and bf16, channels-last
   included; the Snake routes with ``platform`` forced to "hip" and to "cuda"; measured
   selection with the real timer and the decision cache; ``convlower.warmup`` from a second
   process, which also gives **cold and warm compile times** for one zoo model.
2. **A performance table** (median ms per call): the Qwen2.5-VL patch embedding at 8192
   patches, fp32 and bf16, forward and forward+backward (convlower, Inductor, eager, a bare
   mm); the Conv3d rows of ``bench/bench_conv3d.py`` in bf16 (eager, Inductor, each eligible
   rule, convlower, convlower ``select="measure"``); a Wan VAE decode in bf16; the Oobleck
   decoder's Snake in bf16, fused against the eager-safe op.

Timing (:mod:`convlower.tools.device_timing`): CUDA events on a GPU (the wall clock with
device synchronisation on a CPU), warm-up calls before timing, samples of several calls, the
median over interleaved rounds; a variant whose timer reports <= 0 (or anything implausible)
is rejected, not shown.  Compiles use a fresh Inductor cache (``--inductor-cache``) and a cold
decision cache, so compile seconds and selection are what a first run sees.

``--quick`` runs every section with tiny sizes and a reduced grid, the tests alongside the perf
rows, on CPU in about two minutes (``tests/test_device_check.py`` runs it in CI); its figures
mean nothing.  On CPU the ``gpu``
tests run only because this script asks for it (``CONVLOWER_TEST_DEVICE=cpu``); a plain
``pytest`` run without a GPU skips them.  A time budget (``--budget-s``) skips what would not
finish; every section that did run is in the files, even when a later one fails.
Exit status: 0 when every test passed and every variant ran, 1 otherwise.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import platform as _platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET

import torch
from torch import nn

import convlower
from convlower import selection
from convlower.device import device_name, platform as device_platform, sync
from convlower.tools.device_timing import clock_for, time_interleaved

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCHEMA = 1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SECTIONS = ("tests", "patch_embed", "snake", "conv3d", "wan_vae")

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

PLANS = {
    "full": dict(patches=8192, patch_cases=[("fp32", False), ("fp32", True), ("bf16", False),
                                            ("bf16", True)],
                 conv3d_dtype="bf16", conv3d_shapes=None, conv3d_max_rules=None,
                 snake_frames=8, zoo_model="mochi-downsample", zoo_size="small",
                 rounds=7, warmup=3, min_sample_s=0.02, budget_s=450.0, tests_timeout_s=300.0,
                 min_row_s=20.0),
    # quick: CPU conv3d backward in bf16 takes seconds even on 8 patches: fp32 there
    "quick": dict(patches=8, patch_cases=[("fp32", True), ("bf16", False)],
                  conv3d_dtype="bf16", conv3d_shapes=["mochi"], conv3d_max_rules=1,
                  snake_frames=1, zoo_model="mochi-downsample", zoo_size="tiny",
                  rounds=3, warmup=1, min_sample_s=0.002, budget_s=600.0, tests_timeout_s=400.0,
                  min_row_s=0.0),
}


# ------------------------------------------------------------------------------ environment
def environment(device: torch.device, clock) -> dict:
    env = {
        "device": str(device), "device_name": device_name(device),
        "platform": device_platform("auto", device), "torch": torch.__version__,
        "cuda": torch.version.cuda, "hip": torch.version.hip, "convlower": convlower.__version__,
        "python": _platform.python_version(), "threads": torch.get_num_threads(),
        "clock": getattr(clock, "kind", "?"), "host": _platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    with contextlib.suppress(Exception):
        import triton

        env["triton"] = triton.__version__
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   cudnn=torch.backends.cudnn.version(),
                   cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                   matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                   cudnn_benchmark=torch.backends.cudnn.benchmark)
    return env


# ------------------------------------------------------------------------------ the run
class Check:
    """The run's state: plan, device, clock, deadline, results; writes the files often."""

    def __init__(self, args, plan: dict):
        self.args, self.plan = args, plan
        self.device = torch.device(args.device)
        self.clock = clock_for(self.device, args.clock)
        self.start = time.perf_counter()
        self.deadline = self.start + (args.budget_s or plan["budget_s"])
        self.out = args.out
        self.results = {
            "schema": SCHEMA, "quick": args.quick, "command": " ".join(sys.argv),
            "environment": environment(self.device, self.clock),
            "timing": {"clock": getattr(self.clock, "kind", "?"), "rounds": plan["rounds"],
                       "warmup_calls": plan["warmup"], "min_sample_s": plan["min_sample_s"],
                       "statistic": "median over interleaved rounds; a variant with any "
                                    "timing <= 0 (or implausible) is rejected"},
            "tests": {"status": "not run"}, "compile": {"status": "not run"},
            "perf": {"rows": []}, "failures": [], "notes": [], "wall_s": None,
        }

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def log(self, msg: str) -> None:
        print(f"[device_check {time.perf_counter() - self.start:6.1f} s] {msg}", flush=True)

    def write(self) -> None:
        self.results["wall_s"] = round(time.perf_counter() - self.start, 2)
        os.makedirs(self.out, exist_ok=True)
        tmp = os.path.join(self.out, "device_check.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.results, f, indent=1, default=str)
        os.replace(tmp, os.path.join(self.out, "device_check.json"))
        with open(os.path.join(self.out, "device_check.md"), "w", encoding="utf-8") as f:
            f.write(markdown(self.results))

    # -- one perf row: deadline, isolation, bookkeeping
    def row(self, section: str, case: str, dtype: str, mode: str, build) -> None:
        row = {"section": section, "case": case, "dtype": dtype, "pass": mode}
        if self.remaining() < self.plan["min_row_s"]:
            row["skipped"] = f"time budget spent ({self.args.budget_s or self.plan['budget_s']:.0f} s)"
            self.results["notes"].append(f"{section} {case} {dtype} {mode}: skipped, {row['skipped']}")
        else:
            self.log(f"{section}: {case} {dtype} {mode}")
            t0 = time.perf_counter()
            torch._dynamo.reset()
            convlower.reset_report()
            selection.clear_memory()
            try:
                row.update(build())
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                row["traceback"] = traceback.format_exc()[-4000:]
                self.results["failures"].append(f"{section} {case} {dtype} {mode}: {row['error']}")
            finally:
                row["wall_s"] = round(time.perf_counter() - t0, 2)
                torch._dynamo.reset()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            for name, v in row.get("variants", {}).items():
                where = f"{section} {case} {dtype} {mode} [{name}]"
                if v.get("error"):
                    self.results["failures"].append(f"{where}: {v['error']}")
                elif v.get("rejected"):
                    self.results["notes"].append(f"{where}: timing rejected: {v['rejected']}")
            self.log("  " + summary_line(row))
        self.results["perf"]["rows"].append(row)
        self.write()

    # -- timing a set of variants
    def compare(self, fns: dict, first: dict | None = None) -> dict:
        """Run each variant once (its compile: seconds and convlower's report are kept), then
        time all of them interleaved.  ``first`` collects extra info per variant after its
        first call (a callable taking the report)."""
        variants = {}
        for name, fn in fns.items():
            convlower.reset_report()
            info = {}
            t0 = time.perf_counter()
            try:
                fn()
                sync(self.device)
                info["first_call_s"] = round(time.perf_counter() - t0, 3)
                rep = convlower.report()
                convs = [c for c in rep.convolutions]
                if convs:
                    info["chose"] = dict(collections.Counter(
                        f"{c.phase}:{c.rule or 'original'}" for c in convs))
                    info["decided_by"] = dict(collections.Counter(c.how or "?" for c in convs))
                    failed = [c.reason for c in convs if "failed" in (c.reason or "")]
                    if failed:
                        info["decision_problems"] = sorted(set(r[:300] for r in failed))
                        self.results["notes"].extend(f"[{name}] {r}" for r in info["decision_problems"])
                if rep.snake:
                    info["snake_routes"] = dict(collections.Counter(s.route for s in rep.snake))
                if first and name in first:
                    info.update(first[name](rep))
            except Exception as e:
                info["error"] = f"{type(e).__name__}: {e}"[:1000]
            variants[name] = info
        live = {k: f for k, f in fns.items() if "error" not in variants[k]}
        timings = time_interleaved(live, clock=self.clock, rounds=self.plan["rounds"],
                                   warmup=self.plan["warmup"],
                                   min_sample_s=self.plan["min_sample_s"])
        for name, t in timings.items():
            variants[name].update(t.to_dict())
        return variants


def summary_line(row: dict) -> str:
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    if row.get("error"):
        return f"error: {row['error'][:200]}"
    return ", ".join(f"{k} {fmt_ms(v)}" for k, v in row.get("variants", {}).items())


def fmt_ms(v: dict) -> str:
    if v.get("error"):
        return "error"
    if v.get("rejected"):
        return "rejected"
    s = v.get("median_s")
    return "-" if s is None else f"{s * 1e3:.3g} ms"


def _rel_err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


# ------------------------------------------------------------------------------ 1. tests
def start_tests(check: Check) -> dict:
    """Start the gpu subset in a child pytest (its own session, so a timeout kills the whole
    tree); its warm-up test also leaves the cold/warm compile figures."""
    res_dir = tempfile.mkdtemp(prefix="device-check-tests-")
    junit = os.path.join(check.out, "gpu_tests.xml")
    with contextlib.suppress(FileNotFoundError):
        os.remove(junit)
    env = dict(os.environ, CONVLOWER_TEST_DEVICE=str(check.device),
               CONVLOWER_TEST_QUICK="1" if check.args.quick else "0",
               CONVLOWER_DEVICE_CHECK_RESULTS=res_dir,
               CONVLOWER_TEST_ZOO_MODEL=check.args.zoo_model or check.plan["zoo_model"],
               CONVLOWER_TEST_ZOO_SIZE=check.plan["zoo_size"])
    timeout = max(30.0, min(check.plan["tests_timeout_s"], check.remaining() - 30.0))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider",
           "-p", "no:logging", os.path.join("tests", "test_gpu.py"), f"--junitxml={junit}"]
    check.log(f"tests: {' '.join(cmd[2:])} (timeout {timeout:.0f} s)")
    log = open(os.path.join(res_dir, "pytest.log"), "w+", encoding="utf-8")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return {"proc": proc, "log": log, "res_dir": res_dir, "junit": junit, "cmd": cmd,
            "t0": time.perf_counter(), "deadline": time.perf_counter() + timeout,
            "timeout": timeout}


def finish_tests(check: Check, run: dict) -> None:
    proc = run["proc"]
    tests = {"command": " ".join(run["cmd"][2:]), "device": str(check.device),
             "run_on_cpu_by_request": check.device.type == "cpu"}
    try:
        tests["returncode"] = proc.wait(timeout=max(1.0, run["deadline"] - time.perf_counter()))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)  # the child pytest we started, and its workers
        proc.wait()
        tests["returncode"] = None
        tests["timed_out_after_s"] = round(run["timeout"])
    tests["wall_s"] = round(time.perf_counter() - run["t0"], 2)
    run["log"].seek(0)
    tests["output_tail"] = run["log"].read()[-4000:]
    run["log"].close()
    tests.update(parse_junit(run["junit"]))
    counts = tests.get("counts", {})
    if tests.get("timed_out_after_s"):
        tests["status"] = "timed out"
    elif counts.get("failed") or counts.get("error") or tests["returncode"] != 0:
        tests["status"] = "failed"
    elif not counts.get("passed"):
        tests["status"] = "nothing passed"  # all skipped: not a result
    else:
        tests["status"] = "passed"
    if tests["status"] != "passed":
        bad = [f"{t['name']}: {t['outcome']}: {t.get('message', '')[:300]}"
               for t in tests.get("tests", []) if t["outcome"] in ("failed", "error")]
        check.results["failures"].append(f"gpu tests {tests['status']}" + (
            ": " + "; ".join(bad) if bad else ""))
    check.results["tests"] = tests
    check.results["compile"] = read_compile_figures(run["res_dir"])
    shutil.rmtree(run["res_dir"], ignore_errors=True)
    check.log(f"tests: {tests['status']} {counts} in {tests['wall_s']:.0f} s")
    check.write()


def parse_junit(path: str) -> dict:
    if not os.path.exists(path):
        return {"counts": {}, "tests": []}
    tests, counts = [], collections.Counter()
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or el.text or "")[:1000]
                break
        counts[outcome] += 1
        tests.append({"name": case.get("name"), "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0), 2), "message": message})
    return {"counts": dict(counts), "tests": tests}


def read_compile_figures(res_dir: str) -> dict:
    path = os.path.join(res_dir, "warmup.json")
    if not os.path.exists(path):
        return {"status": "not run (the warm-up test did not run or did not finish)"}
    with open(path, encoding="utf-8") as f:
        fig = json.load(f)
    fig["status"] = "ok" if fig.get("cold", {}).get("ok") and fig.get("warm", {}).get("ok") \
        else "incomplete"
    return fig


# ------------------------------------------------------------------------------ 2. perf rows
def patch_embed_rows(check: Check) -> None:
    n = check.plan["patches"]
    for dtype_name, backward in check.plan["patch_cases"]:
        check.row("patch_embed", f"Qwen2.5-VL patch embed, {n} patches", dtype_name,
                  "fwd+bwd" if backward else "fwd",
                  lambda d=dtype_name, b=backward: patch_embed(check, n, DTYPES[d], b))


def patch_embed(check: Check, n: int, dtype, backward: bool) -> dict:
    """Conv3d 3 -> 1280, kernel = stride = (2, 14, 14) on [n, 3, 2, 14, 14] (bench_patch_embed)."""
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
            "convlower": torch.compile(conv, backend="convlower")}

    def step(f):
        if backward:
            return lambda: torch.autograd.grad(f(x), (x, w), gy)

        def fwd():
            with torch.no_grad():
                return f(x)
        return fwd

    fns = {k: step(f) for k, f in mods.items()}
    if backward:
        fns["bare mm"] = lambda: (flat_x @ flat_w, gy2 @ flat_w.t(), gy2.t() @ flat_x)
    else:
        fns["bare mm"] = lambda: flat_x @ flat_w
    variants = check.compare(fns)
    with torch.no_grad():
        err = _rel_err(mods["convlower"](x), conv(x))
    return {"variants": variants, "primary": "convlower", "floor": "bare mm",
            "max_rel_err_convlower": err}


def conv3d_shapes(check: Check) -> dict:
    from bench_conv3d import SHAPES  # noqa: E402  (bench/ is on sys.path)

    names = check.plan["conv3d_shapes"] or list(SHAPES)
    shapes = {k: SHAPES[k] for k in names}
    if check.args.quick:
        shapes = {k: shrink(*v) for k, v in shapes.items()}
    return shapes


def shrink(shape, out_ch, k, s, p):
    """A tiny version of a bench_conv3d shape with the same kernel, stride and padding."""
    n, c, *dims = shape
    dims = [min(d, 4 * kk) for d, kk in zip(dims, k)]
    return [1, max(4, c // 16)] + dims, max(4, out_ch // 16), k, s, p


def conv3d_rows(check: Check) -> None:
    dtype_name = check.plan["conv3d_dtype"]
    for name, spec in conv3d_shapes(check).items():
        shape = "x".join(map(str, spec[0]))
        check.row("conv3d", f"{name} {shape} -> {spec[1]} k{''.join(map(str, spec[2]))}",
                  dtype_name, "fwd", lambda spec=spec: conv3d(check, spec, DTYPES[dtype_name]))


def conv3d(check: Check, spec, dtype) -> dict:
    """bench_conv3d's row: eager, Inductor, each eligible rule, convlower, select=measure."""
    from convlower.lowerings import RULES
    from convlower.lowerings.proof import check as prove
    from convlower.lowerings.rule import ConvCall

    shape, out_ch, k, s, p = spec
    torch.manual_seed(0)
    conv = nn.Conv3d(shape[1], out_ch, k, s, p).to(check.device, dtype).eval()
    x = torch.randn(shape, device=check.device, dtype=dtype)
    call = ConvCall.from_args([x, conv.weight, conv.bias, s, p, (1, 1, 1), False, (0, 0, 0), 1])
    rules = [r for r in RULES if prove(RULES[r], call).eligible]
    if check.plan["conv3d_max_rules"] is not None:
        rules = rules[:check.plan["conv3d_max_rules"]]
    mods = {"eager": conv, "inductor": torch.compile(conv, backend="inductor")}
    for r in rules:
        mods[r] = torch.compile(conv, backend="convlower", options={"rules": [r], "select": "always"})
    mods["convlower"] = torch.compile(conv, backend="convlower")
    mods["measure"] = torch.compile(conv, backend="convlower", options={"select": "measure"})

    variants = check.compare({k: _inference(f, x) for k, f in mods.items()})
    with torch.no_grad():
        ref = conv(x)
        errs = {k: _rel_err(mods[k](x), ref) for k in mods if k != "eager"
                and not variants[k].get("error")}
    return {"variants": variants, "primary": "convlower", "eligible_rules": rules,
            "max_rel_err": errs}



def _inference(f, *args):
    """``f(*args)`` without autograd, as a zero-argument call to time."""
    def run():
        with torch.no_grad():
            return f(*args)
    return run

def wan_vae_rows(check: Check) -> None:
    cfg = WAN["quick" if check.args.quick else "full"]
    latent = "x".join(map(str, cfg["latent"]))
    check.row("wan_vae", f"Wan VAE decode, latent {latent}", "bf16", "fwd",
              lambda: wan_vae(check, dict(cfg)))


def wan_vae(check: Check, cfg: dict) -> dict:
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


def snake_rows(check: Check) -> None:
    frames = check.plan["snake_frames"]
    what = "tiny Oobleck decoder" if check.args.quick else "Oobleck decoder (78M)"
    check.row("snake", f"{what}, {frames} latent frames", "bf16", "fwd",
              lambda: snake(check, frames))


def snake(check: Check, frames: int) -> dict:
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


@contextlib.contextmanager
def warnings_off():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ------------------------------------------------------------------------------ markdown
def markdown(r: dict) -> str:
    env = r["environment"]
    lines = [f"# convlower device check: {env['device_name']}", ""]
    lines.append(f"torch {env['torch']} (cuda {env.get('cuda')}, hip {env.get('hip')}, "
                 f"triton {env.get('triton', '-')}), convlower {env['convlower']}, platform "
                 f"{env['platform']}, {env['date']}{'; QUICK MODE: tiny sizes, figures mean nothing' if r['quick'] else ''}.")
    t = r["timing"]
    lines.append(f"Timing: {t['clock']}, {t['warmup_calls']} warm-up calls, samples of >= "
                 f"{t['min_sample_s'] * 1e3:g} ms, median of {t['rounds']} interleaved rounds; "
                 f"timings <= 0 rejected.  Run took {r.get('wall_s') or 0:.0f} s.")
    lines += ["", "## gpu tests", ""]
    tests = r.get("tests", {})
    counts = tests.get("counts", {})
    where = " (on the CPU, by request: not a GPU result)" if tests.get("run_on_cpu_by_request") else ""
    lines.append(f"{tests.get('status', 'not run')}: " + ", ".join(
        f"{v} {k}" for k, v in sorted(counts.items())) + where)
    for case in tests.get("tests", []):
        if case["outcome"] not in ("passed",):
            lines.append(f"- {case['name']}: {case['outcome']}: "
                         f"{_one_line(case.get('message', ''), 300)}")
    lines += ["", "## Performance (ms per call, median)", "",
              "| case | dtype | pass | eager | Inductor | convlower | others | Inductor / "
              "convlower | eager / convlower | convlower chose |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["perf"]["rows"]:
        lines.append(table_row(row))
    lines += ["", "Ratios > 1: convlower faster.  Snake rows: convlower = the fused route, "
              "others = the eager-safe op (what HIP + bf16 gets).", ""]
    comp = r.get("compile", {})
    lines += ["## Compile (convlower.warmup, two processes, one cache directory)", ""]
    if comp.get("cold"):
        lines += [f"zoo model {comp.get('model')} ({comp.get('size')}): {comp.get('status')}", "",
                  "| process | cache | compile s | first step s | process wall s |",
                  "|---|---|---|---|---|"]
        for k in ("cold", "warm"):
            c = comp.get(k) or {}
            lines.append(f"| {k} | {c.get('cache', '-')} | {_num(c.get('compile_s'))} | "
                         f"{_num(c.get('first_step_s'))} | {_num(c.get('process_wall_s'))} |")
    else:
        lines.append(comp.get("status", "not run"))
    if r["failures"]:
        lines += ["", "## Failures", ""] + [f"- {_one_line(f)}" for f in r["failures"]]
    if r["notes"]:
        lines += ["", "## Notes", ""] + [f"- {_one_line(n)}" for n in r["notes"]]
    return "\n".join(lines) + "\n"


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _num(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def table_row(row: dict) -> str:
    head = f"| {row['case']} | {row['dtype']} | {row['pass']} |"
    if row.get("skipped"):
        return head + f" skipped: {row['skipped']} | | | | | | |"
    if row.get("error"):
        return head + f" error: {row['error'][:120].replace('|', '/')} | | | | | | |"
    v = row["variants"]
    primary = row.get("primary", "convlower")
    others = [k for k in v if k not in ("eager", "inductor", primary)]
    ms = lambda k: fmt_ms(v[k]).replace(" ms", "") if k in v else "-"

    def ratio(a, b):
        ta, tb = v.get(a, {}).get("median_s"), v.get(b, {}).get("median_s")
        return f"{ta / tb:.2f}" if ta and tb else "-"

    other = ", ".join(f"{k} {ms(k)}" for k in others)
    extra = row.get("floor") or row.get("compare_to")
    if extra in v:
        other += f" ({primary}/{extra} {ratio(primary, extra)})"
    p = v.get(primary, {})
    chose_s = ", ".join(f"{k} x{n}" for k, n in sorted((p.get("chose") or {}).items()))
    if p.get("snake_routes"):
        chose_s = ", ".join(f"Snake {k} x{n}" for k, n in sorted(p["snake_routes"].items())) + (
            f"; convs {chose_s}" if chose_s else "")
    chose_s = chose_s or "-"
    return (f"{head} {ms('eager')} | {ms('inductor')} | {ms(primary)} | {other} | "
            f"{ratio('inductor', primary)} | {ratio('eager', primary)} | {chose_s} |")


# ------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--device", default="auto",
                    help="cuda, cuda:N, cpu, or auto (a GPU if there is one, else cpu)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, reduced grid (CPU CI)")
    ap.add_argument("--out", default="device-check-out", help="folder for the JSON + markdown")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip perf rows once this many seconds have passed (full: 450)")
    ap.add_argument("--zoo-model", default=None, help="zoo model for cold/warm compile times")
    ap.add_argument("--serial", action="store_true",
                    help="with --quick: run the gpu tests before the perf rows, not alongside")
    ap.add_argument("--clock", default="auto", choices=["auto", "events", "wall"])
    ap.add_argument("--inductor-cache", default=None,
                    help="Inductor cache dir: 'fresh' (a new temp dir, cold compiles: the "
                         "default on a GPU), 'default' (torch's; the default with --quick), "
                         "or a path")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {bad}; valid: {', '.join(SECTIONS)}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False")
    plan = dict(PLANS["quick" if args.quick else "full"])

    cache = args.inductor_cache or ("default" if args.quick else "fresh")
    if cache == "fresh":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="device-check-inductor-")
    elif cache != "default":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache)
    # Every graph really compiles, so convlower's pass runs and reports what it chose (a graph
    # served from the FX graph cache runs no pass); compiled kernels are still reused.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.config.recompile_limit = 64  # one entry per variant on one module
    torch._dynamo.config.automatic_dynamic_shapes = False  # every shape compiled static
    decisions = tempfile.mkdtemp(prefix="device-check-decisions-")
    selection.set_cache_dir(decisions)  # cold: selection really decides
    if HERE not in sys.path:
        sys.path.insert(0, HERE)

    check = Check(args, plan)
    check.results["environment"]["inductor_cache"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR",
                                                                   "torch default")
    check.results["sections"] = sections
    check.log(f"device {check.results['environment']['device_name']}, "
              f"{'quick' if args.quick else 'full'} plan, out {args.out}")
    check.write()
    # With --quick the child pytest runs alongside the perf rows (their figures mean nothing
    # there, and it halves the wall time); on a GPU they run one after the other.
    overlap = args.quick and not args.serial
    check.results["tests_alongside_perf"] = overlap
    tests = start_tests(check) if "tests" in sections else None
    if tests is not None and not overlap:
        finish_tests(check, tests)
        tests = None
    runners = {"patch_embed": patch_embed_rows, "snake": snake_rows, "conv3d": conv3d_rows,
               "wan_vae": wan_vae_rows}
    for name in SECTIONS:
        if name not in sections or name not in runners:
            continue
        try:
            runners[name](check)
        except Exception as e:  # a broken section is reported; the next one still runs
            check.results["failures"].append(f"section {name}: {type(e).__name__}: {e}")
            check.results.setdefault("tracebacks", {})[name] = traceback.format_exc()[-4000:]
            check.write()
    if tests is not None:
        finish_tests(check, tests)
    check.write()
    shutil.rmtree(decisions, ignore_errors=True)
    with open(os.path.join(args.out, "device_check.md"), encoding="utf-8") as f:
        print(f.read())
    return 1 if check.results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
