"""The backend as users meet it: by name, options, delegation, dynamic shapes, real models."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import convlower
from convlower.backend.options import OptionError, parse
from helpers import compare_with_eager, has_conv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_py(code: str, env=None) -> str:
    env = {**os.environ, **(env or {})}
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_backend_by_name_in_fresh_process():
    out = run_py("""
        import sys, torch
        assert "convlower" not in sys.modules
        m = torch.nn.Conv2d(3, 8, 4, stride=4)
        x = torch.randn(2, 3, 8, 8)
        y = torch.compile(m, backend="convlower", options={"select": "always"})(x)
        torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-5)
        import convlower
        print([e["rule"] for e in convlower.report().convolutions])
    """, env={"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    assert "patchify_mm" in out


@pytest.mark.parametrize("bad, names", [
    ({"rulez": "all"}, ["'rulez'", "rules", "select"]),
    ({"rules": ["patch_linear", "nope"]}, ["'nope'", "patch_linear", "patchify_mm"]),
    ({"select": "fastest"}, ["'fastest'", "'measure'", "'heuristic'", "'always'"]),
    ({"snake": 1}, ["1", "'auto'"]),
])
def test_bad_options_name_the_item_and_the_valid_ones(bad, names):
    with pytest.raises(OptionError) as e:
        parse(bad, env={})
    for n in names:
        assert n in str(e.value)


def test_bad_option_through_torch_compile():
    m = torch.compile(torch.nn.Conv2d(3, 4, 2, 2), backend="convlower", options={"rules": "bogus"})
    with pytest.raises(Exception, match="unknown convlower rule 'bogus'"):
        m(torch.randn(1, 3, 4, 4))


def test_env_var_enables_rules_and_option_wins():
    assert parse({}, env={"CONVLOWER_RULES": "patchify_mm"}).rules == ("patchify_mm",)
    assert parse({"rules": "none"}, env={"CONVLOWER_RULES": "patchify_mm"}).rules == ()
    assert parse({"rules": "all"}, env={}).rules[:2] == ("patch_linear", "patchify_mm")
    with pytest.raises(OptionError, match="'x'"):
        parse({}, env={"CONVLOWER_RULES": "x"})


def test_inductor_options_and_mode_pass_through():
    opts = parse({"max_autotune": True}, env={})
    assert dict(opts.inductor) == {"max_autotune": True}
    from convlower import torch_internals as ti

    cfg = ti.inductor_wrapper("max-autotune-no-cudagraphs", {}).config
    assert cfg["max_autotune"] is True and cfg["coordinate_descent_tuning"] is True
    m = torch.nn.Conv2d(3, 4, 2, 2)
    x = torch.randn(1, 3, 4, 4)
    y = torch.compile(m, backend="convlower", mode="max-autotune-no-cudagraphs")(x)
    torch.testing.assert_close(y, m(x))


class NoEligibleConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.nn.functional.gelu(self.conv(x)))


def _code(backend, model, x):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(model, backend=backend), x)
    # the AOT ID line numbers compiles within the process; everything else must be identical
    return ["\n".join(l for l in c.splitlines() if not l.startswith("# AOT ID:")) for c in code]


def test_delegation_generates_the_same_kernels_as_inductor():
    m = NoEligibleConv().eval()
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        ind = _code("inductor", m, x)
        ours = _code("convlower", m, x)
    assert ind == ours
    assert convlower.report().convolutions[0]["rule"] is None


class QwenLikeEmbed(torch.nn.Module):
    def __init__(self, bias=False):
        super().__init__()
        self.proj = torch.nn.Conv3d(3, 32, (2, 14, 14), stride=(2, 14, 14), bias=bias)

    def forward(self, pixels):
        x = pixels.view(-1, 3, 2, 14, 14)
        return self.proj(x).view(-1, 32)


def test_dynamic_patch_count_compiles_once():
    torch.manual_seed(0)
    m = QwenLikeEmbed(bias=True)
    cm = torch.compile(m, backend="convlower", options={"select": "always"})
    from torch._dynamo.utils import counters

    counters.clear()
    for n in (5, 9, 17, 3):
        pixels = torch.randn(n, 3 * 2 * 14 * 14)
        torch._dynamo.mark_dynamic(pixels, 0)  # the patch count varies; the patch size does not
        torch.testing.assert_close(cm(pixels), m(pixels), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    entries = convlower.report().convolutions
    assert entries and all(e["rule"] == "patch_linear" and not e["guards"] for e in entries)


def test_dynamic_spatial_sizes_patchify():
    torch.manual_seed(0)
    m = torch.nn.Conv2d(4, 8, 2, stride=2)
    cm = torch.compile(m, backend="convlower", dynamic=True, options={"select": "always"})
    from torch._dynamo.utils import counters

    counters.clear()
    # Even sizes: the rule itself needs no size fact; the emission's views of symbolic sizes
    # do guard the remainder (size mod 2), and the report lists those guards.
    for h, w in ((8, 10), (12, 6), (10, 14), (16, 16)):
        x = torch.randn(3, 4, h, w, requires_grad=True)
        y = cm(x)
        y.sum().backward()
        g = x.grad
        x.grad = None
        m(x).sum().backward()
        torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g, x.grad, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    entries = convlower.report().convolutions
    assert all(e["rule"] == "patchify_mm" for e in entries)
    assert all(not v["guards"] for e in entries for v in e["verdicts"])  # the proof added none


@pytest.mark.parametrize("which", ["qwen2.5", "qwen3"])
def test_transformers_qwen_patch_embeds(which):
    torch.manual_seed(0)
    if which == "qwen2.5":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionPatchEmbed

        m = Qwen2_5_VisionPatchEmbed(patch_size=14, temporal_patch_size=2, in_channels=3, embed_dim=64)
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed

        cfg = Qwen3VLVisionConfig(patch_size=16, temporal_patch_size=2, in_channels=3, hidden_size=64)
        m = Qwen3VLVisionPatchEmbed(cfg)
    k = m.patch_size
    x = torch.randn(12, 3 * 2 * k * k)
    code = compare_with_eager(m, x, options={})  # default options
    assert not has_conv(code)
    assert {e["rule"] for e in convlower.report().convolutions} == {"patch_linear"}


def test_empty_media_batch_zero_patches():
    m = QwenLikeEmbed(bias=True)
    code = compare_with_eager(m, torch.randn(0, 3 * 2 * 14 * 14))
    assert not has_conv(code)


def test_params_are_the_models_own():
    m = QwenLikeEmbed(bias=True)
    before = {k: v.data_ptr() for k, v in m.state_dict().items()}
    cm = torch.compile(m, backend="convlower")
    x = torch.randn(4, 3 * 2 * 14 * 14)
    cm(x)
    assert {k: v.data_ptr() for k, v in m.state_dict().items()} == before
    with torch.no_grad():  # a LoRA-style in-place update is seen by the compiled model
        m.proj.weight.mul_(2)
    torch.testing.assert_close(cm(x), m(x), rtol=1e-5, atol=1e-5)
