"""Inductor's FX graph cache and the AOTAutograd cache: reused across processes under the same
convlower settings, never reused across different settings."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, sys, torch
from torch._dynamo.utils import counters
import convlower
opts = json.loads(sys.argv[1])
torch.manual_seed(0)
m = torch.nn.Conv3d(3, 16, (2, 4, 4), stride=(2, 4, 4))
x = torch.randn(4, 3, 2, 4, 4, requires_grad=True)
cm = torch.compile(m, backend="convlower", options=opts)
y = cm(x)
y.sum().backward()
ref = m(x)
torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
print(json.dumps({
    "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
    "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
    "fx_bypass": counters["inductor"]["fxgraph_cache_bypass"],
    "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
    "aot_miss": counters["aot_autograd"]["autograd_cache_miss"],
    "aot_bypass": counters["aot_autograd"]["autograd_cache_bypass"],
    "rules": sorted({e["rule"] or "-" for e in convlower.report().convolutions}),
}))
"""


def run(opts, cache_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_FORCE")}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache_dir), CONVLOWER_CACHE_DIR=str(cache_dir / "cl"))
    res = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(opts)], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_cache_reused_across_processes_and_separated_by_settings(tmp_path):
    a = {"select": "always"}
    first = run(a, tmp_path)
    assert first["fx_miss"] >= 2 and first["fx_hit"] == 0 and first["aot_miss"] >= 1
    assert first["fx_bypass"] == 0 and first["aot_bypass"] == 0
    assert first["rules"] == ["patch_linear"]

    second = run(a, tmp_path)  # same settings: both caches hit, nothing recompiled
    assert second["aot_hit"] >= 1 and second["fx_miss"] == 0 and second["aot_miss"] == 0

    other = run({"select": "always", "rules": "none"}, tmp_path)  # other settings: no reuse
    assert other["aot_hit"] == 0 and other["fx_hit"] == 0 and other["aot_miss"] >= 1
    assert other["rules"] == ["-"]

    again = run({"select": "always", "rules": ["patchify_mm"]}, tmp_path)
    assert again["aot_hit"] == 0 and again["fx_hit"] == 0
    assert again["rules"] == ["patchify_mm"]


def test_version_change_invalidates(tmp_path, monkeypatch):
    from convlower.backend.conv_pass import ConvLowerPass
    from convlower.backend.options import parse

    import convlower.backend.conv_pass as gp

    opts = parse({}, env={})
    before = ConvLowerPass(opts).uuid()
    monkeypatch.setattr(gp, "__version__", "999.0")
    assert ConvLowerPass(opts).uuid() != before
    assert ConvLowerPass(parse({"rules": "none"}, env={})).uuid() != ConvLowerPass(opts).uuid()
