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
