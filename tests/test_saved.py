"""The saved compile (convlower.saved, the warm-up's whole-model save and load).

What is checked: a second warm-up on the same cache folder loads the compiled model instead of
compiling (in this process and in a fresh one), its outputs and gradients equal eager, the
model's own parameters are used after load, a call outside the saved guards compiles as usual,
and every change that alters the code (model source, structure, options, torch version, inputs)
misses the saved entry and names the field; a corrupt entry gives a warning and a recompile;
a model with a graph break or the regions plan is compiled as before and says why.
"""
import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import convlower
from convlower import torch_internals as ti
from convlower.saved import identity as ident
from convlower.saved import store

pytestmark = pytest.mark.skipif(not ti.can_save_compiled(), reason="torch without AOT compile")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = torch.nn.Conv2d(4, 8, 2, 2)  # patchify: lowered under select="always"
        self.mix = torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.mix(torch.relu(self.patch(x)))


class Broken(Net):
    def forward(self, x):
        y = self.patch(x)
        print("", end="")  # a graph break
        return self.mix(y)


OPTS = {"select": "always"}


def _warm(model, x, cache, **kw):
    kw.setdefault("options", OPTS)
    with torch.no_grad():
        return convlower.warmup(model, (x,), cache_dir=cache, iters=0, settle_budget_s=0, **kw)


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net().eval(), torch.randn(2, 4, 16, 16)


def test_second_warmup_loads_the_saved_compile(net, tmp_path):
    m, x = net
    f1, r1 = _warm(m, x, tmp_path)
    assert r1.saved.state == "saved" and "nothing saved yet" in r1.saved.missed
    st = r1.statistics  # torch's AOT compile writes no frame metrics: convlower's own record
    assert st["graphs"] == 1 and st["rewrites"] == {"patchify_mm": 1}, st
    assert st["phases_s"]["codegen"] > 0 and st["total_s"] >= st["phases_s"]["codegen"], st
    convlower.reset_report()
    f2, r2 = _warm(m, x, tmp_path)
    assert r2.saved.state == "loaded" and r2.cache == "saved" and r2.warm, r2.saved
    assert r2.warnings == [], r2.warnings
    assert r2.saved.compile_s == pytest.approx(r1.first_step_s), "the compile it stands for"
    assert r2.saved.compile_phases_s == r1.statistics["phases_s"]  # cold beside warm
    with torch.no_grad():
        torch.testing.assert_close(f2(x), m(x), rtol=1e-5, atol=1e-5)
    convs = convlower.report().convolutions
    assert any(c["rule"] == "patchify_mm" and c["from_cache"] for c in convs), convs
    for path in (tmp_path / "saved").iterdir():
        assert os.stat(path).st_mode & 0o077 == 0, path


def test_loaded_compile_uses_the_models_own_parameters(net, tmp_path):
    m, x = net
    _warm(m, x, tmp_path)
    f, r = _warm(m, x, tmp_path)
    assert r.saved.state == "loaded"
    with torch.no_grad():
        for p in m.parameters():  # a new state dict / LoRA swap after the load
            p.mul_(-0.5).add_(0.25)
        torch.testing.assert_close(f(x), m(x), rtol=1e-5, atol=1e-5)


def test_call_outside_the_saved_guards_compiles_as_usual(net, tmp_path):
    m, x = net
    _warm(m, x, tmp_path)
    f, r = _warm(m, x, tmp_path)
    assert r.saved.state == "loaded"
    other = torch.randn(3, 4, 20, 20)  # another batch and resolution
    with torch.no_grad():
        torch.testing.assert_close(f(other), m(other), rtol=1e-5, atol=1e-5)
    assert f._fallback is not None, "the saved compile ran on inputs it was not compiled for"
    with torch.no_grad():
        f(x)  # the saved compile still serves its own inputs


def test_training_through_a_loaded_compile_matches_eager(tmp_path):
    torch.manual_seed(0)
    m, x = Net(), torch.randn(2, 4, 16, 16, requires_grad=True)
    kw = dict(options=OPTS, cache_dir=tmp_path, iters=0, settle_budget_s=0, backward=True)
    convlower.warmup(m, (x,), **kw)
    f, r = convlower.warmup(m, (x,), **kw)
    assert r.saved.state == "loaded", r.saved
    f(x).square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad(set_to_none=True)
    m(x).square().sum().backward()
    want = [x.grad] + [p.grad for p in m.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,field", [
    ("options", "options"), ("structure", "structure"), ("torch", "torch"),
    # other inputs or grad mode: an entry of their own (two signatures do not evict each other)
    ("inputs", "nothing saved yet"), ("grad", "nothing saved yet")])
def test_a_change_misses_the_saved_compile_and_says_which(net, tmp_path, change, field):
    m, x = net
    _warm(m, x, tmp_path)
    kw = {}
    if change == "options":
        kw["options"] = {"select": "auto"}
    elif change == "inputs":
        x = x.to(memory_format=torch.channels_last)
    elif change == "structure":
        m.mix = torch.nn.Conv2d(8, 8, 3, padding=2, dilation=2)  # same weight shape
    elif change == "torch":  # as if a newer torch had written the entry
        head = next((tmp_path / "saved").glob("*.json"))
        meta = json.loads(head.read_text())
        meta["identity"]["torch"] = "9.9.9"
        head.write_text(json.dumps(meta))
    if change == "grad":
        f, r = convlower.warmup(m, (x,), cache_dir=tmp_path, iters=0, settle_budget_s=0,
                                options=OPTS)
    else:
        f, r = _warm(m, x, tmp_path, **kw)
    assert r.saved.state == "saved" and field in r.saved.missed, r.saved
    if field in ("options", "structure", "torch"):
        assert r.saved.missed.startswith("the saved compile is stale"), r.saved.missed
    with torch.no_grad():
        torch.testing.assert_close(f(x), m(x), rtol=1e-5, atol=1e-5)


def test_changed_model_source_misses(tmp_path, monkeypatch):
    src = tmp_path / "mymodel_src.py"
    code = textwrap.dedent("""
        import torch
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.c = torch.nn.Conv2d(4, 8, 2, 2)
            def forward(self, x):
                return self.c(x) * 2
    """)
    src.write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("mymodel_src")
    m, x = mod.M().eval(), torch.randn(1, 4, 8, 8)
    _warm(m, x, tmp_path / "cache")
    src.write_text(code.replace("* 2", "* 3"))
    _, r = _warm(m, x, tmp_path / "cache")
    assert "source of mymodel_src" in r.saved.missed, r.saved


def test_corrupt_saved_compile_warns_and_recompiles(net, tmp_path):
    m, x = net
    _warm(m, x, tmp_path)
    blob = next((tmp_path / "saved").glob("*.bin"))
    blob.write_bytes(blob.read_bytes()[:100])
    f, r = _warm(m, x, tmp_path)
    assert r.saved.state == "saved" and "truncated or corrupt" in r.saved.missed
    assert any("saved compile is unreadable" in w for w in r.warnings), r.warnings
    with torch.no_grad():
        torch.testing.assert_close(f(x), m(x), rtol=1e-5, atol=1e-5)


def test_graph_break_is_compiled_as_before_and_says_why(tmp_path):
    torch.manual_seed(0)
    m, x = Broken().eval(), torch.randn(2, 4, 16, 16)
    f, r = _warm(m, x, tmp_path)
    assert r.saved.state == "not saved" and "one graph" in r.saved.why, r.saved
    with torch.no_grad():
        torch.testing.assert_close(f(x), m(x), rtol=1e-5, atol=1e-5)
    _, again = _warm(m, x, tmp_path)  # the next warm-up does not try to capture it whole
    assert again.saved.known and "earlier warm-up" in again.saved.why, again.saved


@pytest.mark.parametrize("backward", [False, True])
def test_regions_plan_is_saved_and_loaded(tmp_path, backward):
    """Each distinct part saved once (AOTAutograd's bundled entry), the split graph beside."""
    from convlower import regions
    from test_regions import Stack

    torch.manual_seed(0)
    m, x = Stack(), torch.randn(2, 5, 16, requires_grad=backward)
    kw = dict(options={"regions": "auto"}, cache_dir=tmp_path, iters=0, settle_budget_s=0,
              backward=backward)
    with torch.set_grad_enabled(backward):
        regions.clear()  # parts compiled earlier in this process have no saveable form
        _, r1 = convlower.warmup(m, (x,), **kw)
        regions.clear()
        f, r2 = convlower.warmup(m, (x,), **kw)
    assert r1.saved.state == "saved" and r2.saved.state == "loaded", (r1.saved, r2.saved)
    assert r2.warnings == [], r2.warnings  # the loaded compile ran (no fallback)
    if not backward:
        with torch.no_grad():
            torch.testing.assert_close(f(x), m(x), rtol=1e-5, atol=1e-5)
        return
    f(x).square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad(set_to_none=True)
    m(x).square().sum().backward()
    for g, w in zip(got, [x.grad] + [p.grad for p in m.parameters()]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw,why", [({"save_compiled": False}, "save_compiled=False")])
def test_not_saved_when_off(net, tmp_path, kw, why):
    m, x = net
    _, r = _warm(m, x, tmp_path, **kw)
    assert r.saved.state == "off" and why in r.saved.why
    assert not (tmp_path / "saved").exists() or not any((tmp_path / "saved").iterdir())


def test_a_bare_module_is_saved_too(tmp_path):
    """nn.Conv3d's own forward: the trace keeps a reference to the module itself."""
    torch.manual_seed(0)
    m, x = torch.nn.Conv3d(4, 8, 2, 2).eval(), torch.randn(1, 4, 4, 8, 8)
    _, r1 = _warm(m, x, tmp_path)
    f, r2 = _warm(m, x, tmp_path)
    assert r1.saved.state == "saved" and r2.saved.state == "loaded", (r1.saved, r2.saved)
    with torch.no_grad():
        m.weight.mul_(2)  # the loading process's own module is the one called
        torch.testing.assert_close(f(x), m(x), rtol=1e-5, atol=1e-5)


def test_identity_fields():
    a = {"torch": "2.13.0", "inputs": [1], "model": "m"}
    assert ident.differences(a, dict(a, torch="2.15.0")) == ["torch"]
    assert ident.differences(a, dict(a)) == []
    assert ident.slot(dict(a, torch="x")) == ident.slot(a)  # versions share the slot
    assert ident.slot(dict(a, inputs=[2])) != ident.slot(a)  # other inputs do not
    assert ident.changed_sources({"json": ident.source_digest("json")}) == []
    assert ident.changed_sources({"json": "0" * 64, "no_such_module_x": "1"}) == \
        ["json", "no_such_module_x"]


def test_store_refuses_a_blob_its_header_does_not_name(tmp_path):
    store.write(str(tmp_path), "s", {"identity": {}}, b"abc")
    assert store.read(str(tmp_path), "s") == (store.read(str(tmp_path), "s")[0], b"abc")
    (tmp_path / "s.bin").write_bytes(b"abd")
    with pytest.raises(store.Unreadable, match="corrupt"):
        store.read(str(tmp_path), "s")
    (tmp_path / "s.json").write_text("{")
    with pytest.raises(store.Unreadable):
        store.read(str(tmp_path), "s")
    assert store.read(str(tmp_path), "none") is None


def test_unsaveable_guards_are_dropped_and_named():
    from types import SimpleNamespace as G

    entries = [G(name="x.size", guard_type="TENSOR_MATCH", derived_guard_types=(), is_global=False),
               G(name="f.__code__", guard_type="CONSTANT_MATCH", derived_guard_types=("ID_MATCH",),
                 is_global=False),
               G(name="flag", guard_type="EQUALS_MATCH", derived_guard_types=(), is_global=True)]
    assert ti.dropped_guards(entries) == ["CONSTANT_MATCH f.__code__", "EQUALS_MATCH flag"]


WORKER = r"""
import json, sys, torch, convlower
sys.path.insert(0, sys.argv[2])
from test_saved import Net
torch.manual_seed(0)
m, x = Net().eval(), torch.randn(2, 4, 16, 16)
with torch.no_grad():
    f, r = convlower.warmup(m, (x,), options={"select": "always"}, cache_dir=sys.argv[1],
                            iters=0, settle_budget_s=0)
    ok = bool(torch.allclose(f(x), m(x), rtol=1e-5, atol=1e-5))
print("RESULT " + json.dumps({"ok": ok, "state": r.saved.state, "missed": r.saved.missed,
                              "first_s": r.first_step_s, "warnings": r.warnings}))
"""


def _worker(cache) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "CONVLOWER_CACHE_DIR")}
    proc = subprocess.run([sys.executable, "-c", WORKER, str(cache), os.path.dirname(__file__)],
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_a_fresh_process_loads_what_the_first_saved(tmp_path):
    """Then Inductor's generated modules and kernels are corrupted behind the saved compile:
    the third process warns, discards that cache and compiles again."""
    runs = [_worker(tmp_path / "c") for _ in range(2)]
    print(f"\nfirst call: saving process {runs[0]['first_s']:.2f} s, "
          f"loading process {runs[1]['first_s']:.2f} s")
    assert runs[0]["ok"] and runs[1]["ok"]
    assert runs[0]["state"] == "saved" and runs[1]["state"] == "loaded", runs
    assert runs[0]["warnings"] == [] and runs[1]["warnings"] == []
    hit = 0
    for root, _, files in os.walk(tmp_path / "c" / "inductor"):
        for name in files:
            if name.endswith((".py", ".so")):
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(40)
                hit += 1
    assert hit >= 2
    bad = _worker(tmp_path / "c")
    print("warnings with corrupt kernels:", *bad["warnings"], sep="\n  ")
    assert bad["ok"] and any("discarding that cache" in w for w in bad["warnings"]), bad
    assert bad["state"] == "saved", bad  # compiled again and saved in its place
    again = _worker(tmp_path / "c")
    assert again["ok"] and again["state"] == "loaded" and again["warnings"] == [], again
