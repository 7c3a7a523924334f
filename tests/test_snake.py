"""Snake: detection in Dynamo graphs, the route decision, the custom op, and real compiles.

HIP cannot run here: the decision is tested as a pure function, and forcing platform="hip"
on CPU bf16 must still produce the eager-safe route (the custom op, no generated sin/cos).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import convlower
from convlower.backend import options as opt
from convlower.device import platform as site_platform
from convlower.backend.snake_pass import canonical, decide_route, match
from convlower.decompositions import snake as snake_op
from helpers import compare_with_eager

from diffusers.models.autoencoders.autoencoder_oobleck import Snake1d as OobleckSnake1d
from transformers.models.dac.modeling_dac import Snake1d as HFDacSnake1d

BF16, F32 = torch.bfloat16, torch.float32
SIN = re.compile(r"\b(sin|cos)\b")


# descript-audio-codec's dac/nn/layers.py spelling (the package is not installed here).
@torch.jit.script
def dac_snake(x, alpha):
    shape = x.shape
    x = x.reshape(shape[0], shape[1], -1)
    x = x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)
    x = x.reshape(shape)
    return x


class DacSnake1d(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x):
        return dac_snake(x, self.alpha)


class Fn(nn.Module):
    """A function of (x, alpha, beta) with its parameters, to capture spellings."""

    def __init__(self, fn, channels=4):
        super().__init__()
        self.fn = fn
        self.alpha = nn.Parameter(torch.rand(1, channels, 1) + 0.5)
        self.beta = nn.Parameter(torch.rand(1, channels, 1) + 0.5)

    def forward(self, x):
        return self.fn(x, self.alpha, self.beta)


def dynamo_graph(module, x) -> torch.fx.GraphModule:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=capture, fullgraph=True)(x)
    assert len(graphs) == 1
    return graphs[0]


def found(module, x=None):
    gm = dynamo_graph(module, torch.randn(2, 4, 8) if x is None else x)
    return [s for s in map(match, gm.graph.nodes) if s is not None]


# ---------------------------------------------------------------------------- detection


@pytest.mark.parametrize("module, variant", [
    (DacSnake1d(4), "alpha+reshaped"),
    (HFDacSnake1d(4), "alpha+reshaped"),
    (OobleckSnake1d(4), "alpha,beta+logscale+reshaped"),
    (OobleckSnake1d(4, logscale=False), "alpha,beta+reshaped"),
], ids=["dac-scripted", "transformers-dac", "oobleck-logscale", "oobleck-plain"])
def test_known_snake_modules_are_found(module, variant):
    sites = found(module)
    assert [s.variant for s in sites] == [variant]
    site = sites[0]
    assert site.x is not site.alpha
    assert (site.alpha is site.beta) == variant.startswith("alpha+")


SPELLINGS = {
    "div-pow-operator": lambda x, a, b: x + 1 / (a + 1e-9) * torch.sin(a * x) ** 2,
    "functions-commuted": lambda x, a, b: torch.square(torch.sin(x * b)) * torch.reciprocal(1e-9 + b) + x,
    "methods-x-times-x": lambda x, a, b: _x_times_x(x, a),
    "torch-pow-float-div": lambda x, a, b: x + torch.pow(torch.sin(a * x), 2.0) * (1.0 / (b + 1e-9)),
    "two-params": lambda x, a, b: x + (b + 1e-9).reciprocal() * torch.sin(a * x).pow(2),
}


def _x_times_x(x, a):
    s = (a * x).sin()
    return x.add((a + 1e-9).reciprocal().mul(s * s))


@pytest.mark.parametrize("name", SPELLINGS)
def test_spellings_are_found(name):
    assert len(found(Fn(SPELLINGS[name]))) == 1


def _shared_sin(x, a, b):
    s = torch.sin(a * x)
    return x + (a + 1e-9).reciprocal() * s.pow(2), s


LOOK_ALIKES = {
    "eps-1e-8": lambda x, a, b: x + (a + 1e-8).reciprocal() * torch.sin(a * x).pow(2),
    "no-eps": lambda x, a, b: x + a.reciprocal() * torch.sin(a * x).pow(2),
    "cos": lambda x, a, b: x + (a + 1e-9).reciprocal() * torch.cos(a * x).pow(2),
    "cube": lambda x, a, b: x + (a + 1e-9).reciprocal() * torch.sin(a * x).pow(3),
    "minus": lambda x, a, b: x - (a + 1e-9).reciprocal() * torch.sin(a * x).pow(2),
    "other-x": lambda x, a, b: (x + 1) + (a + 1e-9).reciprocal() * torch.sin(a * x).pow(2),
    "divided": lambda x, a, b: x + 2 / (a + 1e-9) * torch.sin(a * x).pow(2),
    "sin-reused": _shared_sin,
}


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_look_alikes_are_not_found(name):
    assert found(Fn(LOOK_ALIKES[name])) == []


@pytest.mark.parametrize("fn, rewritten", [
    (SPELLINGS["two-params"], True), (SPELLINGS["methods-x-times-x"], True),
    (LOOK_ALIKES["eps-1e-8"], False), (LOOK_ALIKES["cos"], False),
], ids=["two-params", "x-times-x", "eps-1e-8", "cos"])
def test_rewrite_on_the_dynamo_graph(fn, rewritten):
    # route_snakes alone (no Inductor): the rewritten graph runs eagerly and gives the same values
    from convlower.backend.snake_pass import route_snakes

    graphs = []

    def backend(gm, example_inputs):
        route_snakes(gm, opt.parse({"snake": "eager"}, env={}), "g")
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    m, x = Fn(fn), torch.randn(2, 4, 8)
    out = torch.compile(m, backend=backend, fullgraph=True)(x)
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert (torch.ops.convlower.snake.default in ops) == rewritten
    if rewritten:
        assert torch.sin not in ops  # the whole formula went, not just its last add
    assert len(convlower.report().snake) == int(rewritten)
    torch.testing.assert_close(out, fn(x, m.alpha, m.beta), rtol=0, atol=0)


def test_canonical_spellings():
    g = torch.fx.Graph()
    t = g.placeholder("t")
    assert canonical(g.call_function(torch.pow, (t, 2))) == ("square", (t,))
    assert canonical(g.call_method("pow", (t, 3))) == ("pow", (t, 3))
    assert canonical(g.call_function(torch.mul, (t, t))) == ("square", (t,))
    assert canonical(g.call_function(torch.div, (1.0, t))) == ("reciprocal", (t,))
    assert canonical(g.call_function(torch.add, (t, t), {"alpha": 2})) is None
    assert canonical(g.call_function(torch.cos, (t,))) is None


# ---------------------------------------------------------------------------- decision


@pytest.mark.parametrize("option, platform, dtype, route", [
    ("auto", "hip", BF16, "eager"),
    ("auto", "hip", F32, "fused"),
    ("auto", "hip", torch.float16, "fused"),
    ("auto", "cuda", BF16, "fused"),
    ("auto", "cpu", BF16, "fused"),
    ("eager", "cpu", F32, "eager"),
    ("fused", "hip", BF16, "fused"),
])
def test_decide_route(option, platform, dtype, route):
    got, why = decide_route(option, platform, {dtype})
    assert got == route and why


def test_auto_route_sees_bf16_anywhere_in_the_site():
    assert decide_route("auto", "hip", {F32, BF16})[0] == "eager"


def test_site_platform():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert site_platform("auto", cuda, hip_version="6.2") == "hip"
    assert site_platform("auto", cuda, hip_version=None) == "cuda"
    assert site_platform("auto", cpu, hip_version="6.2") == "cpu"  # ROCm build, CPU tensor
    assert site_platform("hip", cpu, hip_version=None) == "hip"    # forced
    assert site_platform("auto", cpu) == "cpu"


def test_options_from_env():
    o = opt.parse({}, env={"CONVLOWER_SNAKE": "eager", "CONVLOWER_PLATFORM": "hip"})
    assert (o.snake, o.platform) == ("eager", "hip")
    assert opt.parse({"snake": "fused"}, env={"CONVLOWER_SNAKE": "eager"}).snake == "fused"
    with pytest.raises(opt.OptionError, match="auto"):
        opt.parse({"snake": "never"}, env={})


# ---------------------------------------------------------------------------- the custom op


def formula(x, alpha, beta):
    return x + (beta + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def _samples():
    a = torch.rand(1, 4, 1) + 0.5
    yield torch.randn(2, 4, 8), a, torch.rand(1, 4, 1) + 0.5
    yield torch.randn(2, 4, 8), a, a
    yield torch.randn(2, 4, 8, dtype=BF16), a.to(BF16), a.to(BF16)
    yield torch.randn(0, 4, 8), a, a                      # empty batch
    yield torch.randn(2, 8, 4).transpose(1, 2), a, a      # non-contiguous x
    yield torch.randn(2, 4, 8, dtype=BF16), a, a          # bf16 x, fp32 params -> fp32


def test_opcheck():
    for x, a, b in _samples():
        args = (x.requires_grad_(), a.clone().requires_grad_(), b.clone().requires_grad_())
        torch.library.opcheck(torch.ops.convlower.snake.default, args)
        g = torch.randn(torch.broadcast_shapes(x.shape, a.shape), dtype=snake_op.out_dtype(*args))
        # no double backward: the backward op has no autograd formula of its own
        torch.library.opcheck(torch.ops.convlower.snake_backward.default,
                              (g,) + tuple(t.detach() for t in args))


def test_values_and_dtype_match_the_formula():
    for x, a, b in _samples():
        out = torch.ops.convlower.snake(x, a, b)
        ref = formula(x, a, b)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        if ref.dtype == BF16:  # the op computes in fp32: compare with fp32, then with bf16
            torch.testing.assert_close(out, formula(x.float(), a.float(), b.float()).to(BF16))
            torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
        else:  # the same operations in fp32: the same bits
            assert torch.equal(out, ref)


def test_gradients():
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    a = (torch.rand(1, 3, 1, dtype=torch.float64) + 0.5).requires_grad_()
    b = (torch.rand(1, 3, 1, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(torch.ops.convlower.snake, (x, a, b))
    assert torch.autograd.gradcheck(torch.ops.convlower.snake, (x, a, a))  # DAC: beta is alpha
    # and the same gradients as autograd of the formula
    g = torch.randn(2, 3, 5, dtype=torch.float64)
    ours = torch.autograd.grad(torch.ops.convlower.snake(x, a, a), (x, a), g)
    ref = torch.autograd.grad(formula(x, a, a), (x, a), g)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r)


# ---------------------------------------------------------------------------- compiles


class Codec(nn.Module):
    """Conv1d + the three Snake implementations found in the wild."""

    def __init__(self, c=4):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)
        self.dac = DacSnake1d(c)
        self.hf = HFDacSnake1d(c)
        self.oobleck = OobleckSnake1d(c)
        with torch.no_grad():
            for p in (self.dac.alpha, self.hf.alpha, self.oobleck.alpha, self.oobleck.beta):
                p.uniform_(0.5, 1.5) if p is not self.oobleck.beta else p.uniform_(-0.3, 0.3)

    def forward(self, x):
        return self.oobleck(self.hf(self.dac(self.conv(x))))


def _code(code):
    return "\n".join(code)


def compare_bf16(module, x, options):
    """bf16 through a chain of Snakes drifts far beyond a 2e-2 tolerance even in eager, so
    "within bf16 tolerance" is: about as far from an fp64 run (same bf16-rounded weights and
    input) as eager bf16 is.  Returns the generated code."""
    import copy

    from torch._inductor.utils import run_and_get_code

    from helpers import clone_leaf, run_fwd_bwd

    module, x = module.to(BF16), x.to(BF16)

    def run(dtype, compiled=False):
        m, xx = copy.deepcopy(module).to(dtype), clone_leaf(x.to(dtype), True)
        if not compiled:
            return run_fwd_bwd(m, xx), None
        m = torch.compile(m, backend="convlower", options=options)
        return run_and_get_code(lambda: run_fwd_bwd(m, xx))

    (ref, ref_g), _ = run(torch.float64)
    (eager, eager_g), _ = run(BF16)
    (ours, ours_g), code = run(BF16, compiled=True)
    assert ours.dtype == BF16 and ours.shape == ref.shape
    for k, r, e, o in [("out", ref, eager, ours)] + [(k, ref_g[k], eager_g[k], ours_g[k]) for k in ref_g]:
        err_eager = (e.double() - r).abs().max().item()
        err_ours = (o.double() - r).abs().max().item()
        # bf16 noise compounds chaotically through the chain; a wrong formula is off by O(1)
        assert err_ours <= 2 * err_eager + 0.02 * r.abs().max().item(), (k, err_ours, err_eager)
    return code


def test_forced_hip_bf16_runs_snake_as_the_custom_op():
    torch.manual_seed(0)
    code = compare_bf16(Codec(), torch.randn(2, 4, 16), options={"platform": "hip"})
    fwd, bwd = code[0], code[-1]
    assert fwd.count("torch.ops.convlower.snake.default(") == 3
    assert "torch.ops.convlower.snake_backward.default(" in bwd
    assert not SIN.search(_code(code)), "a generated kernel computes sin/cos"
    sites = convlower.report().snake
    assert [s["route"] for s in sites] == ["eager"] * 3
    assert all("HIP" in s["why"] and s["dtype"] == "bfloat16" for s in sites)
    assert "snake sites:" in str(convlower.report())


@pytest.mark.parametrize("dtype, options", [(F32, {"platform": "hip"}), (BF16, {})],
                         ids=["hip-fp32", "cpu-bf16"])
def test_fused_elsewhere(dtype, options):
    torch.manual_seed(0)
    if dtype == BF16:
        code = compare_bf16(Codec(), torch.randn(2, 4, 16), options)
    else:
        code = compare_with_eager(Codec(), torch.randn(2, 4, 16), options=options)
    assert "convlower.snake" not in _code(code)
    assert SIN.search(_code(code)), "Inductor should have fused the Snake (sin in generated code)"
    assert [s["route"] for s in convlower.report().snake] == ["fused"] * 3


def test_eager_route_dynamic_and_non_contiguous():
    torch.manual_seed(0)
    x = torch.randn(3, 12, 4).transpose(1, 2)  # (3, 4, 12), not contiguous
    code = compare_with_eager(OobleckSnake1d(4, logscale=False), x,
                              options={"snake": "eager"}, dynamic=True)
    assert "torch.ops.convlower.snake.default(" in code[0] and not SIN.search(_code(code))
    assert convlower.report().snake[0]["route"] == "eager"


def test_custom_op_keeps_inductor_and_aot_caches(tmp_path):
    # caches are off in-process (conftest); a subprocess compiles twice into a fresh cache dir
    script = textwrap.dedent("""
        import json, torch, convlower
        from torch._dynamo.utils import counters
        from transformers.models.dac.modeling_dac import Snake1d
        m, x = Snake1d(4), torch.randn(2, 4, 8)
        for _ in range(2):
            torch._dynamo.reset()
            # AOTAutograd saves a training entry once its backward is compiled
            torch.compile(m, backend="convlower", options={"snake": "eager"})(x).sum().backward()
        print(json.dumps({"inductor": dict(counters["inductor"]),
                          "aot": dict(counters["aot_autograd"]),
                          "routes": [s["route"] for s in convlower.report().snake]}))
    """)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["routes"] == ["eager"] * 2  # routed on the Dynamo graph, before the cache lookup
    assert got["inductor"].get("fxgraph_cache_bypass", 0) == 0, got
    assert got["inductor"].get("fxgraph_cache_hit", 0) >= 2, got  # forward and backward
    assert got["aot"].get("autograd_cache_bypass", 0) == 0, got
    assert got["aot"].get("autograd_cache_hit", 0) >= 1, got
