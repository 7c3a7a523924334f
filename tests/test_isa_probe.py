"""Inductor's per-process vector-ISA probe, remembered inside convlower compiles
(convlower/torch_caches.py: remember_vec_isa_probe).

What can go wrong: a library that never loaded taken as loading (a crash on a CPU without the
ISA), an answer from another machine trusted, plain Inductor compiles changed."""
from __future__ import annotations

import pytest

from convlower import torch_caches

vec_isa = pytest.importorskip("torch._inductor.cpu_vec_isa")


@pytest.fixture
def probe(monkeypatch):
    """The remembered probe over a stand-in for the child-process load; restored after."""
    monkeypatch.setattr(vec_isa.VecISA, "_probe_load", vec_isa.VecISA._probe_load)
    answers, calls, active = {}, [], [True]

    def child_load(self, output_path):
        calls.append(output_path)
        return answers.get(output_path, False)

    monkeypatch.setattr(vec_isa.VecISA, "_probe_load", child_load)
    assert torch_caches.remember_vec_isa_probe(lambda: active[0])
    return answers, calls, active, vec_isa.VecISA._probe_load


def _isa():
    return vec_isa.VecAVX2()


def test_a_library_that_loaded_once_is_not_probed_again(probe, tmp_path):
    answers, calls, _, load = probe
    lib = str(tmp_path / "isa.so")
    answers[lib] = True
    assert load(_isa(), lib) and load(_isa(), lib)
    assert calls == [lib], "the second answer comes from the marker"


def test_a_failed_load_is_never_remembered(probe, tmp_path):
    answers, calls, _, load = probe
    lib = str(tmp_path / "bad.so")
    assert not load(_isa(), lib) and not load(_isa(), lib)
    assert calls == [lib, lib]


def test_another_machines_answer_is_not_trusted(probe, tmp_path):
    answers, calls, _, load = probe
    lib = str(tmp_path / "shared.so")
    (tmp_path / "shared.so.convlower-loads").write_text("another host|x86_64|...")
    assert not load(_isa(), lib)
    assert calls == [lib]


def test_outside_a_convlower_compile_inductor_probes_as_always(probe, tmp_path):
    answers, calls, active, load = probe
    lib = str(tmp_path / "isa.so")
    answers[lib] = True
    load(_isa(), lib)
    active[0] = False
    load(_isa(), lib)
    assert calls == [lib, lib]


# -- the probe started ahead (probe_vec_isa_ahead) --------------------------------------------
@pytest.fixture
def ahead(monkeypatch, tmp_path):
    """A stand-in ISA list (cached per process, as Inductor's) that takes a while and records
    its threads; the module's once-per-process state reset."""
    import functools
    import threading
    import time

    import torch._inductor.config as config

    ran = []

    @functools.cache
    def listed():
        ran.append(threading.current_thread().name)
        time.sleep(0.3)  # the children's time
        return ["avx2"]

    monkeypatch.setattr(vec_isa, "valid_vec_isa_list", listed)
    monkeypatch.setattr(torch_caches, "_ahead_thread", None)
    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)
    monkeypatch.setattr(torch_caches, "_probed_stamp", lambda: str(tmp_path / "k" / "stamp"))
    monkeypatch.setattr(torch_caches, "_stamped", set())
    return ran


def test_the_probe_ahead_runs_once_in_another_thread_and_askers_wait_for_it(ahead):
    assert torch_caches.probe_vec_isa_ahead()
    assert not torch_caches.probe_vec_isa_ahead(), "once per process"
    assert vec_isa.valid_vec_isa_list() == ["avx2"], "the asker gets the list the thread made"
    assert ahead == ["convlower-vec-isa-probe"], "checked once, not again by the asker"


def test_a_finished_probe_ahead_is_stamped_and_not_started_again_on_this_machine(ahead, tmp_path,
                                                                               monkeypatch):
    assert torch_caches.probe_vec_isa_ahead()
    torch_caches.wait_for_probe_ahead()
    assert (tmp_path / "k" / "stamp").read_text() == torch_caches._machine()
    monkeypatch.setattr(torch_caches, "_ahead_thread", None)  # as in the next process
    assert not torch_caches.probe_vec_isa_ahead(), "the marked libraries need no child"
    (tmp_path / "k" / "stamp").write_text("another host|x86_64|...")
    monkeypatch.setattr(torch_caches, "_stamped", set())  # another process
    assert torch_caches.probe_vec_isa_ahead(), "another machine's stamp is not trusted"


def test_no_probe_ahead_where_the_isa_is_configured(ahead, monkeypatch):
    import torch._inductor.config as config

    monkeypatch.setattr(config.cpp, "vec_isa_ok", False)
    assert not torch_caches.probe_vec_isa_ahead()
    assert vec_isa.valid_vec_isa_list() == ["avx2"] and ahead == ["MainThread"]


def test_the_probe_ahead_trusts_this_machines_answer(probe, tmp_path):
    import threading

    answers, calls, active, load = probe
    lib = str(tmp_path / "isa.so")
    answers[lib] = True
    load(_isa(), lib)  # inside a compile: remembered
    active[0] = False
    seen = []

    def ahead():
        torch_caches._ahead.on = True
        seen.append(load(_isa(), lib))

    t = threading.Thread(target=ahead)
    t.start()
    t.join()
    assert seen == [True] and calls == [lib], "the ahead thread read the marker"
    load(_isa(), lib)
    assert calls == [lib, lib], "other threads outside a compile probe as always"


def test_a_cpu_graph_starts_the_probe_ahead(monkeypatch):
    import torch

    import convlower
    from convlower import torch_internals as ti

    started = []
    monkeypatch.setattr(ti, "probe_vec_isa_ahead", lambda: started.append(1))
    fn = torch.compile(lambda x: x.sin() + 1, backend=convlower.convlower_backend)
    fn(torch.randn(4))
    assert started, "a CPU graph reached the backend without starting the probe"


def test_dynamo_starts_the_probe_early_for_frames_bound_for_convlower_only(monkeypatch):
    import torch

    import convlower
    from convlower import torch_internals as ti

    from convlower.backend import compiler

    started = []
    monkeypatch.setattr(ti, "probe_vec_isa_ahead", lambda: started.append(1))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    ti.on_compile(compiler._probe_ahead_at_start, lambda _: None)  # the test's reset dropped it
    torch.compile(lambda: torch.ones(3) * 2, backend="inductor")()
    assert not started, "a plain Inductor compile was changed"
    # no tensor input reaches the backend: only the start of Dynamo's trace can start it
    torch.compile(lambda: torch.ones(3) * 3, backend=convlower.convlower_backend)()
    assert started


def test_a_measurement_waits_for_the_probe_ahead(ahead):
    from convlower import torch_internals as ti

    assert torch_caches.probe_vec_isa_ahead()
    with ti.kernel_builds_quiet():  # e.g. the screen timing a candidate
        assert not torch_caches._ahead_thread.is_alive(), "timed beside the probe's children"
