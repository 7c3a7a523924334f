"""convlower.warmup: the result object, dynamic dims, and persistent caches across processes
(cold then warm), including corrupt, truncated and foreign cache entries.

Cross-process checks assert on cache-hit counters and the ``warm`` flag, never on times (the
times are printed)."""
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch

import convlower
from convlower.tools import session_cache as sc
from convlower.tools import warmup as wu

WORKER = r"""
import json, sys, torch, convlower
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 2, 2), torch.nn.ReLU())
x = torch.randn(2, 4, 16, 16)
with torch.no_grad():
    f, r = convlower.warmup(m, (x,), options={"select": "always"}, cache_dir=sys.argv[1], iters=1,
                            save_compiled=False)  # Inductor's caches (the saved compile: test_saved)
    ok = bool(torch.allclose(f(x), m(x), rtol=1e-5, atol=1e-5))
d = r.to_dict()
from convlower.backend.conv_pass import ConvLowerPass
from convlower.backend.options import parse
uuid = ConvLowerPass(parse({"select": "always"})).uuid()
print("RESULT " + json.dumps({"ok": ok, "uuid": uuid, "cache": d["cache"], "warm": d["warm"],
      "compile_s": d["compile_s"], "counts": d["cache_counts"], "warnings": d["warnings"],
      "compiles": [c["cache"] for c in d["compiles"]],
      "rewrites": d["statistics"]["rewrites"]}))
"""


def _run_worker(cache_dir) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FORCE_DISABLE_CACHES",
                        "CONVLOWER_CACHE_DIR", "TORCHINDUCTOR_VEC_ISA_OK")}  # a user's setup
    proc = subprocess.run([sys.executable, "-c", WORKER, str(cache_dir)], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    cache = tmp_path_factory.mktemp("warmup") / "cache"
    cold = _run_worker(cache)
    warm = _run_worker(cache)
    print(f"\nwarm-up compile: cold {cold['compile_s']:.2f} s, warm {warm['compile_s']:.2f} s")
    return cache, cold, warm


def test_second_process_reports_warm_cache(two_processes):
    _, cold, warm = two_processes
    assert cold["ok"] and warm["ok"]
    assert cold["uuid"] == warm["uuid"], "convlower's sources changed between the two processes"
    assert cold["cache"] == "cold" and not cold["warm"]
    assert cold["counts"]["fx_graph_miss"] >= 1 and cold["counts"]["fx_graph_hit"] == 0
    assert warm["cache"] == "warm" and warm["warm"]
    assert warm["counts"]["fx_graph_hit"] >= 1 and warm["counts"]["fx_graph_miss"] == 0
    # the per-compile statistics agree with the counters
    assert sum(c["fx_graph_miss"] for c in cold["compiles"]) >= 1
    assert sum(c["fx_graph_hit"] + c["aot_autograd_hit"] for c in warm["compiles"]) >= 1
    assert cold["rewrites"] == {"patchify_mm": 1}
    assert cold["warnings"] == [] and warm["warnings"] == []


def test_cache_files_are_owner_only(two_processes):
    cache, _, _ = two_processes
    for path in (cache, cache / "inductor", cache / "convlower", cache / sc.ARTIFACTS):
        assert os.stat(path).st_mode & 0o077 == 0, path


def _truncate(path, keep=40):
    with open(path, "rb") as f:
        data = f.read(keep)
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("what", ["everything", "modules"])
def test_corrupt_cache_warns_and_still_compiles(two_processes, tmp_path, what):
    """everything: artifacts, Inductor's cache entries, generated modules and kernels, rule
    decisions.  modules: only the generated modules and kernels, behind valid cache entries
    (Inductor fails on those; warm-up discards the Inductor cache and compiles again)."""
    cache, _, warm = two_processes
    bad = tmp_path / "cache"
    shutil.copytree(cache, bad)
    hit = 0
    for root, _, files in os.walk(bad / "inductor"):
        for name in files:
            entry = "fxgraph" in root or "aotautograd" in root
            if name.endswith((".py", ".so")) or (entry and what == "everything"):
                _truncate(os.path.join(root, name))
                hit += 1
    assert hit >= 3
    if what == "everything":
        (bad / sc.ARTIFACTS).write_bytes(b"not a cache")
        files = [p for p in (bad / "convlower").rglob("*") if p.is_file()]
        assert files, "the warm-up left no convlower cache files to corrupt"
        for path in files:
            path.write_text("{ truncated")
    r = _run_worker(bad)
    print(f"\nwarnings with a corrupt cache ({what}):", *r["warnings"], sep="\n  ")
    assert r["ok"]
    assert r["uuid"] == warm["uuid"], "convlower's sources changed between the processes"
    if what == "everything":
        assert any("ignoring cache artifacts" in w for w in r["warnings"]), r["warnings"]
    else:
        assert any("discarding that cache" in w for w in r["warnings"]), r["warnings"]


def _artifacts_file(path, meta_overrides=None, payload=b"payload", cut=0):
    import hashlib

    meta = dict(sc._header(), size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    meta.update(meta_overrides or {})
    data = sc._MAGIC + json.dumps(meta).encode() + b"\n" + payload
    path.write_bytes(data[:len(data) - cut])


@pytest.mark.parametrize("case,expect", [
    ("foreign", "written for torch"), ("truncated", "truncated or corrupt"),
    ("not_ours", "not a convlower"), ("bad_header", "JSONDecodeError")])
def test_bad_artifacts_are_ignored_with_a_warning(tmp_path, case, expect):
    path = tmp_path / sc.ARTIFACTS
    if case == "foreign":
        _artifacts_file(path, {"torch": "1.0.0"})
    elif case == "truncated":
        _artifacts_file(path, cut=3)
    elif case == "not_ours":
        path.write_bytes(b"\x80\x04garbage")
    else:
        path.write_bytes(sc._MAGIC + b"{not json\npayload")
    warns = sc.Warnings()
    with pytest.warns(RuntimeWarning, match=expect):
        assert sc.load_artifacts(str(path), warns) is False
    assert len(warns) == 1 and expect in warns[0]


def test_missing_artifacts_are_silent(tmp_path):
    warns = sc.Warnings()
    assert sc.load_artifacts(str(tmp_path / "absent.bin"), warns) is False
    assert warns == []


def test_directory_writable_by_others_is_refused(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(sc.UnsafeCacheDir, match="writable by others .*chmod 700"):
        sc.private_dir(str(d), sc.Warnings())
    m = torch.nn.Conv2d(4, 8, 2, 2)
    with pytest.raises(PermissionError, match="refusing cache directory"):
        convlower.warmup(m, torch.randn(1, 4, 8, 8), cache_dir=str(d), iters=0)
    new = tmp_path / "new"
    sc.private_dir(str(new), sc.Warnings())
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o700


def test_warmup_result_with_backward():
    torch.manual_seed(0)
    m = torch.nn.Conv2d(4, 8, 2, 2)
    x = torch.randn(2, 4, 8, 8)
    with torch._inductor.config.patch(force_disable_caches=True):
        f, r = convlower.warmup(m, x, options={"select": "always"}, iters=2, backward=True)
    assert r.cache == "disabled"
    assert len(r.eager_steps_s) == 2 and len(r.compiled_steps_s) == 2
    assert r.first_step_s >= r.compile_s >= 0
    assert r.amortization is not None and r.verdict == r.amortization.verdict
    assert r.statistics["rewrites"] == {"patchify_mm": 2}  # forward and backward
    assert [c["phase"] for c in r.compiles] == ["forward", "backward"]
    assert all(p.grad is None for p in m.parameters())  # warm-up leaves no gradients
    assert "verdict:" in str(r)
    json.dumps(r.to_dict())
    with torch.no_grad():
        torch.testing.assert_close(f(x), m(x))


def test_dynamic_dims_do_not_recompile():
    m = torch.nn.Conv2d(4, 8, 2, 2)
    with torch.no_grad():
        f, r = convlower.warmup(m, torch.randn(2, 4, 8, 8), dynamic={0: 0}, iters=0)
        assert r.amortization is None and r.compiled_steps_s == []
        before = len(convlower.report().compiles)
        x = torch.randn(5, 4, 8, 8)
        torch.testing.assert_close(f(x), m(x))
        assert len(convlower.report().compiles) == before  # batch 5 reused the graph
