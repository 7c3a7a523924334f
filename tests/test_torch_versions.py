"""One test per torch-version fallback (convlower/torch_versions.py), run on the pinned torch by
simulating the older API, and the gate that refuses an unsupported torch at backend lookup.
``bash bench/compat_torch.sh VERSION`` runs these and the compatibility subset on a real torch."""
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from torch.fx.experimental import sym_node, symbolic_shapes

import convlower
from convlower import torch_internals as ti
from convlower import torch_versions as tv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the gate ----------------------------------------------------------------------------------
def test_parse_version():
    assert tv.parse_version("2.11.0+cu130") == (2, 11)
    assert tv.parse_version("2.16.0a0+git1234") == (2, 16)
    assert tv.parse_version("2.8") == (2, 8)
    assert tv.parse_version("nightly") is None


def test_supported_range(monkeypatch):
    monkeypatch.delenv("CONVLOWER_TRY_TORCH", raising=False)
    assert tv.unsupported_reason() is None  # the pinned torch
    low = "%d.%d.0" % tv.MIN_TORCH
    assert tv.unsupported_reason(low) is None
    assert tv.unsupported_reason("3.0.0") is None  # newer than tested: tried, not refused
    too_old = "%d.%d.1+cu124" % (tv.MIN_TORCH[0], tv.MIN_TORCH[1] - 1)
    reason = tv.unsupported_reason(too_old)
    assert reason and too_old in reason and "torch>=%d.%d" % tv.MIN_TORCH in reason
    assert "backend='inductor'" in reason
    monkeypatch.setenv("CONVLOWER_TRY_TORCH", "1")  # the compat script's --try
    assert tv.unsupported_reason(too_old) is None


def test_missing_feature_is_refused(monkeypatch):
    monkeypatch.delattr(torch.library, "custom_op")
    reason = tv.unsupported_reason()
    assert reason and "torch.library.custom_op" in reason
    with pytest.raises(tv.UnsupportedTorchError, match="custom_op"):
        tv.require_supported()


def test_custom_op_without_tags_is_refused(monkeypatch):
    """torch 2.7's custom_op takes no ``tags`` (the eager conv op needs its stride tag)."""
    def custom_op(name, fn=None, /, *, mutates_args, device_types=None, schema=None):
        raise AssertionError("not called")

    monkeypatch.setattr(torch.library, "custom_op", custom_op)
    reason = tv.unsupported_reason()
    assert reason and "torch.library.custom_op(tags=...)" in reason


def test_backend_lookup_refuses_an_old_torch_clearly():
    """torch.compile(..., backend="convlower") raises at the lookup (before any compile), with
    the supported range in the message; the model is never called."""
    code = textwrap.dedent("""
        import torch, traceback
        torch.__version__ = "2.5.1+cpu"   # an unsupported torch, simulated
        m = torch.nn.Conv2d(3, 8, 4, stride=4)
        try:
            torch.compile(m, backend="convlower")
        except Exception as e:
            print("RAISED", type(e).__name__, "|", e)
        else:
            print("NOT RAISED")
    """)
    env = {k: v for k, v in os.environ.items() if k != "CONVLOWER_TRY_TORCH"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout.strip().splitlines()[-1]
    assert out.startswith("RAISED UnsupportedTorchError |"), res.stdout + res.stderr[-2000:]
    assert "torch 2.5.1+cpu" in out and "torch>=%d.%d" % tv.MIN_TORCH in out


# -- fallbacks ---------------------------------------------------------------------------------
def _symint(value: int, backed: bool = True) -> torch.SymInt:
    env = symbolic_shapes.ShapeEnv()
    if not backed:
        return env.create_unbacked_symint()
    from torch._dynamo.source import ConstantSource

    return env.create_symintnode(env.create_symbol(value, ConstantSource("s")), hint=value)


def test_hint_newest_api():
    assert ti.hint(_symint(5)) == 5 and ti.hint(7) == 7
    assert ti.hint(_symint(0, backed=False)) == 8  # unbacked: the fallback


def test_hint_through_size_hint(monkeypatch):
    """torch 2.9 - 2.12: no ``optimization_hint``; the module function ``size_hint``."""
    calls = []

    def size_hint(a, fallback=None):  # 2.11's body, on this torch's SymNode
        calls.append(fallback)
        return a.node.hint if a.node.hint is not None else fallback

    monkeypatch.delattr(symbolic_shapes, "optimization_hint", raising=False)
    monkeypatch.setattr(symbolic_shapes, "size_hint", size_hint, raising=False)
    assert ti.hint(_symint(5)) == 5 and calls == [8]
    assert ti.hint(_symint(0, backed=False)) == 8


def test_hint_through_require_hint(monkeypatch):
    """torch 2.8: neither module function; ``SymNode.require_hint(fallback)``."""
    calls = []

    def require_hint(self, fallback=None):  # 2.8's body (its fallback is not ours: unused)
        calls.append(fallback)
        return self.hint if self.hint is not None else fallback

    monkeypatch.delattr(symbolic_shapes, "optimization_hint", raising=False)
    monkeypatch.delattr(symbolic_shapes, "size_hint", raising=False)
    monkeypatch.setattr(sym_node.SymNode, "require_hint", require_hint, raising=False)
    assert ti.hint(_symint(6)) == 6 and calls == [None]
    assert ti.hint(_symint(0, backed=False)) == 8 and calls == [None]  # no hint: not asked


def test_size_hints_old_name():
    """torch < 2.10 keeps the backed sizes in ``var_to_val`` (no ``backed_var_to_val``)."""
    s = _symint(5).node.expr
    env = symbolic_shapes.ShapeEnv()
    old = types.SimpleNamespace(var_to_val={s: 5})
    assert ti.size_hints(old) == {s: 5}
    new = types.SimpleNamespace(backed_var_to_val={s: 3}, var_to_val={})
    assert ti.size_hints(new) == {s: 3}
    empty = types.SimpleNamespace(backed_var_to_val={})  # the old name may be gone
    assert ti.size_hints(empty) == {}
    assert ti.size_hints(env) == {}


def test_cache_counts_without_the_fields():
    """torch 2.8's CompilationMetrics has no per-compile cache counts: they read 0."""
    full = types.SimpleNamespace(inductor_fx_local_cache_hit_count=2,
                                 inductor_fx_local_cache_miss_count=None,
                                 aotautograd_local_cache_hit_count=1,
                                 aotautograd_local_cache_miss_count=3)
    assert ti.compile_cache_counts(full) == {"fx_graph_hit": 2, "fx_graph_miss": 0,
                                             "aot_autograd_hit": 1, "aot_autograd_miss": 3}
    old = types.SimpleNamespace(compile_id="0/0", is_forward=True)
    assert ti.compile_cache_counts(old) == dict.fromkeys(
        ["fx_graph_hit", "fx_graph_miss", "aot_autograd_hit", "aot_autograd_miss"], 0)


def test_size_oblivious_where_the_config_exists():
    from torch.fx.experimental import _config

    if not hasattr(_config, "backed_size_oblivious"):
        pytest.skip("this torch has no backed_size_oblivious (the next test's case)")
    assert not _config.backed_size_oblivious
    with ti.size_oblivious():
        assert _config.backed_size_oblivious
    assert not _config.backed_size_oblivious


def test_size_oblivious_without_the_config_still_lowers(monkeypatch):
    """torch 2.8 has no ``backed_size_oblivious``: the context changes nothing and a dynamic
    training compile still lowers forward and backward with eager's values (guards may differ)."""
    from torch.fx.experimental import _config

    old = types.SimpleNamespace(**{k: getattr(_config, k) for k in ("patch",)})
    monkeypatch.setattr(tv, "shape_config", lambda: old)
    with ti.size_oblivious():
        assert not getattr(_config, "backed_size_oblivious", False)
    torch.manual_seed(0)
    m = torch.nn.Conv2d(4, 8, 2, stride=2)
    cm = torch.compile(m, backend="convlower", dynamic=True, options={"select": "always"})
    for w in (8, 12):
        x = torch.randn(2, 4, 6, w, requires_grad=True)
        y = cm(x)
        y.sum().backward()
        torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-5)
    assert {(c.phase, c.rule) for c in convlower.report().convolutions} == {
        ("forward", "patchify_mm"), ("backward", "patchify_mm")}


def test_inductor_wrapper_without_config_patches(monkeypatch):
    """torch 2.11: the Inductor wrapper's ``__call__`` takes no ``config_patches`` (and compiles
    the backward lazily): the patches still reach the forward and the backward."""
    real = torch._TorchCompileInductorWrapper.__call__

    def call_2_11(self, model_, inputs_):
        return real(self, model_, inputs_)

    monkeypatch.setattr(torch._TorchCompileInductorWrapper, "__call__", call_2_11)
    torch.manual_seed(0)
    m = torch.nn.Conv2d(3, 8, 4, stride=4)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    y = torch.compile(m, backend="convlower", options={"select": "always"})(x)
    y.sum().backward()
    torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-5)
    assert {(c.phase, c.rule) for c in convlower.report().convolutions} == {
        ("forward", "patchify_mm"), ("backward", "patchify_mm")}


def test_quick_op_registration_notes_the_same_source_as_torch():
    """convlower's custom ops register without inspect's module scan; the note torch keeps for
    each registration (file:line of the caller) reads the same, and torch's own function is
    back after the block."""
    from torch._library import utils

    real = utils.get_source

    def caller():
        return utils.get_source(2)   # this function's caller: note()

    def note():
        return caller()

    want = note()
    with ti.quick_op_registration():
        assert utils.get_source is not real
        got = note()
    assert utils.get_source is real
    assert got == want and want.startswith(__file__ + ":")
