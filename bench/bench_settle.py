"""Close calls settled by the warm-up, against what exhaustive measurement picks (issue 22).

For each model (zoo, fp32 and bf16, forward; ``--train`` adds forward+backward rows) one fresh
process with empty caches:

1. Inductor compiles the model (its cold compile);
2. ``convlower.warmup`` compiles it with the default ``select="auto"`` and settles the close
   calls (compiled measurement, stored, recompiled): the warm-up's first compile, its extra
   measuring seconds and its recompile are printed;
3. with an empty decision cache of its own, ``select="exhaustive"`` compiles it (every eligible
   conv measured compiled): the reference choice; then once more with another empty cache
   (how often the measurement picks the same rule twice: the ceiling of any screen's
   agreement); ``select="always"`` too where asked;
4. steps of eager, Inductor, the warm-up's model, exhaustive's (and always's) interleaved.

Printed per row: warm-up step / exhaustive step (goal <= 1.03), / always (the ViT patch
embedding: <= 1.03), / Inductor, the close calls and the screen's clear wins (measured /
changed), the seconds settling and
recompiling cost, how many of exhaustive's convs the warm-up's model runs the same choice on
(all: the two run the same code, and their step ratio is the machine's noise), and the
screen's agreement with the
compiled measurement: per conv, the screen's pick (a clear call's rule, a close call's lean:
the rule when its eager figure beat the original's) against exhaustive's pick (goal >= 90%);
also the share where the screen's pick, by exhaustive's own compiled figures, is within the
measurement's 5% margin of exhaustive's pick (equal forms tie: patchify_mm and time_fold_conv2d
on a (1,2,2) patch conv).
With ``--write-seeds`` the measured decisions (the warm-up's settled ones, and exhaustive's
over them) go to the shipped seed table.  Cold compile
seconds are not compared here (the process compiles the model several times and shares
kernels between compiles): ``bench/bench_compile_cost.py`` measures them in fresh processes.

    .venv/bin/python bench/bench_settle.py                          # default models
    .venv/bin/python bench/bench_settle.py --models vit-patch-embed --train --always
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
DEFAULT_MODELS = ("vit-patch-embed", "qwen2.5-vl-patch-embed", "mochi-downsample",
                  "wan-dit-patch", "sdxl-unet-tiny", "wan-vae")


def _step(fn, inputs, train, params):
    import torch

    if not train:
        with torch.no_grad():
            return fn(*inputs)
    for p in params:
        p.grad = None
    fn(*inputs).float().sum().backward()


def _first(fn, inputs, train, params) -> float:
    start = time.perf_counter()
    _step(fn, inputs, train, params)
    return time.perf_counter() - start


def _picks(records, how) -> dict:
    """{(phase, call, mask): pick} of the convolution records decided by ``how``; a screen's
    pick is its clear choice, or a close call's lean (the fastest eager figure)."""
    out = {}
    for c in records:
        if c.how not in how or c.from_cache or _site(c) in out:
            continue  # the first decision of a site (the warm-up's recompile comes later)
        if c.how == "cache" and not c.reason.startswith(("screen:", "seed:")):
            continue
        pick = c.rule if c.how == "measurement" or c.rule else _lean(c.timings)
        out[_site(c)] = pick
    return out


def _measured(records) -> dict:
    """{site: pick} of the measured convolution records (a conv measure found too small to
    compile candidates for has no compiled figure)."""
    return _picks([c for c in records if "aten" in c.timings], ("measurement",))


def _choices(records) -> dict:
    """{site: rule label} of the code that runs: a later record of a site (the warm-up's
    recompile after settling) replaces an earlier one."""
    from convlower.selection.decision import label

    return {_site(c): label(c.rule, c.opaque) for c in records}


def _same_choices(warm_recs, ex_recs) -> str:
    """How many of exhaustive's sites the warm-up model runs the same choice on: where all do,
    the two compiled models run the same code and their step ratio is the machine's noise."""
    warm, ex = _choices(warm_recs), _choices(ex_recs)
    return f"{sum(warm.get(k) == v for k, v in ex.items())}/{len(ex)}"


def _site(c) -> tuple:
    return (c.phase, json.dumps(c.call, sort_keys=True), str(c.output_mask), c.input_produced,
            c.output_consumed)


def _ratios(t: dict) -> str:
    base = t.get("aten")
    return ", ".join(f"{k} {v / base:.2f}" for k, v in sorted(t.items())
                     if base and k != "aten" and not k.startswith("screen_")) or "-"


def _lean(t: dict):
    """The screen's prediction on a call it kept: the lowering it predicts fastest compiled
    (``screen.predicted``) if that beats the original by the measurement's margin (5%: less is
    a win no measurement takes), else eager_conv if it beat the original in Inductor's layout
    by that margin, else None."""
    from convlower.selection import measure, screen

    keep = 1.0 - measure.MARGIN
    names = [k for k in t if not k.startswith("aten") and k != "eager_conv"
             and not k.endswith(screen.KERNELS)]
    best = min(names, key=lambda n: screen.predicted(t, n), default=None)
    if best is not None and "aten" in t and screen.predicted(t, best) <= keep * t["aten"]:
        return best.removesuffix(":opaque")  # a seed's figures name both forms: the rule
    ind = t.get(screen.INDUCTOR_LAYOUT)
    return "eager_conv" if ind and t.get("eager_conv", ind) <= keep * ind else None


def _equivalent(pick, chosen, timings: dict) -> bool:
    """The screen's pick is as good as exhaustive's: the same, or by exhaustive's own compiled
    figures within the measurement's margin (5%) of exhaustive's pick (ties of equal forms)."""
    from convlower.selection import measure

    if pick == chosen:
        return True
    mine, best = _fastest_form(timings, pick), _fastest_form(timings, chosen)
    return mine is not None and best is not None and mine <= (1 + measure.MARGIN) * best


def _fastest_form(timings: dict, rule):
    """A rule's compiled figure in its faster form (traced or opaque); the original's."""
    times = [timings[k] for k in (rule or "aten", f"{rule}:opaque") if k in timings]
    return min(times, default=None)


def _interleaved(fns: dict, inputs, train, params, rounds=9, sample_s=0.05) -> dict:
    """Median seconds per step of each plan: rounds alternate the order, and each sample
    repeats the step for about ``sample_s`` (single millisecond steps spread 10% here)."""
    reps = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        _step(fn, inputs, train, params)
        reps[name] = max(1, round(sample_s / max(time.perf_counter() - start, 1e-6)))
    times = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 else names[::-1]):
            start = time.perf_counter()
            for _ in range(reps[name]):
                _step(fns[name], inputs, train, params)
            times[name].append((time.perf_counter() - start) / reps[name])
    return {k: statistics.median(v) for k, v in times.items()}


def worker(args) -> dict:
    import torch

    import convlower
    from convlower import selection
    from convlower.tools import zoo

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model, inputs = zoo.build(args.model, args.size)
    model = model.to(dtype)
    inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(args.train)
    fns = {"eager": model}
    fns["inductor"] = torch.compile(model, backend="inductor")
    inductor_s = _first(fns["inductor"], inputs, args.train, params)
    convlower.reset_report()
    ctx = torch.enable_grad() if args.train else torch.no_grad()
    with ctx:
        fns["warm-up"], r = convlower.warmup(model, inputs, backward=args.train, iters=3,
                                             settle_budget_s=args.settle_budget)
    warm_recs = list(convlower.report().convolutions)
    se = r.settling
    selection.set_cache_dir(tempfile.mkdtemp(prefix="bench-settle-exhaustive-"))
    selection.clear_memory()
    convlower.reset_report()
    fns["exhaustive"] = torch.compile(model, backend="convlower", options={"select": "exhaustive"})
    exhaustive_s = _first(fns["exhaustive"], inputs, args.train, params)
    ex_recs = list(convlower.report().convolutions)
    measured = _measured(ex_recs)
    exhaustive_dir = selection.cache_dir()
    # the measurement's own repeatability: exhaustive once more, with an empty decision cache
    # again; under options that differ in what does not change a measurement (the fallback on
    # a failed compile), since Dynamo would serve its compile for the same options (to this
    # model or a copy) without running the pass, hence without measuring
    selection.set_cache_dir(tempfile.mkdtemp(prefix="bench-settle-again-"))
    selection.clear_memory()
    convlower.reset_report()
    _first(torch.compile(model, backend="convlower",
                         options={"select": "exhaustive", "fallback": "inductor"}),
           inputs, args.train, params)
    again = _measured(convlower.report().convolutions)
    if set(again) != set(measured):
        raise RuntimeError(f"the second exhaustive measurement decided {len(again)} convs, "
                           f"the first {len(measured)}: the repeat figure would be wrong")
    shutil.rmtree(selection.cache_dir(), ignore_errors=True)
    selection.set_cache_dir(exhaustive_dir)
    if args.always:
        fns["always"] = torch.compile(model, backend="convlower", options={"select": "always"})
        _step(fns["always"], inputs, args.train, params)
    med = _interleaved(fns, inputs, args.train, params)
    screen = _picks(warm_recs, ("screen", "cache"))
    both = [k for k in screen if k in measured]
    screens, ex_t = {}, {}
    for c in warm_recs:  # the first compile's figures (the recompile after settling follows)
        screens.setdefault(_site(c), c.timings)
    for c in ex_recs:
        ex_t.setdefault(_site(c), c.timings)
    disagree = [f"{k[0]} {json.loads(k[1]).get('input')} w{json.loads(k[1]).get('weight')}: screen {_ratios(screens[k])} -> "
                f"{screen[k]}, compiled {_ratios(ex_t[k])} -> {measured[k]}"
                for k in both if screen[k] != measured[k]]
    return {"inductor_s": inductor_s, "warmup_compile_s": r.compile_s,
            "exhaustive_s": exhaustive_s, "steps": med,
            "close": sum(not s.clear_win for s in se.settled),
            "clear_wins": sum(s.clear_win for s in se.settled),
            "changed": [f"{s.conv}: {s.rule}" for s in se.changed], "left_open": se.left_open,
            "settle_s": se.seconds, "recompile_s": se.recompile_s,
            "agree": sum(screen[k] == measured[k] for k in both), "compared": len(both),
            "repeat": sum(again.get(k) == v for k, v in measured.items()),
            "repeat_of": len(measured),
            "equivalent": sum(_equivalent(screen[k], measured[k], ex_t[k]) for k in both),
            "disagree": disagree,
            "exhaustive_rules": sorted({str(c.rule) for c in ex_recs}),
            "same_choices": _same_choices(warm_recs, ex_recs),
            "decisions": selection.cache_dir()}


def run_fresh(model, dtype, size, train, always, budget, timeout) -> dict:
    with tempfile.TemporaryDirectory() as inductor, tempfile.TemporaryDirectory() as decisions:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor, CONVLOWER_CACHE_DIR=decisions)
        cmd = [sys.executable, HERE, "--worker", "--models", model, "--dtypes", dtype,
               "--size", size, "--settle-budget", str(budget)] + \
            (["--train"] if train else []) + (["--always"] if always else [])
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s"}
        if p.returncode != 0:
            return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
        out = json.loads(p.stdout.strip().splitlines()[-1])
        # the warm-up's settled decisions, then exhaustive's (every eligible conv, measured
        # here) over them: a clear call gets a seed too, and a settled entry copied from an
        # older seed (a deferred first compile) never outlives a new measurement
        out["entries"] = {}
        for folder in (decisions, out.get("decisions")):
            path = os.path.join(folder or "", "decisions.json")
            if folder and os.path.exists(path):
                with open(path) as f:
                    out["entries"].update(json.load(f)["decisions"])
        shutil.rmtree(out.get("decisions") or "", ignore_errors=True)  # exhaustive's, made above
        return out


def line(model, dtype, train, r) -> str:
    name = f"| {model} | {dtype} | {'fwd+bwd' if train else 'fwd'} |"
    if "error" in r:
        return f"{name} error: {r['error']} |"
    s = r["steps"]
    always = f"{s['warm-up'] / s['always']:.3f}" if "always" in s else "–"
    agree = f"{r['agree']}/{r['compared']}" if r["compared"] else "–"
    return (f"{name} {s['warm-up'] / s['exhaustive']:.3f} | {always} | "
            f"{s['warm-up'] / s['inductor']:.3f} | "
            f"{r['close']} + {r.get('clear_wins', 0)} / {len(r['changed'])} | {r['settle_s']:.1f} | {r['recompile_s']:.1f} | "
            f"{agree} | {r.get('same_choices', '–')} | {'; '.join(r['changed']) or '–'} |")


HEAD = ("| model | dtype | pass | warm-up step / exhaustive | / always | / Inductor | "
        "close calls + clear wins measured / changed | settling s | "
        "recompile s | screen agrees | warm-up runs exhaustive's choices | changed |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--size", default="small")
    ap.add_argument("--train", action="store_true", help="also forward+backward rows")
    ap.add_argument("--always", action="store_true", help="also time select='always'")
    ap.add_argument("--settle-budget", type=float, default=300.0)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--write-seeds", action="store_true",
                    help="add the measured decisions to convlower/selection/seeds.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.model, args.dtype = args.models, args.dtypes
        print(json.dumps(worker(args)))
        return
    print(HEAD, flush=True)
    agree = compared = equivalent = repeat = repeat_of = 0
    notes = []
    from convlower.selection import measure, seeds

    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            for train in ((False, True) if args.train else (False,)):
                r = run_fresh(model, dtype, args.size, train, args.always, args.settle_budget,
                              args.timeout)
                print(line(model, dtype, train, r), flush=True)
                notes += [f"{model} {dtype}: {d}" for d in r.get("disagree", [])]
                agree, compared = agree + r.get("agree", 0), compared + r.get("compared", 0)
                equivalent += r.get("equivalent", 0)
                repeat, repeat_of = repeat + r.get("repeat", 0), repeat_of + r.get("repeat_of", 0)
                if args.write_seeds and r.get("entries"):
                    n = seeds.export(r["entries"], measure.METHOD, seeds.SEED_FILE,
                                     f"bench/bench_settle.py {time.strftime('%Y-%m-%d')}")
                    print(f"  ({n} measured decisions added to the seed table)", flush=True)
    if notes:
        print("\nwhere the screen and the compiled measurement disagree (ratios to the original):")
        print("\n".join(f"  {n}" for n in notes))
    if compared:
        print(f"\nscreen / compiled agreement: {agree}/{compared} = {agree / compared:.0%} "
              f"(goal >= 90%) the same rule; {equivalent}/{compared} = "
              f"{equivalent / compared:.0%} a pick within {measure.MARGIN:.0%} of exhaustive's "
              f"(by exhaustive's compiled figures)")
    if repeat_of:
        print(f"exhaustive against itself (a second measurement, same process, empty cache): "
              f"{repeat}/{repeat_of} = {repeat / repeat_of:.0%} the same rule: no screen can "
              f"agree with the measurement more often than the measurement agrees with itself")


if __name__ == "__main__":
    main()
