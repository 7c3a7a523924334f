"""Regions against whole-graph compiles: cold compile, warm load, step, break-even calls.

For each model, each plan compiles in a fresh process with an empty Inductor cache (cold; the
machine's once-only ISA probe pre-made, see fresh_process.py), then
again in a second fresh process on that cache (warm load); a last process compiles every plan
on its warm cache and times their steps interleaved with eager (ratios; this machine is shared).
Each sample is one untimed call and then consecutive calls of one plan (~0.2 s), as a generate
loop calls its UNet: the untimed call absorbs the traffic of whatever ran before.  The plans
take turns in an order rotated each round, so no plan always samples first or last.  The
script also checks each plan's output against eager (fp32, relative to the output's largest
value).

Plans: ``inductor`` (whole graph), ``convlower`` (whole graph), ``regions`` (convlower,
``regions="auto"``), ``blocks`` (the model's own ``compile_repeated_blocks()``, diffusers,
where it has one); on request ``regions=A+B`` (regions of block classes A and B only) and
``regions-wrapped`` (``regions`` with ``part_calls="wrapped"``:
every part call through AOTAutograd's and Inductor's wrappers, docs/regions.md).  Compile
seconds are ``torch.compile()`` plus the first call, minus one step.
Break-even calls: compile seconds / (eager step - plan step).

    .venv/bin/python bench/bench_regions.py     # sdxl-unet, wan-vae, wan-vae-clip, wan-dit-stack
    .venv/bin/python bench/bench_regions.py --models sdxl-unet --size tiny --train
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
PLANS = ("inductor", "convlower", "regions", "blocks")   # the default set
MORE_PLANS = ("regions-wrapped",)


SETUP = {"device": "cpu", "dtype": "float32"}


def _build(name: str, size: str):
    import torch
    from convlower.tools import zoo

    model, inputs = zoo.build(name, size)
    dtype = getattr(torch, SETUP["dtype"])
    model = model.to(SETUP["device"], dtype)
    return model, tuple(t.to(SETUP["device"], dtype if t.is_floating_point() else t.dtype)
                        for t in inputs)


def _sync():
    import torch

    if SETUP["device"].startswith("cuda"):
        torch.cuda.synchronize()


def _own_blocks(model):
    """The diffusers module of ``model`` that has ``compile_repeated_blocks``, or None."""
    for m in model.modules():
        if hasattr(m, "compile_repeated_blocks") and getattr(m, "_repeated_blocks", None):
            return m
    return None


def _plan(model, plan: str):
    import torch

    if plan == "inductor":
        return torch.compile(model, backend="inductor")
    if plan in ("convlower", "regions", "regions-wrapped") or plan.startswith("regions="):
        import convlower  # the backend by object: works without the entry point installed

        regions = ("off" if plan == "convlower" else tuple(plan[8:].split("+"))
                   if plan.startswith("regions=") else "auto")
        return torch.compile(model, backend=convlower.convlower_backend,
                             options={"regions": regions,
                                      "part_calls": "wrapped" if plan == "regions-wrapped"
                                      else "direct"})
    inner = _own_blocks(model)
    inner.compile_repeated_blocks(backend="inductor")  # in place: the model's blocks compiled
    return model


def _run(fn, inputs, train: bool):
    import torch

    if not train:
        with torch.no_grad():
            return fn(*inputs)
    out = fn(*inputs)
    out.float().square().mean().backward()
    return out


def _steady(fn, inputs, train, n=3) -> float:
    ts = []
    for _ in range(n):
        _sync()
        t0 = time.perf_counter()
        _run(fn, inputs, train)
        _sync()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def _steady_mean(fn, inputs, train, calls: int) -> float:
    _sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        _run(fn, inputs, train)
    _sync()
    return (time.perf_counter() - t0) / calls


def child_compile(name, size, plan, train) -> dict:
    """One fresh process: the plan's compile seconds on whatever cache the env points at."""
    import torch

    model, inputs = _build(name, size)
    model.train(train)
    t0 = time.perf_counter()
    fn = _plan(model, plan)
    _run(fn, inputs, train)
    _sync()
    first = time.perf_counter() - t0
    step = _steady(fn, inputs, train, 2)
    out = {"compile_s": max(first - step, 0.0)}
    if plan.startswith("regions"):
        import convlower

        regs = convlower.report().to_dict()["regions"]
        out["whole"] = sum(r["whole"] for r in regs)
        out["parts"] = len(regs) - out["whole"]
        out["compiled"] = sum(r["how"] == "compiled" for r in regs)
        out["reused"] = sum(r["how"] == "reused" for r in regs)
    return out


def child_steps(name, size, plans, train, rounds) -> dict:
    """Every plan (warm caches), steps interleaved with eager, and each output's error."""
    import copy

    import torch

    model, inputs = _build(name, size)
    model.train(train)
    eager_model = copy.deepcopy(model)
    with torch.no_grad():
        ref = eager_model(*inputs).float()
    fns = {"eager": eager_model}
    errs = {}
    for plan in plans:
        m = copy.deepcopy(model)
        fns[plan] = _plan(m, plan)
        with torch.no_grad():
            out = fns[plan](*inputs).float()
        errs[plan] = float((out - ref).abs().max() / ref.abs().max())
    times = {k: [] for k in fns}
    # each sample ~0.2 s of calls: single steps of ~10 ms spread 10-20% on this shared machine
    calls = max(2, round(0.2 / _steady(fns["eager"], inputs, train, 1)))
    names = list(fns)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            _run(fns[k], inputs, train)   # untimed: the caches hold this plan's code and data
            times[k].append(_steady_mean(fns[k], inputs, train, calls))
    # per round, each plan against Inductor's sample of the same round: a drift of the machine
    # between rounds reaches both sides of a ratio alike
    ratios = {k: [t / i for t, i in zip(v, times["inductor"])] for k, v in times.items()
              if "inductor" in times}
    return {"step_s": {k: statistics.median(v) for k, v in times.items()}, "err": errs,
            "step_ratios": ratios}


def _child(args: list[str], cache: str) -> dict:
    env = {"TORCHINDUCTOR_CACHE_DIR": cache, "CONVLOWER_CACHE_DIR": cache + "-convlower"}
    return run_worker([sys.executable, HERE, "--child", json.dumps(args), "--setup", json.dumps(SETUP)],
                      env, SETUP.get("timeout"))


def measure(name, size, train, rounds) -> dict:
    model, _ = _build(name, size)
    plans = [p for p in SETUP.get("plans", PLANS) if p != "blocks" or _own_blocks(model) is not None]
    root = tempfile.mkdtemp(prefix="bench-regions-")
    res = {"plans": plans}
    for plan in plans:
        cache = new_cache(os.path.join(root, plan))
        print(f"[{name}] {plan}: cold compile ...", file=sys.stderr, flush=True)
        res[plan] = {"cold": _child(["compile", name, size, plan, train], cache)}
        print(f"[{name}] {plan}: warm load ...", file=sys.stderr, flush=True)
        res[plan]["warm"] = (_child(["compile", name, size, plan, train], cache)
                             if SETUP.get("warm", True) else {})
    print(f"[{name}] steps ...", file=sys.stderr, flush=True)
    res["steps"] = _child(["steps", name, size, plans, train, rounds], new_cache(os.path.join(root, "steps")))
    return res


def _regions_label(cold: dict) -> str:
    if cold.get("whole") and not cold.get("parts"):
        return " (whole: too little repeats)"  # regions.MIN_AUTO_SHARED
    return f" ({cold['compiled']} compiled / {cold['reused']} reused of {cold['parts']})"


def _median_quartiles(ratios: list):
    """``"median (q1-q3)"`` of per-round ratios, or None with fewer than four rounds."""
    if len(ratios) < 4:
        return None
    q1, med, q3 = statistics.quantiles(sorted(ratios), n=4)
    return f"{med:.3f} ({q1:.2f}-{q3:.2f})"


def _step_ratio(steps: dict, plan: str, fallback: float) -> str:
    """The median of the per-round step ratios to Inductor, with their quartiles."""
    return (_median_quartiles(steps.get("step_ratios", {}).get(plan, []))
            or f"{fallback:.3f}")


def table(name: str, res: dict) -> str:
    steps = res["steps"].get("step_s", {})
    eager, ind = steps.get("eager"), steps.get("inductor")
    ind_cold = res["inductor"]["cold"].get("compile_s")
    rows = [f"| {name} | eager | – | – | {eager * 1e3:.2f} | – | – | – | – |" if eager else ""]
    ind_cold = ind_cold or float("nan")
    ind = ind or float("nan")
    for plan in res["plans"]:
        cold = res[plan]["cold"].get("compile_s")
        warm = res[plan]["warm"].get("compile_s")
        step = steps.get(plan)
        err = res["steps"].get("err", {}).get(plan)
        if cold is None or step is None:
            why = res[plan]["cold"].get("error") or res["steps"].get("error")
            rows.append(f"| {name} | {plan} | error: {why} | | | | | | |")
            continue
        gain = eager - step if eager else 0.0
        breakeven = f"{cold / gain:.0f}" if gain > 0 else "never"
        extra = _regions_label(res[plan]["cold"]) if plan.startswith("regions") else ""
        warm = "–" if warm is None else f"{warm:.1f}"  # --no-warm
        rows.append(f"| {name} | {plan}{extra} | {cold:.1f} | {warm} | {step * 1e3:.1f} | "
                    f"{cold / ind_cold:.2f} | {_step_ratio(res['steps'], plan, step / ind)} | "
                    f"{breakeven} | {err:.1e} |")
    return "\n".join(r for r in rows if r)


def _against_whole(name: str, steps: dict) -> str:
    """Regions against convlower's whole graph, per round: the cost of splitting (seams, lost
    fusion across blocks, calling each part); on a model where no conv is rewritten the whole
    graph runs Inductor's own code."""
    ratios = steps.get("step_ratios", {})
    whole = ratios.get("convlower")
    out = []
    for plan in (p for p in ratios if p.startswith("regions")):
        figure = _median_quartiles([a / b for a, b in zip(ratios[plan], whole or [])])
        if figure:
            out.append(f"{plan} {figure}")
    return f"{name}: step / convlower whole-graph (per-round median, quartiles): " \
        f"{'; '.join(out)}" if out else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="sdxl-unet,wan-vae,wan-vae-clip,wan-dit-stack")
    ap.add_argument("--size", default="small", choices=("tiny", "small"))
    ap.add_argument("--train", action="store_true", help="forward+backward instead of forward")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", help="write the raw figures here")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--plans", default=",".join(PLANS),
                    help="a subset of " + ",".join(PLANS + MORE_PLANS) + ", or regions=A+B "
                         "(regions of those block classes only)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per child process")
    ap.add_argument("--no-warm", action="store_true", help="skip the warm-load processes")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--setup", help=argparse.SUPPRESS)
    a = ap.parse_args()
    unknown = {p for p in a.plans.split(",")
               if not p.startswith("regions=")} - set(PLANS + MORE_PLANS)
    if unknown:
        ap.error(f"unknown plans {sorted(unknown)}; valid: {', '.join(PLANS + MORE_PLANS)}")
    SETUP.update(json.loads(a.setup) if a.setup else dict(
        device=a.device, dtype=a.dtype, plans=a.plans.split(","), timeout=a.timeout,
        warm=not a.no_warm))
    if a.child:
        kind, *rest = json.loads(a.child)
        fn = child_compile if kind == "compile" else child_steps
        args = rest   # the parent's --rounds travels inside the child's arguments
        print(json.dumps(fn(*args)))
        return
    print("| model | plan | cold compile s | warm load s | step ms | cold / Inductor | "
          "step / Inductor (per-round median, quartiles) | break-even calls | max err vs eager |")
    print("|---|---|---|---|---|---|---|---|---|")
    raw = {}
    for name in a.models.split(","):
        raw[name] = measure(name, a.size, a.train, a.rounds)
        print(table(name, raw[name]), flush=True)
    for name, res in raw.items():
        line = _against_whole(name, res["steps"])
        if line:
            print(line)
    print(machine_line())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
