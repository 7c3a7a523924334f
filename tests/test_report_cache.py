"""Per-conv records survive Inductor's FX graph cache and the AOTAutograd cache: a second
process served from the caches reports the same lowered convolutions, marked from cache; a
corrupt or missing record file gives a warning and "details unavailable", never a wrong record,
and the compile still works.  (Caches are tested in subprocesses: conftest turns them off.)"""
import json
import os
import stat
import subprocess
import sys
import warnings

import pytest

from convlower.observe import persist
from convlower.observe.records import ConvRecord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, sys, warnings, torch
import convlower
warnings.simplefilter("always")
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 4, stride=4), torch.nn.ReLU(),
                        torch.nn.Conv2d(16, 8, 1))
x = torch.randn(2, 3, 16, 16, requires_grad=True)
cm = torch.compile(m, backend="convlower", options={"select": "always"})
with warnings.catch_warnings(record=True) as caught:
    y = cm(x)
    y.sum().backward()
torch.testing.assert_close(y, m(x))
rep = convlower.report()
print(json.dumps({
    "convs": [{k: c[k] for k in ("graph", "phase", "node", "rule", "reason", "guards",
                                 "from_cache", "call")} for c in rep.convolutions],
    "warnings": [str(w.message) for w in caught],
    "text": str(rep)}))
"""


def run(cache_dir, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_FORCE")}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache_dir), CONVLOWER_CACHE_DIR=str(cache_dir / "cl"),
               **env_extra)
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _key(c):
    return (c["graph"], c["phase"], c["node"], c["rule"], c["reason"], tuple(c["guards"]),
            json.dumps(c["call"], sort_keys=True))


def test_second_process_reports_the_cached_convs(tmp_path):
    first = run(tmp_path)
    assert not any(c["from_cache"] for c in first["convs"])
    lowered = sorted((c["phase"], c["node"], c["rule"]) for c in first["convs"])
    assert lowered == [("backward", "convolution_backward", "patchify_mm"),
                       ("backward", "convolution_backward_1", "patchify_mm"),
                       ("forward", "convolution", "patchify_mm"),
                       ("forward", "convolution_1", "patchify_mm")]
    files = list((tmp_path / "cl" / persist.SUBDIR).iterdir())
    assert len(files) == 2  # one per cached FX graph: forward, backward
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert stat.S_IMODE((tmp_path / "cl" / persist.SUBDIR).stat().st_mode) == 0o700

    second = run(tmp_path)  # AOTAutograd cache hit: forward and backward FX entries loaded
    assert all(c["from_cache"] for c in second["convs"]), second["convs"]
    assert sorted(map(_key, second["convs"])) == sorted(map(_key, first["convs"]))
    assert "from" in second["text"] and "cache" in second["text"]
    assert not [w for w in second["warnings"] if "convlower" in w]

    fx_only = run(tmp_path, TORCHINDUCTOR_AUTOGRAD_CACHE="0")  # FX graph cache hits alone
    assert all(c["from_cache"] for c in fx_only["convs"]), fx_only["convs"]
    assert sorted(map(_key, fx_only["convs"])) == sorted(map(_key, first["convs"]))


def test_corrupt_record_file_warns_and_compiles(tmp_path):
    run(tmp_path)
    files = sorted((tmp_path / "cl" / persist.SUBDIR).iterdir())
    files[0].write_text("{ not json")
    files[1].write_text(json.dumps({"format": persist.FORMAT, "fx_key": "another graph",
                                    "guards": "", "records": []}))
    second = run(tmp_path)  # the script itself checks the compiled values
    convs = second["convs"]
    assert {c["phase"] for c in convs} == {"forward", "backward"}
    assert all(c["from_cache"] and c["rule"] is None for c in convs), convs
    assert all(c["reason"].startswith(persist.UNAVAILABLE) for c in convs), convs
    assert sum("details unavailable" in w for w in second["warnings"]) == 2, second["warnings"]


# -- the record files themselves (no compile) ------------------------------------------------
def _rec(**kw):
    return ConvRecord("graph3", "forward", "convolution", {"input": ["2", "3", "8", "8"]},
                      rule="patchify_mm", guards=["g"], **kw)


def test_roundtrip_renames_the_graph_and_marks_from_cache(tmp_path):
    persist.note_pass("graph3", [_rec()])
    path = persist.save(str(tmp_path), "fxkey", "L['x'].size()[0] == 2")
    assert path and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert persist.save(str(tmp_path), "fxkey", "") is None  # nothing pending any more
    (rec,) = persist.load(str(tmp_path), "fxkey", "L['x'].size()[0] == 2", "graph9", "forward")
    assert rec.graph == "graph9" and rec.from_cache and rec.rule == "patchify_mm"
    assert rec.guards == ["g"] and rec.call == {"input": ["2", "3", "8", "8"]}


@pytest.mark.parametrize("guards", ["", "other guards"])
def test_another_entry_is_never_served(tmp_path, guards):
    persist.note_pass("graph3", [_rec()])
    persist.save(str(tmp_path), "fxkey", "some guards")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (rec,) = persist.load(str(tmp_path), "fxkey", guards, "graph9", "backward")
    assert rec.rule is None and rec.phase == "backward" and rec.from_cache
    assert rec.reason.startswith(persist.UNAVAILABLE)
    assert any("details unavailable" in str(w.message) for w in caught)


def test_a_record_file_written_for_another_key_is_refused(tmp_path):
    persist.note_pass("graph3", [_rec()])
    path = persist.save(str(tmp_path), "fxkey", "")
    os.replace(path, persist.path_of(str(tmp_path), "otherkey", ""))  # misplaced file
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        (rec,) = persist.load(str(tmp_path), "otherkey", "", "graph9", "forward")
    assert rec.rule is None and "another cache entry" in rec.reason
