"""Compiled parts called straight into Inductor's code on inference calls (torch_direct.py)."""
import pytest
import torch
from torch import nn
from torch._inductor.output_code import CompiledFxGraph

import convlower
from convlower import torch_direct
from convlower.backend.options import OptionError, parse
from convlower.regions.partition import writes_in_place

from helpers import assert_close

pytestmark = pytest.mark.usefixtures("fresh_regions")


class Block(nn.Module):
    def __init__(self, dim, in_place=False):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2, self.fc3 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim), nn.Linear(dim, dim)
        self.in_place = in_place

    def forward(self, x):
        h = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        if self.in_place:
            h.mul_(0.5)
        return x + self.fc3(torch.nn.functional.silu(h))


class Stack(nn.Module):
    def __init__(self, in_place=False):
        super().__init__()
        self.blocks = nn.ModuleList([Block(16, in_place) for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return torch.tanh(x)


def _graph_calls(monkeypatch) -> list:
    """Counts calls of any Inductor compiled graph through its usual ``__call__``."""
    calls: list = []
    original = CompiledFxGraph.__call__

    def counted(self, inputs):
        calls.append(self)
        return original(self, inputs)

    monkeypatch.setattr(CompiledFxGraph, "__call__", counted)
    return calls


def _compiled(model):
    return torch.compile(model, backend="convlower", options={"regions": ["Block"]})


def test_inference_calls_after_the_first_run_no_wrapper(monkeypatch):
    torch.manual_seed(0)
    model, x = Stack().eval(), torch.randn(2, 5, 16)
    compiled = _compiled(model)
    with torch.no_grad():
        first = compiled(x)
        calls = _graph_calls(monkeypatch)
        later = [compiled(x) for _ in range(2)]
        eager = model(x)
    assert calls == []   # every part went straight to its generated code
    for out in (first, *later):
        assert_close(out, eager)
    parts = [r for r in convlower.report().regions if r.signature]
    assert parts and all(r.direct is True for r in parts)
    assert f"{len(parts)} of {len(parts)} parts called so far straight" in str(convlower.report())


def test_training_calls_keep_the_wrappers(monkeypatch):
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(2, 5, 16, requires_grad=True)
    compiled = _compiled(model)
    compiled(x).sum().backward()
    calls = _graph_calls(monkeypatch)
    out = compiled(x)
    assert len(calls) >= 3   # forward graphs of the parts, through AOTAutograd
    out.sum().backward()


def test_a_part_that_writes_in_place_keeps_the_wrappers(monkeypatch):
    torch.manual_seed(0)
    model, x = Stack(in_place=True).eval(), torch.randn(2, 5, 16)
    compiled = _compiled(model)
    with torch.no_grad():
        compiled(x)
        calls = _graph_calls(monkeypatch)
        out = compiled(x)
        eager = model(x)
    assert len(calls) >= 3
    assert_close(out, eager)
    assert [r.direct for r in convlower.report().regions if r.block == "Block"] == [False] * 3


def test_part_calls_wrapped_keeps_the_wrappers(monkeypatch):
    torch.manual_seed(0)
    model, x = Stack().eval(), torch.randn(2, 5, 16)
    compiled = torch.compile(model, backend="convlower",
                             options={"regions": ["Block"], "part_calls": "wrapped"})
    with torch.no_grad():
        compiled(x)
        calls = _graph_calls(monkeypatch)
        compiled(x)
    assert len(calls) >= 3
    assert not any(r.direct for r in convlower.report().regions)
    with pytest.raises(OptionError, match="part_calls"):
        parse({"part_calls": "fast"})


class _Graph:
    cudagraph_info = None

    def current_callable(self, args):
        return args


def _seen(given, returned, graph=None):
    return [(graph or _Graph(), given, returned)]


def test_the_direct_call_is_refused_where_a_wrapper_did_something():
    a, b = torch.randn(2), torch.randn(2)
    out = [a * 2]
    graph = _Graph()
    v = torch_direct._versions((a, b))

    def direct(seen, args, outs, versions=v):
        return torch_direct._direct(seen, args, outs, versions)

    with torch.no_grad():
        assert direct([(graph, [a, b], out)], (a, b), out) == graph.current_callable
        assert direct(_seen([a.detach(), b], out), (a, b), out) is None  # detached
        assert direct(_seen([a, b, 7], out), (a, b), out) is None   # a seed, a token
        assert direct(_seen([a], out), (a, a), out) is None          # deduplicated
        assert direct(_seen([a, b], [out[0] + 0]), (a, b), out) is None  # regenerated
        assert direct(_seen([a, b], out) * 2, (a, b), out) is None   # two graphs ran
        assert direct([], (a, b), out) is None
        assert direct(_seen([a, 3], out), (a, 3), out, v[:1]) is None   # a size argument
        cuda_graphs = _Graph()
        cuda_graphs.cudagraph_info = object()
        assert direct(_seen([a, b], out, cuda_graphs), (a, b), out) is None

        class Unknown:   # a torch whose compiled graphs say nothing about CUDA graphs
            current_callable = _Graph.current_callable
        assert direct(_seen([a, b], out, Unknown()), (a, b), out) is None
        for mark in ("_dynamo_dynamic_indices", "_dynamo_propagated_dynamic_indices"):
            marked = [a * 3]
            setattr(marked[0], mark, {0})
            assert direct(_seen([a, b], marked), (a, b), marked) is None
        b.add_(1)   # the wrapper bumped a mutated input's version
        assert direct(_seen([a, b], out), (a, b), out) is None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert direct(_seen([a, b], out), (a, b), out, torch_direct._versions((a, b))) is None
    assert direct(_seen([a, b], out), (a, b), out, torch_direct._versions((a, b))) is None  # grad


def test_inference_tensors_have_no_version_to_compare():
    with torch.inference_mode():
        x = torch.randn(2)
    w = torch.randn(2)
    assert torch_direct._versions((x, w, 3)) == [None, w._version]


def test_autocast_and_dynamic_sizes_keep_the_wrappers(monkeypatch):
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(2, 5, 16)
    for autocast, dynamic in ((True, False), (False, True)):
        compiled = torch.compile(model, backend="convlower", dynamic=dynamic,
                                 options={"regions": ["Block"]})
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            compiled(x)
            calls = _graph_calls(monkeypatch)
            out = compiled(x)
            eager = model(x)
        assert len(calls) >= 3, (autocast, dynamic)
        assert_close(out.float(), eager.float(), rel=2e-2 if autocast else None)
        monkeypatch.undo()
        torch._dynamo.reset()


def test_first_call_with_grad_on_or_writes_in_place_never_records():
    ran: list = []

    def fn(*args):
        ran.append(args)
        return [args[0] + 1]

    x = torch.randn(2)
    with torch.no_grad():
        out, direct = torch_direct.first_call(fn, (x,), wrapped=True)
    assert direct is None and torch.equal(out[0], x + 1)
    with torch.enable_grad():
        assert torch_direct.first_call(fn, (x,), wrapped=False)[1] is None
    with torch.no_grad():   # no compiled graph ran inside: nothing to call straight
        assert torch_direct.first_call(fn, (x,), wrapped=False)[1] is None
    assert len(ran) == 3
    assert CompiledFxGraph.__call__ is not torch_direct._spy   # the spy is gone again


def _dynamo_graph(fn, *args) -> torch.fx.GraphModule:
    graphs: list = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True)(*args)
    return graphs[0]


def _set_first(x):
    x[0] = 1.0
    return x * 2


def _add_in_place(x):
    x += 1
    return x * 2


class _InPlaceReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(x * 2) + 1


def _batch_norm_training(x):
    return torch.nn.functional.batch_norm(x.view(3, 1), torch.zeros(1), torch.ones(1),
                                          training=True) * 2


@pytest.mark.parametrize("fn, writes", [
    (_InPlaceReLU(), True),
    (lambda x: torch.ops.aten.add_.Tensor(x, x) * 2, True),
    (lambda x: x.__iadd__(x) * 2, True),
    (_batch_norm_training, True),
    (lambda x: torch.relu(x) * 2, False),
    (lambda x: x.add_(1) * 2, True),
    (lambda x: torch.nn.functional.relu(x, inplace=True) * 2, True),
    (lambda x: torch.nn.functional.relu(x, True) * 2, True),
    (lambda x: torch.sin(x, out=torch.empty(3)) * 2, True),
    (_set_first, True),
    (_add_in_place, True),
])
def test_writes_in_place(fn, writes):
    assert writes_in_place(_dynamo_graph(fn, torch.randn(3))) is writes

