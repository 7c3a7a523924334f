"""The spike's answer and how it is shown: recommendation, text report, break-even plot."""
from __future__ import annotations

from typing import Optional

from ..lowerings import RULES
from ..observe.breaks import describe as describe_break
from .amortize import DONT
from .spike_runner import COMPILED, SpikeError


def _present(results: dict) -> list[str]:
    """The compared plans in ``results``, in COMPILED's order (``blocks`` only where the model
    has its own repeated blocks)."""
    return [b for b in COMPILED if b in results]


def plan_for_session(results: dict, calls: int) -> dict:
    """The plan with the least total time over a session of ``calls`` calls: its cold compile
    plus ``calls`` steps (eager: the steps alone); the warm-load total beside it."""
    if "eager" not in results:
        return {"calls": calls, "plan": None, "plan_warm": None, "text": "", "totals_s": {}}
    eager = results["eager"]["step_median_s"] * calls
    totals = {"eager": (eager, eager)}
    for b in _present(results):
        r = results[b]
        if r.get("error") is None and r.get("cold_compile_s") is not None:
            steps = r["step_median_s"] * calls
            totals[b] = (r["cold_compile_s"] + steps, r["warm_compile_s"] + steps)
    best = min(totals, key=lambda b: totals[b][0])
    warm = min(totals, key=lambda b: totals[b][1])
    text = (f"for a session of {calls} calls: {best} ({totals[best][0]:.3g} s in all, eager "
            f"{eager:.3g} s)" + (f"; with caches warm from a session-load warm-up: {warm} "
                                 f"({totals[warm][1]:.3g} s)" if warm != best else ""))
    return {"calls": calls, "plan": best, "plan_warm": warm, "text": text,
            "totals_s": {b: {"cold": c, "warm": w} for b, (c, w) in totals.items()}}


def recommend(results: dict, session_calls: int = 1000) -> dict:
    """The answer: which backend (if any) to compile with, and when; and which plan has the
    least total time over a session of ``session_calls`` calls."""
    session = plan_for_session(results, session_calls)
    ranked = [results[b] for b in _present(results)
              if results[b].get("verdict_code") in ("session_load", "long_sessions")]
    if not ranked:
        return {"backend": "eager", "verdict": DONT, "session": session,
                "text": "; ".join(t for t in ("stay eager: no backend is worth its compile time "
                                              "here", session["text"]) if t)}
    order = {"session_load": 0, "long_sessions": 1}
    best = min(ranked, key=lambda r: (order[r["verdict_code"]], r["step_median_s"]))
    return {"backend": best["backend"], "verdict": best["verdict"], "session": session,
            "text": f"{best['backend']}: {best['verdict']} ({best['speedup']:+.0%} vs "
                    f"eager, break-even after {best['break_even_calls']} calls cold, "
                    f"{best['break_even_calls_warm']} warm)"
                    + (f"; {session['text']}" if session["text"] else "")}


def _ms(s: Optional[float]) -> str:
    if s is None:
        return "-"
    return f"{s * 1e6:.3g} us" if s < 1e-3 else f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _short_reason(reason: str) -> str:
    """'rule_a: cond is false; rule_b: ...' (every rule's rejection) -> 'no rule applies'."""

    parts = reason.removesuffix(" (cached)").split("; ")
    if len(parts) > 1 and all(p.split(":")[0] in RULES for p in parts):
        return f"no rule applies ({len(parts)} rules' conditions fail)"
    return reason.removesuffix(" (cached)")


def format_report(res: dict) -> str:
    b = res["backends"]
    where = f"size {res['size']}" if res.get("source") == "zoo" else res.get("factory", "")
    mode = "forward+backward" if res["backward"] else "forward"
    head = (f"convlower spike: {res['model']} ({where}), {res['dtype']} on {res['device']}, "
            f"{mode}, {res['runs']} runs after {res['warmup']} warm-up, "
            f"dynamic={res['dynamic']}, torch {res['torch']}")
    out = [head, "", _table(b), ""]
    phases = b["convlower"].get("compile_phases_s")
    if phases:
        out += ["convlower cold compile by phase: "
                + ", ".join(f"{k} {_ms(v)}" for k, v in phases.items()), ""]
    for x in _present(b):
        out.append(f"{x}: {b[x]['verdict']} - {b[x]['reason']}")
        details = b[x].get("graph_break_details")  # convlower's compile statistics
        for d in details or []:
            out.append("    graph break " + describe_break(d, 110).replace("\n", "\n    "))
        for why in [] if details else b[x].get("graph_break_reasons") or []:
            out.append(f"    graph break: {why.splitlines()[0]}")
        for why in b[x].get("recompile_reasons") or []:
            out.append(f"    recompile: {why.splitlines()[0]}")
    out += _conv_lines(b["convlower"])
    out += settling_lines(b["convlower"].get("settling"))  # the steady state runs it
    if res.get("steady_state_compiles"):
        out.append(f"\nwarning: {res['steady_state_compiles']} compile(s) during the timed rounds; "
                   "the step times include them")
    out.append(f"\nrecommendation: {res['recommendation']['text']}")
    return "\n".join(out)


def settling_lines(se: Optional[dict]) -> list[str]:
    """What measuring convlower's close calls (and the screen's clear wins) found, if it ran."""
    if not se:
        return []
    changed = [x for x in se["settled"] if x["changed"]]
    wins = sum(bool(x.get("clear_win")) for x in se["settled"])
    return [f"\nclose calls measured compiled after the warm compile: "
            f"{len(se['settled']) - wins} (and {wins} of the screen's clear wins) in "
            f"{se['seconds']:.1f} s, {len(changed)} changed, {se['left_open']} left open"
            + (f", {se['clear_wins_left']} clear wins not measured"
               if se.get("clear_wins_left") else "")] + \
        [f"    {x['conv']}: {x['rule'] or 'original'} ({x['why']})" for x in changed]


def _table(b: dict) -> str:
    plans = _present(b)
    rows = [["", "eager"] + plans]
    get = lambda k, f: [f(b[x].get(k)) if b[x].get("error") is None else "failed" for x in plans]
    num = lambda v: "-" if v is None else str(v)
    rows += [
        ["cold compile"] + ["-"] + get("cold_compile_s", _ms),
        ["warm compile"] + ["-"] + get("warm_compile_s", _ms),
        ["step (median)", _ms(b["eager"]["step_median_s"])] + get("step_median_s", _ms),
        ["step spread (IQR)", _ms(b["eager"]["step_iqr_s"])] + get("step_iqr_s", _ms),
        ["speed-up", "-"] + get("speedup", lambda v: f"{v:+.1%}"),
        ["break-even (cold)", "-"] + get("break_even_calls", lambda v: "never" if v is None else f"{v} calls"),
        ["break-even (warm)", "-"] + get("break_even_calls_warm", lambda v: "never" if v is None else f"{v} calls"),
        ["graph breaks", "-"] + get("graph_breaks", num),
        ["recompiles", "-"] + get("recompiles", num),
        ["graphs", "-"] + get("graphs", num),
        ["max abs error", "-"] + get("max_abs_err", lambda v: f"{v:.2e}"),
        ["max rel error", "-"] + get("max_rel_err", lambda v: f"{v:.2e}"),
        ["lowered convs", "-"] + get("lowered_by_rule", lambda d: ", ".join(f"{k} x{v}" for k, v in d.items()) or "none"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _conv_lines(res: dict) -> list[str]:
    """convlower's convolutions and Snake sites, identical rows grouped."""
    out = []
    convs = res.get("convolutions") or []
    if convs:  # the first clause of a reason (the JSON has all of it)
        groups: dict[tuple, int] = {}
        for c in convs:
            why = c["rule"] or "kept: " + _short_reason(c["reason"])
            key = (c["phase"], c["input"], c["kernel"], ",".join(map(str, c["stride"])), why)
            groups[key] = groups.get(key, 0) + 1
        out.append("\nconvolutions seen by convlower:")
        for (phase, inp, kernel, stride, why), n in groups.items():
            count = f" x{n}" if n > 1 else ""
            out.append(f"    {phase:8} {inp:>18} k={kernel:8} s={stride:8} -> {why[:100]}{count}")
    snake = res.get("snake") or []
    if snake:
        routes: dict[str, int] = {}
        for site in snake:
            routes[site["route"]] = routes.get(site["route"], 0) + 1
        out.append(f"\nSnake sites seen by convlower: {len(snake)} ("
                   + ", ".join(f"{k} x{v}" for k, v in routes.items()) + ")")
    return out


def plot(res: dict, path: str) -> str:
    """Cumulative time against calls for eager and every plan, break-even points marked."""
    try:
        import matplotlib
    except ImportError:
        raise SpikeError("--plot needs matplotlib (pip install 'convlower[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = res["backends"]
    eager = b["eager"]["step_median_s"]
    ok = [x for x in _present(b) if b[x].get("error") is None]
    evens = [b[x][k] for x in ok for k in ("break_even_calls", "break_even_calls_warm") if b[x][k]]
    n_max = max([2 * n for n in evens] + [10])
    calls = [0, n_max]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(calls, [0, eager * n_max], color="black", label=f"eager ({_ms(eager)}/call)")
    for x, color in zip(ok, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        step = b[x]["step_median_s"]
        for kind, style in (("cold", "-"), ("warm", ":")):
            c = b[x][f"{kind}_compile_s"]
            ax.plot(calls, [c, c + step * n_max], style, color=color,
                    label=f"{x}, {kind} compile ({_ms(c)} + {_ms(step)}/call)")
            n = b[x]["break_even_calls" if kind == "cold" else "break_even_calls_warm"]
            if n:
                ax.plot([n], [c + step * n], "o", color=color)
                ax.annotate(f"{x} {kind}: {n} calls", (n, c + step * n), color=color,
                            textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xlabel("calls")
    ax.set_ylabel("cumulative time (s)")
    ax.set_title(f"{res['model']} ({res['dtype']}, {res['device']}): compile pays off at the dots",
                 fontsize=10)
    ax.set_xlim(0, n_max)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
