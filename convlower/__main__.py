"""The ``convlower`` command (also ``python -m convlower``).

    convlower spike [MODEL] [--size tiny|small] [--dtype float32|bfloat16] [--device cpu|cuda]
                    [--runs N] [--warmup K] [--dynamic] [--backward] [--options JSON]
                    [--json OUT] [--plot OUT.png | --no-plot] [--quiet]
    convlower spike --list

MODEL is a zoo name (default: the zoo's default model) or ``package.module:factory``, a
function returning ``(model, example_inputs)``.  A problem the user can fix prints one line on
stderr and exits with status 2; the report goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Optional


def _parser() -> argparse.ArgumentParser:
    from .tools import zoo

    p = argparse.ArgumentParser(prog="convlower", description="convlower: a torch.compile backend "
                                "that lowers convolutions.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser("spike", help="should I compile this model, and with what?",
                       description="Run MODEL eagerly and under backend='inductor' and "
                       "backend='convlower' (whole graph, and with regions: each repeated block compiled once; "
                       "interleaved, one process); report compile times, "
                       "step times, break-even calls, graph breaks, recompiles, lowered convs, "
                       "errors against eager and a verdict.")
    s.add_argument("model", nargs="?", default=zoo.DEFAULT, metavar="MODEL",
                   help=f"zoo name (default {zoo.DEFAULT}; see --list) or package.module:factory")
    s.add_argument("--list", action="store_true", help="list the zoo models and their configs")
    s.add_argument("--size", default="small", choices=zoo.SIZES, help="zoo model size (default small)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    s.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    s.add_argument("--runs", type=int, default=20, help="timed rounds (default 20)")
    s.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    s.add_argument("--dynamic", action="store_true", help="torch.compile(dynamic=True)")
    s.add_argument("--backward", action="store_true", help="time forward + backward")
    s.add_argument("--options", default="{}", metavar="JSON",
                   help="convlower options as JSON; Inductor keys also go to backend='inductor'")
    s.add_argument("--session-calls", type=int, default=1000, metavar="N",
                   help="name the plan with the least total time for a session of N calls "
                        "(default 1000)")
    s.add_argument("--settle-budget", type=float, default=120.0, metavar="S",
                   help="seconds to measure convlower's close calls (then its screen's clear "
                        "wins) compiled after its warm compile, as a warm-up would (0: none; "
                        "default 120)")
    s.add_argument("--json", metavar="OUT", help="write every measurement as JSON")
    s.add_argument("--plot", metavar="OUT.png", help="draw cumulative time against calls "
                   "(default: convlower-spike-MODEL.png in the temp folder, if matplotlib is installed)")
    s.add_argument("--no-plot", action="store_true", help="draw no plot")
    s.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def _have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _fail(msg: str) -> int:
    print(f"convlower spike: error: {msg}", file=sys.stderr)
    return 2


def spike(args) -> int:
    from .tools import zoo
    from .tools.spike import SpikeConfig, SpikeError, format_report, plot, run_spike

    if args.list:
        print(zoo.describe())
        return 0
    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as e:
        return _fail(f"--options is not valid JSON ({e}): {args.options!r}")
    if not isinstance(options, dict):
        return _fail(f"--options must be a JSON object, got {args.options!r}")
    for path in (args.json, args.plot):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            return _fail(f"cannot write {path!r}: folder {folder!r} does not exist")
    cfg = SpikeConfig(model=args.model, size=args.size, dtype=args.dtype, device=args.device,
                      runs=args.runs, warmup=args.warmup, dynamic=args.dynamic,
                      backward=args.backward, options=options, progress=not args.quiet,
                      session_calls=args.session_calls, settle_budget_s=args.settle_budget)
    if not args.plot and not args.no_plot and _have_matplotlib():
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in args.model)
        args.plot = os.path.join(tempfile.gettempdir(), f"convlower-spike-{safe}.png")
    try:
        result = run_spike(cfg)
        result["plot"] = plot(result, args.plot) if args.plot and not args.no_plot else None
    except SpikeError as e:
        return _fail(str(e))
    print(format_report(result))
    if result["plot"]:
        print(f"plot: {result['plot']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"json: {args.json}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "spike":
        return spike(args)
    _parser().print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
