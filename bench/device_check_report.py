"""The device check's markdown: headings at level 3 and 4, so ``device_check.md`` pastes into
docs/benchmarks.md under "## GPU" as the device's own section.  Pure functions of the results
dict (``bench/device_check.py`` writes it); nothing here imports torch or convlower."""
from __future__ import annotations

import statistics


def markdown(r: dict) -> str:
    env = r["environment"]
    lines = [f"### {env.get('device_name', '?')} — torch {env.get('torch', '?')}, "
             f"{str(env.get('date', ''))[:10]}", ""]
    lines.append(f"torch {env.get('torch')} (cuda {env.get('cuda')}, hip {env.get('hip')}, "
                 f"triton {env.get('triton', '-')}), python {env.get('python', '?')}, convlower "
                 f"{env.get('convlower', '?')}, platform {env.get('platform', '?')}, "
                 f"{env.get('date', '')}"
                 f"{'; QUICK MODE: tiny sizes, figures mean nothing' if r.get('quick') else ''}.")
    t = r.get("timing", {})
    lines.append(f"Timing: {t.get('clock', '?')}, {t.get('warmup_calls', '?')} warm-up calls, "
                 f"samples of >= {(t.get('min_sample_s') or 0) * 1e3:g} ms, median of "
                 f"{t.get('rounds', '?')} interleaved rounds; timings <= 0 rejected.  Run took "
                 f"{r.get('wall_s') or 0:.0f} s of a {r.get('budget_s') or 0:.0f} s budget "
                 f"(`{r.get('command', '')}`).")
    lines += _tests(r) + _perf(r) + _diagnosis(r) + _compile(r)
    if r.get("failures"):
        lines += ["", "#### Failures", ""] + [f"- {_one_line(f)}" for f in r["failures"]]
    if r.get("notes"):
        lines += ["", "#### Notes", ""] + [f"- {_one_line(n)}" for n in r["notes"]]
    return "\n".join(lines) + "\n"


def _tests(r: dict) -> list:
    lines = ["", "#### gpu tests", ""]
    tests = r.get("tests", {})
    counts = tests.get("counts", {})
    where = " (on the CPU, by request: not a GPU result)" if tests.get("run_on_cpu_by_request") else ""
    lines.append(f"{tests.get('status', 'not run')}: " + ", ".join(
        f"{v} {k}" for k, v in sorted(counts.items())) + where)
    for case in tests.get("tests", []):
        if case["outcome"] not in ("passed",):
            lines.append(f"- {case['name']}: {case['outcome']}: "
                         f"{_one_line(case.get('message', ''), 300)}")
    return lines


def _perf(r: dict) -> list:
    lines = ["", "#### Performance (ms per call, median)", "",
             "| case | dtype | pass | eager | Inductor | convlower | others | Inductor / "
             "convlower | eager / convlower | convlower chose |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = r.get("perf", {}).get("rows", [])
    lines += [table_row(row) for row in rows]
    lines += [compile_line(row) for row in rows if row.get("section") == "regions"
              and row.get("variants")]
    lines += ["", "Ratios > 1: convlower faster, except `convlower / X` (the floors: < 1.2 is the "
              "goal for bf16 patch embedding, < 1.05 for fp32).  `compiled mm` = the same "
              "flatten + mm compiled by Inductor (same per-call overhead as any compiled call), "
              "`bare mm` = one eager `torch.mm`.  Snake rows: convlower = the fused route, "
              "others = the eager-safe op (what HIP + bf16 gets).  Regions row: the convlower "
              "column is regions, others holds convlower's whole graph, and the ratio and "
              "`chose` columns are regions' (regions / X < 1: regions faster)."]
    return lines


def _diagnosis(r: dict) -> list:
    diags = r.get("diagnosis") or {}
    lines = []
    for what, d in diags.items():
        lines += ["", f"#### {what}: what runs per call (profiler)", ""]
        if d.get("error"):
            lines.append(f"error: {_one_line(d['error'])}")
        if d.get("code_file"):
            lines.append(f"Generated code of the convlower compile: `{d['code_file']}`.")
        for name, p in (d.get("profile") or {}).items():
            if p.get("error"):
                lines.append(f"- {name}: error: {_one_line(p['error'], 200)}")
                continue
            ops = "; ".join(f"{k['name'][:70]} x{k['count_per_call']:g} {k['us_per_call']:.1f} us"
                            for k in p.get("kernels", [])[:8])
            lines.append(f"- {name}: host {p.get('host_us_per_call', 0):.1f} us/call to launch, "
                         f"{p.get('device_us_per_call', 0):.1f} us/call in "
                         f"{p.get('launches_per_call', 0):g} {p.get('unit', 'kernels')}: "
                         f"{ops or '-'}")
    return lines


def _compile(r: dict) -> list:
    comp = r.get("compile", {})
    lines = ["", "#### Compile (convlower.warmup, two processes, one cache directory)", ""]
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
    return lines


def compile_line(row: dict) -> str:
    """A regions row: per-round step ratios of regions to each whole graph, the first calls
    (compile seconds, one process, in the row's order) and the parts."""
    v = row["variants"]
    steps = "; ".join(f"regions / {k} {_round_ratios(v, 'regions', k)}"
                      for k in ("convlower", "inductor") if k in v)
    first = {k: v[k].get("first_call_s") for k in ("regions", "inductor", "convlower") if k in v}
    secs = ", ".join(f"{k} {_num(s)} s" for k, s in first.items())
    compile_ratio = (f"; regions / Inductor **{first['regions'] / first['inductor']:.2f}** "
                     f"(< 1: regions compiles faster)"
                     if first.get("regions") and first.get("inductor") else "")
    parts = ", ".join(f"{n} {k}" for k, n in
                      (v.get("regions", {}).get("region_parts") or {}).items())
    return (f"\n{row['case']} {row['dtype']}: step per round (median, quartiles) "
            f"{steps or '-'}.  First call (compile), one process in this order: {secs}"
            f"{compile_ratio}; convlower's whole graph came last and reused kernels and "
            f"decisions the two before it built.  Regions' parts: {parts or '-'}.")


def _round_ratios(v: dict, a: str, b: str) -> str:
    """The median and quartiles of ``a``'s samples over ``b``'s, round by round."""
    r = [x / y for x, y in zip(v.get(a, {}).get("samples") or [],
                               v.get(b, {}).get("samples") or []) if y]
    if len(r) < 2:
        return f"{r[0]:.3f}" if r else "-"
    q1, med, q3 = statistics.quantiles(r, n=4)
    return f"**{med:.3f}** ({q1:.2f}-{q3:.2f})"


def summary_line(row: dict) -> str:
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    if row.get("error"):
        return f"error: {row['error'][:200]}"
    v = row.get("variants", {})
    floors = ", ".join(f"{row.get('primary', 'convlower')} / {f} {ratio(v, row.get('primary', 'convlower'), f)}"
                       for f in floors_of(row) if f in v)
    return ", ".join(f"{k} {fmt_ms(x)}" for k, x in v.items()) + (f"; {floors}" if floors else "")


def floors_of(row: dict) -> list:
    f = row.get("floor") or row.get("compare_to") or []
    return [f] if isinstance(f, str) else list(f)


def fmt_ms(v: dict) -> str:
    if v.get("error"):
        return "error"
    if v.get("rejected"):
        return "rejected"
    s = v.get("median_s")
    return "-" if s is None else f"{s * 1e3:.3g} ms"


def ratio(v: dict, a: str, b: str) -> str:
    ta, tb = v.get(a, {}).get("median_s"), v.get(b, {}).get("median_s")
    return f"{ta / tb:.2f}" if ta and tb else "-"


def table_row(row: dict) -> str:
    head = f"| {row['case']} | {row['dtype']} | {row['pass']} |"
    if row.get("skipped"):
        return head + f" skipped: {row['skipped']} | | | | | | |"
    if row.get("error"):
        return head + f" error: {_one_line(row['error'], 120).replace('|', '/')} | | | | | | |"
    v = row["variants"]
    primary = row.get("primary", "convlower")
    others = [k for k in v if k not in ("eager", "inductor", primary)]
    ms = lambda k: fmt_ms(v[k]).replace(" ms", "") if k in v else "-"
    other = ", ".join(f"{k} {ms(k)}" for k in others)
    floors = [f"{primary} / {f} **{ratio(v, primary, f)}**" for f in floors_of(row) if f in v]
    if floors:
        other += f" ({', '.join(floors)})"
    p = v.get(primary, {})
    chose_s = ", ".join(f"{k} x{n}" for k, n in sorted((p.get("chose") or {}).items()))
    if p.get("snake_routes"):
        chose_s = ", ".join(f"Snake {k} x{n}" for k, n in sorted(p["snake_routes"].items())) + (
            f"; convs {chose_s}" if chose_s else "")
    chose_s = chose_s or "-"
    return (f"{head} {ms('eager')} | {ms('inductor')} | {ms(primary)} | {other} | "
            f"{ratio(v, 'inductor', primary)} | {ratio(v, 'eager', primary)} | {chose_s} |")


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _num(v) -> str:
    return "-" if v is None else f"{v:.2f}"
