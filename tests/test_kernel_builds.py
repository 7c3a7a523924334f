"""A graph's C++ kernels built as a few libraries (convlower/torch_kernel_batch.py).

What can go wrong: a kernel bound to another kernel's function or arguments (wrong results),
helpers of two kernels clashing in one translation unit, a build failure breaking the compile,
libraries not found again (every warm load builds again), plain Inductor compiles changed.
"""
from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
from torch import nn

import convlower
from convlower import torch_kernel_batch as kb

# Two kernels with the same helper name and every argument kind the bindings parse.
SCALE = r"""#include <torch/csrc/inductor/cpp_prefix.h>
static inline float helper(float v) { return v * 2.0f; }
extern "C"  void  kernel(float* out, const float* in, int64_t n, float s)
{
    for (int64_t i = 0; i < n; ++i) out[i] = helper(in[i]) * s;
}
"""
FILL = r"""#include <torch/csrc/inductor/cpp_prefix.h>
static inline float helper(float v) { return v + 1.0f; }
extern "C"  void  kernel(float* out, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) out[i] = helper(static_cast<float>(i));
}
"""


def _active(flag: list):
    return lambda: flag[0]


@pytest.fixture
def together():
    """The backend's predicate swapped for one the test sets; restored after."""
    from convlower.backend import compiler

    flag = [True]
    seen = []
    kb.install(_active(flag), lambda *a: seen.append(a))
    yield flag, seen
    kb.install(compiler._kernels_together, compiler._stats.note_kernels)


def _load(async_compile):
    scope = {"scale": async_compile.cpp_pybinding(["float*", "const float*", "int64_t", "float"],
                                                  SCALE),
             "fill": async_compile.cpp_pybinding(["float*", "int64_t"], FILL)}
    async_compile.wait(scope)
    return scope


def test_kernels_share_one_library_and_each_calls_its_own_code(together):
    from torch._inductor.async_compile import AsyncCompile

    flag, seen = together
    kb._loaded.clear()
    scope = _load(AsyncCompile())
    assert not isinstance(scope["scale"], kb._Pending) and not isinstance(scope["fill"], kb._Pending)
    assert seen and seen[-1][0] == 2, "both kernels built together"
    x, out, filled = torch.arange(5.0), torch.empty(5), torch.empty(4)
    scope["scale"](out, x, 5, 0.5)
    scope["fill"](filled, 4)
    torch.testing.assert_close(out, x * 2.0 * 0.5)  # its own helper: times two
    torch.testing.assert_close(filled, torch.arange(4.0) + 1.0)
    with pytest.raises(RuntimeError, match="takes 2 args"):
        scope["fill"](filled)

    # Another process (nothing in memory) finds both in the index: no build.
    kb._loaded.clear()
    seen.clear()
    again = _load(AsyncCompile())
    assert seen and seen[-1][:2] == (0, 2), "loaded from the libraries built before"
    again["fill"](filled, 4)
    torch.testing.assert_close(filled, torch.arange(4.0) + 1.0)


def test_outside_a_convlower_compile_kernels_build_as_inductor_builds_them(together):
    from torch._inductor.async_compile import AsyncCompile

    flag, seen = together
    flag[0] = False
    kb._loaded.clear()
    index = os.path.join(kb._index_dir(), "index")
    before = set(os.listdir(index)) if os.path.isdir(index) else set()
    fill = FILL.replace("+ 1.0f", "+ 3.0f")  # a kernel no test built together
    scope = {"fill": AsyncCompile().cpp_pybinding(["float*", "int64_t"], fill)}
    AsyncCompile().wait(scope)
    out = torch.empty(3)
    scope["fill"](out, 3)
    torch.testing.assert_close(out, torch.arange(3.0) + 3.0)
    assert not seen
    assert (set(os.listdir(index)) if os.path.isdir(index) else set()) == before


def test_a_pending_kernel_called_before_the_wait_builds_alone():
    pending = kb._Pending(["float*", "int64_t"], FILL.replace("+ 1.0f", "+ 5.0f"))
    out = torch.empty(2)
    pending(out, 2)
    torch.testing.assert_close(out, torch.tensor([5.0, 6.0]))


class _Pointwise(nn.Module):
    """Two C++ kernels at least: pointwise ops before and after an (extern) matmul."""

    def forward(self, x):
        y = torch.sin(x) * 2
        z = y @ y.t()
        return torch.relu(z) + z.softmax(dim=-1)


def _compiled_kernels(x, **options):
    convlower.reset_report()
    out = torch.compile(_Pointwise(), backend="convlower", options=options or None)(x)
    compiles = [c for c in convlower.report().compiles if c.phase == "forward"]
    return out, compiles[-1].kernels, compiles[-1].summary


def test_a_convlower_compile_builds_its_kernels_together_and_matches_eager():
    x = torch.randn(6, 33)
    out, kernels, summary = _compiled_kernels(x)
    torch.testing.assert_close(out, _Pointwise()(x))
    assert kernels["built"] + kernels["loaded"] >= 2 and "C++ kernels" in summary
    torch._dynamo.reset()
    out, kernels, _ = _compiled_kernels(x, kernel_builds="separate")
    torch.testing.assert_close(out, _Pointwise()(x))
    assert kernels == {}, "kernel_builds='separate' leaves Inductor's builds alone"


def test_a_failing_build_falls_back_to_inductors_own_and_still_compiles(monkeypatch, caplog):
    def broken(kernels):
        raise RuntimeError("injected")

    monkeypatch.setattr(kb, "_library_source", broken)
    monkeypatch.setattr(kb, "_loaded", {})
    monkeypatch.setattr(kb, "_from_index", lambda keys: {})
    x = torch.randn(5, 17)
    with caplog.at_level(logging.WARNING, logger="convlower"):
        out, kernels, _ = _compiled_kernels(x)
    torch.testing.assert_close(out, _Pointwise()(x))
    assert "one by one" in caplog.text
    assert not kernels.get("built")


def test_bad_kernel_builds_option_is_refused():
    from convlower.backend import options

    with pytest.raises(convlower.OptionError, match="'together', 'separate'"):
        options.parse({"kernel_builds": "batched"})
    assert options.parse({}, env={"CONVLOWER_KERNEL_BUILDS": "separate"}).kernel_builds == "separate"


def test_only_kernels_the_bindings_understand_are_batched():
    assert kb._batchable(["float*", "const at::BFloat16*", "int64_t", "float"], SCALE)
    assert not kb._batchable(["double"], SCALE)  # no binding for it: Inductor's own
    assert not kb._batchable(["float*"], SCALE + SCALE)  # two entry points


def _module(scope_names: dict):
    """What a generated module does: one cpp_pybinding per kernel, then wait(globals())."""
    from torch._inductor.async_compile import AsyncCompile

    ac = AsyncCompile()
    scope = {name: ac.cpp_pybinding(argtypes, source) for name, (argtypes, source) in scope_names.items()}
    ac.wait(scope)
    return scope


def test_modules_loaded_inside_built_at_end_are_built_together_at_its_end(together):
    flag, seen = together
    kb._loaded.clear()
    add = FILL.replace("+ 1.0f", "+ 7.0f")
    first = _module({"scale": (["float*", "const float*", "int64_t", "float"],
                               SCALE.replace("2.0f", "4.0f"))})
    seen.clear()
    with kb.built_at_end():
        a = _module({"fill": (["float*", "int64_t"], add)})
        b = _module({"scale": (["float*", "const float*", "int64_t", "float"],
                               SCALE.replace("2.0f", "6.0f")),
                     "fill": (["float*", "int64_t"], add)})  # the same kernel as a's
        assert isinstance(a["fill"], kb._Pending) and isinstance(b["scale"], kb._Pending)
        assert not seen, "nothing built before the block ends"
    assert seen == [(2, 0, 1, seen[0][3])], "two distinct kernels, one library, one build"
    assert not any(isinstance(v, kb._Pending) for v in (*a.values(), *b.values()))
    out = torch.empty(3)
    b["fill"](out, 3)
    torch.testing.assert_close(out, torch.arange(3.0) + 7.0)
    first["scale"](out, torch.ones(3), 3, 1.0)  # one kernel alone: built as Inductor builds it
    torch.testing.assert_close(out, torch.full((3,), 4.0))


def test_a_kernel_called_inside_the_block_builds_alone_and_a_failed_block_builds_nothing(together):
    flag, seen = together
    kb._loaded.clear()
    seen.clear()
    with pytest.raises(ValueError):
        with kb.built_at_end():
            scope = _module({"fill": (["float*", "int64_t"], FILL.replace("+ 1.0f", "+ 8.0f"))})
            out = torch.empty(2)
            scope["fill"](out, 2)  # e.g. a candidate timed while the regions still compile
            assert not isinstance(scope["fill"], kb._Pending), "rebound to the loaded kernel"
            torch.testing.assert_close(out, torch.tensor([8.0, 9.0]))
            raise ValueError("the compile failed")
    assert not seen


def test_regions_build_every_parts_kernels_together_in_one_report(monkeypatch, tmp_path):
    from test_regions import Stack

    from convlower import regions

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # an empty kernel index
    regions.clear()
    kb._loaded.clear()
    m, x = Stack().eval(), torch.randn(2, 5, 16)
    with torch.no_grad():
        out = torch.compile(m, backend="convlower", options={"regions": "auto"})(x)
    torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
    parts = [r for r in convlower.report().to_dict()["regions"] if r["how"] == "compiled"]
    kernels = [c.kernels for c in convlower.report().compiles if c.kernels]
    assert len(parts) >= 2 and len(kernels) == 1, (parts, kernels)
    # some while later parts compile (one library at a time), the rest at the end
    assert kernels[0]["built"] >= len(parts) and kernels[0]["libraries"] <= kernels[0]["built"] // 2
    regions.clear()


def test_a_measurement_inside_the_block_builds_its_kernels_when_loaded(together):
    flag, seen = together
    kb._loaded.clear()
    seen.clear()
    with kb.built_at_end():
        with kb.quiet():  # e.g. a candidate compiled to be timed while the regions compile
            timed = _module({"fill": (["float*", "int64_t"], FILL.replace("+ 1.0f", "+ 3.0f")),
                             "scale": (["float*", "const float*", "int64_t", "float"],
                                       SCALE.replace("2.0f", "5.0f"))})
            assert not any(isinstance(v, kb._Pending) for v in timed.values())
            assert [s[:3] for s in seen] == [(2, 0, 1)], "built together at its module's load"
        part = _module({"fill": (["float*", "int64_t"], FILL.replace("+ 1.0f", "+ 9.0f"))})
        assert isinstance(part["fill"], kb._Pending), "the regions' own kernels still wait"
    out = torch.empty(2)
    timed["fill"](out, 2)
    torch.testing.assert_close(out, torch.tensor([3.0, 4.0]))
    part["fill"](out, 2)
    torch.testing.assert_close(out, torch.tensor([9.0, 10.0]))


def test_held_back_kernels_build_on_another_thread_while_the_next_parts_compile(together,
                                                                                 monkeypatch):
    import threading
    import time

    flag, seen = together
    kb._loaded.clear()
    seen.clear()
    release, threads, real = threading.Event(), [], kb._build

    def build(todo, libraries=None):
        threads.append(threading.current_thread().name)
        if threading.current_thread().name == "convlower-kernel-build":
            assert release.wait(60)
        return real(todo, libraries)

    monkeypatch.setattr(kb, "_build", build)
    fill, scale = (["float*", "int64_t"], FILL), (["float*", "const float*", "int64_t", "float"],
                                                  SCALE)
    with kb.built_at_end():
        a = _module({"fill": (fill[0], fill[1].replace("+ 1.0f", "+ 11.0f")),
                     "scale": (scale[0], scale[1].replace("2.0f", "11.0f"))})
        for _ in range(600):  # the first part's kernels: building in the background
            if threads:
                break
            time.sleep(0.01)
        assert threads == ["convlower-kernel-build"]
        b = _module({"fill": (fill[0], fill[1].replace("+ 1.0f", "+ 12.0f")),
                     "scale": (scale[0], scale[1].replace("2.0f", "12.0f"))})
        assert len(kb._deferred.batches) == 1, "one build at a time: the second part waits"
        assert isinstance(a["fill"], kb._Pending) and isinstance(b["fill"], kb._Pending)
        release.set()
    assert threads == ["convlower-kernel-build", "MainThread"], "the rest built at the end"
    assert [s[:3] for s in seen] == [(4, 0, 2)], "four kernels, two libraries, one report"
    out = torch.empty(3)
    a["fill"](out, 3)
    torch.testing.assert_close(out, torch.arange(3.0) + 11.0)
    b["scale"](out, torch.ones(3), 3, 1.0)
    torch.testing.assert_close(out, torch.full((3,), 12.0))
    b["fill"](out, 3)
    torch.testing.assert_close(out, torch.arange(3.0) + 12.0)


def _background_build(monkeypatch, release, seen_priority=None):
    """kb._build, held in the background thread until ``release``; the thread's CPU priority
    noted in ``seen_priority``."""
    import threading

    real = kb._build

    def build(todo, libraries=None):
        if threading.current_thread().name == "convlower-kernel-build":
            if seen_priority is not None and hasattr(os, "getpriority"):
                seen_priority.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            assert release.wait(60)
        return real(todo, libraries)

    monkeypatch.setattr(kb, "_build", build)


def _two_kernels(n: float) -> dict:
    return _module({"fill": (["float*", "int64_t"], FILL.replace("+ 1.0f", f"+ {n}f")),
                    "scale": (["float*", "const float*", "int64_t", "float"],
                              SCALE.replace("2.0f", f"{n}f"))})


def test_a_measurement_waits_for_a_build_that_cannot_give_way(together, monkeypatch):
    import threading

    kb._loaded.clear()
    release = threading.Event()
    _background_build(monkeypatch, release)
    monkeypatch.setattr(kb, "_lowest_priority", lambda: False)  # e.g. not Linux
    with kb.built_at_end():
        _two_kernels(13.0)
        batch = kb._deferred.batches[0]
        threading.Timer(0.3, release.set).start()
        with kb.quiet():  # e.g. the screen timing a candidate
            assert not batch.thread.is_alive(), "timed beside a g++ on the other core"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread priorities: Linux")
def test_a_background_build_gives_way_to_a_measurement(together, monkeypatch):
    """The build and its g++ run at the lowest priority: a measurement does not wait for it
    (on the UNet, screens waited 6.7 s of a 43 s compile) and takes both cores when it runs."""
    import threading

    kb._loaded.clear()
    release, priority = threading.Event(), []
    _background_build(monkeypatch, release, priority)
    with kb.built_at_end():
        a = _two_kernels(14.0)
        batch = kb._deferred.batches[0]
        with kb.quiet():
            assert batch.thread.is_alive(), "the measurement waited for the build"
        release.set()
    assert priority == [19]
    out = torch.empty(3)
    a["fill"](out, 3)
    torch.testing.assert_close(out, torch.arange(3.0) + 14.0)
