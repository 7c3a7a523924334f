"""Selection that costs (almost) nothing at compile time: ``select="auto"`` and ``"measure"``.

In order, the first that settles the call wins:

1. **proof** — a rule that wins by construction (``Rule.wins_by_construction``);
2. **cache** — a measured decision made earlier (``select="exhaustive"``, a warm-up, another
   process), a shipped seed measured on this device (:mod:`.seeds`), or an earlier screen of
   the same call;
3. **screen** — eager timings of the original's and the rules' kernels (:mod:`.screen`,
   milliseconds): a clear win is taken, a clear loss or a tiny conv keeps the original;
4. a **close call** keeps the original under ``"auto"`` (nothing is compiled), and is
   settled by compiled measurement (:mod:`.measure`) under ``"measure"``.

A warm-up measures the close calls ``"auto"`` left, then its clear wins (:mod:`.close_calls`).
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

from .. import torch_internals as ti
from ..decompositions.opaque_form import has_opaque_form
from ..lowerings.rule import Rule
from ..lowerings.site import ConvSite
from . import close_calls, measure, screen, seeds
from .cache import CACHE, decision_key
from .decision import OPAQUE, Decision, fastest_opaque, label, opaque_of

# v2: a rule's 2-D convs in Inductor's layout; v3: eager_conv judged under 1 ms too and by the
# margin, a backward screened without the forward GEMM its autograd runs; v4: kernels alone
# time the copies into the conv layout that nothing can fuse (a weight, a graph input's frames)
SCREEN_METHOD = "eager-screen/v7"
# eager_conv wins by the measurement's margin: both its figures are what runs (eager's own call;
# the original with Inductor's copies), with no compiled fusion for WIN to allow for.
EAGER_WIN = 1.0 - measure.MARGIN
# Another clear winner whose kernels alone are within this factor of the best's eager figure
# is a rival too (a warm-up measures them): eager figures of equal forms spread this much
# around their compiled ones.  The Wan DiT bf16 patch conv, three runs: time_fold_conv2d
# 0.46-0.47x eagerly (compiled 0.43-0.46x), patchify_mm 0.42x eagerly in one (0.51x compiled)
# and 0.51-0.52x kernels alone in the others (0.42-0.49x compiled).
RIVAL_BAND = 1.25


def decide(site: ConvSite, candidates: Sequence[Rule], compute_dtype: Optional[str],
           measure_close: bool) -> Decision:
    for rule in candidates:
        why = rule.wins_by_construction(site.call)
        if why:
            return Decision(rule, f"proof: {why}", "proof")
    by_name = {r.name: r for r in candidates}
    cached, times = _cached(site, candidates, compute_dtype, by_name, measure_close)
    if cached is not None:
        return cached
    start = time.perf_counter()
    try:
        with ti.kernel_builds_quiet():  # what the screen compiles is built at once
            times = times or screen.run(site, candidates, compute_dtype)
    except Exception as e:  # never break a compile: the original is always correct
        return Decision(None, f"screen failed, kept the original: {type(e).__name__}: {e}",
                        "screen", time.perf_counter() - start)
    rule, why, close = judge(times, by_name)
    fused = fused_ratio(times, rule)
    opaque = fused is not None and fused > screen.WIN
    if opaque:
        why += (f"; in its opaque form (its kernels alone {fused:.2f}x its eager run: "
                f"compiled, fusion can gain no clear win)")
        if fused < 1.0 - measure.MARGIN:  # it may gain the margin: a warm-up measures it
            close = close | {rule.name}
    spent = time.perf_counter() - start
    if close and measure_close:
        d = measure.decide(site, [r for r in candidates if r.name in close], compute_dtype)
        d.why, d.seconds = f"screen: close call ({why}); {d.why}", d.seconds + spent
        d.timings = dict(d.timings, **{f"screen_{k}": v for k, v in times.items()})
        return d
    if close:
        why += ("; a close call: kept the original (select='measure' or a warm-up measures it)"
                if rule is None else "; a warm-up measures them")
        close_calls.note_close(site, candidates, close, compute_dtype, times,
                               label(rule.name if rule else None, opaque))
    elif rule is not None:  # a warm-up looks at it again: a screen can win on a fluke
        close_calls.note_clear_win(site, candidates, compute_dtype, times, label(rule.name, opaque))
    CACHE.store(decision_key(site, candidates, compute_dtype, SCREEN_METHOD),
                {"rule": rule.name if rule else None, "opaque": opaque, "why": why,
                 "timings": times, "close": sorted(close)})
    return Decision(rule, f"screen: {why}", "screen", spent, times, opaque=opaque)


def fused_ratio(times: dict, rule: Optional[Rule]) -> Optional[float]:
    """A screened winner's kernels alone (its copies as free as fusion can make them) over its
    whole eager run, which is what its opaque form runs; None without an opaque form.  Above
    ``screen.WIN`` compiling it is no clear win: it runs opaque (one custom op, no kernels to
    generate); as for the original, a close call takes the choice that compiles nothing, and a
    warm-up measures it.  A GEMM-bound emission (bf16 convs on a CPU without bf16
    instructions) gains little compiled and cost Wan DiT's patch conv a 2x cold compile."""
    if not has_opaque_form(rule) or rule.name not in times:
        return None
    return screen.predicted(times, rule.name) / times[rule.name]


def _cached(site, candidates, compute_dtype, by_name, measure_close):
    """(a cached decision, or None and the cached screen figures of a close call to settle).

    In order: the user's measured decisions, the shipped seeds (:mod:`.seeds`), the user's
    earlier screens."""
    for method in (measure.METHOD, seeds.SEED, SCREEN_METHOD):
        key = decision_key(site, candidates, compute_dtype,
                           measure.METHOD if method == seeds.SEED else method)
        hit = seeds.lookup(key) if method == seeds.SEED else CACHE.lookup(key)
        if hit is None or not (hit.get("rule") is None or hit.get("rule") in by_name):
            continue
        if method == SCREEN_METHOD and hit.get("close"):
            if measure_close:
                return None, dict(hit.get("timings", {}))  # "auto" screened it; measure it now
        rule = by_name.get(hit.get("rule"))
        if method == seeds.SEED and not measure_close:
            deferred = _kernels_deferred(site, candidates, compute_dtype, hit, by_name)
            if deferred is not None:
                return deferred, None
        if method == SCREEN_METHOD and hit.get("close"):
            close_calls.note_close(site, candidates, hit["close"], compute_dtype,
                                   dict(hit.get("timings", {})),
                                   label(hit.get("rule"), opaque_of(hit, rule)))
        elif method == SCREEN_METHOD and rule is not None:
            close_calls.note_clear_win(site, candidates, compute_dtype,
                                       dict(hit.get("timings", {})),
                                       label(rule.name, opaque_of(hit, rule)))
        why = hit.get("why", "")
        why = {SCREEN_METHOD: f"screen: {why}", seeds.SEED: f"seed: {why}"}.get(method, why)
        return Decision(rule, f"{why} (cached)", "cache", 0.0, dict(hit.get("timings", {})),
                        opaque=opaque_of(hit, rule)), None
    return None, None


def _kernels_deferred(site, candidates, compute_dtype, hit: dict, by_name: dict):
    """A seed's traced choice that is no clear win (``screen.WIN``) over the fastest opaque
    form measured with it: the first compile runs that opaque form (no kernels to generate),
    noted as a close call the warm-up settles from the seed (no measuring).  Kernels cost a
    cold compile seconds: Wan DiT's bf16 patch conv compiled patchify_mm 0.88x its opaque
    form, and its kernels doubled a 2 s compile."""
    times = dict(hit.get("timings", {}))
    chosen = label(hit.get("rule"), opaque_of(hit, by_name.get(hit.get("rule"))))
    cheap = fastest_opaque(times)
    if chosen is None or chosen.endswith(OPAQUE) or cheap is None or chosen not in times or \
            cheap.removesuffix(OPAQUE) not in by_name or "aten" not in times:
        return None
    if times[chosen] <= screen.WIN * times[cheap] or \
            times[cheap] > (1.0 - measure.MARGIN) * times["aten"]:
        return None
    rule = by_name[cheap.removesuffix(OPAQUE)]
    close_calls.note_close(site, candidates, sorted({hit["rule"], rule.name}), compute_dtype,
                           times, cheap)
    why = (f"seed: {chosen} compiled takes {times[chosen] / times[cheap]:.2f}x {cheap} (no "
           f"clear win: > {screen.WIN}x): the first compile generates no kernel for it; a "
           f"warm-up compiles the seed's choice")
    return Decision(rule, why, "cache", 0.0, times, opaque=True)


def judge(times: dict, by_name: dict) -> tuple[Optional[Rule], str, set]:
    """(the clear winner or None, why, names of candidates in a close call).  A clear winner
    comes with a close call too when another rule's kernels alone beat it by the measurement's
    margin: an opaque rule's eager figure is its compiled one, a lowering's copies fuse away
    compiled (the Wan DiT bf16 patch conv: channels_last_conv 0.80x eagerly and 0.87x compiled,
    time_sum_conv2d 1.92x eagerly and 0.54x compiled).

    Lowerings are judged against the original's best eager figure ("aten"); ``eager_conv``
    against the original as Inductor will run it (``screen.INDUCTOR_LAYOUT``): it only ever
    saves what Inductor's layout adds.  A clear lowering win comes first (it is faster than
    the original in either layout, hence than eager's call)."""
    base = times["aten"]
    eager = _eager_ratio(times, by_name)
    if base < screen.MIN_CONV_S:
        # eager_conv is eager's own call and saves real copies at the graph's boundary: its
        # figures need no margin for fixed costs (a 0.5 ms 4-channel Conv2d ran 1.8x slower
        # in Inductor's layout than eagerly).
        if eager is not None and eager[0] <= EAGER_WIN and base >= measure.MIN_CONV_S:
            return _eager_conv_wins(eager, by_name)
        # An eager figure says least here; compiled, such a conv still gains or loses up to
        # 2x: one worth compiling candidates for is a close call (a warm-up measures it).
        close = {n for n in times if n in by_name} if base >= measure.MIN_CONV_S else set()
        return None, (f"kept the original (it takes {base * 1e6:.0f} us eagerly, under the "
                      f"{screen.MIN_CONV_S * 1e6:.0f} us an eager screen can judge"
                      f"{'; a close call' if close else ''})"), close
    ratios = {n: t / base for n, t in times.items() if n in by_name and by_name[n].lowers}
    if not ratios and eager is None:
        return None, "no rule ran", set()
    kernels = lambda n: f" (kernels alone {times[n + screen.KERNELS] / base:.2f}x)" \
        if n + screen.KERNELS in times else ""
    shown = ", ".join(f"{n} {r:.2f}x{kernels(n)}"
                      for n, r in sorted(ratios.items(), key=lambda i: i[1]))
    best = min(ratios, key=ratios.get, default=None)
    floor = {n: screen.predicted(times, n) / base for n in ratios}
    if best is not None and ratios[best] <= screen.WIN:
        rivals = {n for n in ratios if n != best and (
            floor[n] < (1.0 - measure.MARGIN) * ratios[best]
            or ratios[n] <= screen.WIN and floor[n] < RIVAL_BAND * ratios[best])}
        why = f"{best} takes {ratios[best]:.2f}x the original's time eagerly (a clear win: " \
              f"<= {screen.WIN}x)"
        if rivals:
            why += f"; {', '.join(sorted(rivals))} may beat it compiled ({shown})"
        return by_name[best], why, rivals | {best} if rivals else set()
    if eager is not None:
        if eager[0] <= EAGER_WIN:
            return _eager_conv_wins(eager, by_name)
        seen = f"{eager[0]:.2f}x the original in Inductor's layout"
        shown = ", ".join(p for p in (shown, f"{screen.EAGER_CONV.name} {seen}") if p)
    # A close call unless the rule loses even with its copies free (only its kernels timed):
    # copies Inductor fuses away can cost more eagerly than the rule's GEMM (bf16 on a CPU).
    close = {n for n in ratios if min(ratios[n], floor[n]) < screen.LOSE}
    if eager is not None and eager[0] < screen.LOSE:
        close.add(screen.EAGER_CONV.name)
    if not close:
        return None, f"kept the original (clear losses: {shown})", set()
    return None, f"{shown} of the original's time eagerly", close


def _eager_conv_wins(eager: tuple[float, str], by_name: dict) -> tuple[Rule, str, set]:
    name = screen.EAGER_CONV.name
    return by_name[name], (f"{name}: eager's call takes {eager[0]:.2f}x the original in "
                           f"Inductor's layout ({eager[1]}; a clear win: <= {EAGER_WIN}x)"), set()


def _eager_ratio(times: dict, by_name: dict) -> Optional[tuple[float, str]]:
    """(eager_conv's time / the original's in Inductor's layout, both figures), or None when
    eager_conv was not screened."""
    name = screen.EAGER_CONV.name
    if name not in by_name or name not in times or screen.INDUCTOR_LAYOUT not in times:
        return None
    eager, inductor = times[name], times[screen.INDUCTOR_LAYOUT]
    return eager / inductor, f"{eager * 1e3:.3g} ms vs {inductor * 1e3:.3g} ms"
