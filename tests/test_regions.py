"""Regions (convlower/regions): each repeated block compiled once, called for every instance."""
import collections
import re

import pytest
import torch
from torch import nn

import convlower
from convlower import regions
from convlower.backend.options import OptionError, parse

from helpers import assert_close, compare_with_eager

pytestmark = pytest.mark.usefixtures("fresh_regions")  # no parts compiled by other tests


class Block(nn.Module):
    """Ten graph nodes: over regions.blocks.MIN_AUTO_NODES, so "auto" may take it."""

    def __init__(self, dim):
        super().__init__()
        self.norm, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.fc3, self.fc4 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        return x + self.fc4(torch.nn.functional.silu(self.fc3(self.norm2(x))))


class Stack(nn.Module):
    """Three identical blocks, one of another width between projections."""

    def __init__(self, dim=16, wide=24, hook=False):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(3)])
        self.up, self.wide, self.down = nn.Linear(dim, wide), Block(wide), nn.Linear(wide, dim)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.down(self.wide(self.up(x)))


def _parts():
    return collections.Counter((r["block"], r["how"]) for r in convlower.report().to_dict()["regions"])


def _compile(model, regions_setting="auto", **opts):
    return torch.compile(model, backend="convlower", options={"regions": regions_setting, **opts})


def test_auto_compiles_a_repeated_block_once_and_leaves_a_unique_one_in_the_glue():
    m, x = Stack().eval(), torch.randn(2, 5, 16)
    with torch.no_grad():
        out = _compile(m)(x)
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
    parts = _parts()
    assert parts[("Block", "compiled")] == 1 and parts[("Block", "reused")] == 2, parts
    assert sum(n for (block, _), n in parts.items() if block == "Block") == 3  # not the wide one
    assert parts[("(glue)", "compiled")] >= 1


class MostlyUnique(nn.Module):
    """Two identical blocks beside a larger computation that does not repeat."""

    def __init__(self, dim=16):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(2)])
        self.unique = nn.ModuleList([nn.Linear(dim, dim) for _ in range(30)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        for i, lin in enumerate(self.unique):
            x = torch.tanh(lin(x)) if i % 2 else torch.sigmoid(lin(x))
        return x


def test_auto_compiles_whole_a_graph_whose_repeats_are_a_small_share_of_it():
    m, x = MostlyUnique().eval(), torch.randn(2, 5, 16)
    assert regions.blocks.MIN_AUTO_NODES <= 10
    with torch.no_grad():
        out = _compile(m)(x)
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
    recs = convlower.report().to_dict()["regions"]
    assert [r["block"] for r in recs] == ["(whole graph)"], recs
    share = re.search(r"compiled whole: repeated instances are (\d+)% of its nodes", recs[0]["how"])
    assert share and 5 <= int(share.group(1)) < 100 * regions.MIN_AUTO_SHARED, recs  # 1 of 2+60
    assert "compiled whole" in str(convlower.report())
    convlower.reset_report()
    with torch.no_grad():  # a list of classes is taken as given
        torch.testing.assert_close(_compile(m, ["Block"])(x), m(x), rtol=1e-5, atol=1e-5)
    assert _parts()[("Block", "reused")] == 1


def test_same_class_with_other_shapes_never_shares_code():
    m, x = Stack().eval(), torch.randn(2, 5, 16)
    with torch.no_grad():
        out = _compile(m, ["Block"])(x)
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
    recs = [r for r in convlower.report().to_dict()["regions"] if r["block"] == "Block"]
    assert len(recs) == 4
    assert len({r["signature"] for r in recs}) == 2  # the wide block has its own
    assert [r["how"] for r in recs].count("compiled") == 2


def test_a_hook_on_one_instance_gives_it_its_own_code_and_is_honoured():
    m, x = Stack().eval(), torch.randn(2, 5, 16)
    m.blocks[1].register_forward_hook(lambda mod, args, out: out * 2.0)
    with torch.no_grad():
        out = _compile(m, ["Block"])(x)
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
    sigs = [r["signature"] for r in convlower.report().to_dict()["regions"] if r["block"] == "Block"]
    assert sigs[0] == sigs[2] and sigs[1] != sigs[0], sigs


def test_new_weights_after_compile_are_used_without_a_recompile():
    m, x = Stack().eval(), torch.randn(2, 5, 16)
    compiled = _compile(m)
    with torch.no_grad():
        compiled(x)
        before = len(convlower.report().to_dict()["regions"])
        new = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
        m.load_state_dict(new)
        m.blocks[2].fc1.weight.mul_(3.0)  # a LoRA-style in-place update of one instance
        assert_close(compiled(x), m(x), rel=1e-5)
    assert len(convlower.report().to_dict()["regions"]) == before  # nothing compiled again


def test_training_through_regions_matches_eager():
    compare_with_eager(Stack(), torch.randn(2, 5, 16), options={"regions": "auto"}, rel=1e-5)
    assert _parts()[("Block", "reused")] == 2


class BreakInside(Block):
    def forward(self, x):
        y = self.fc1(self.norm(x))
        torch._dynamo.graph_break()
        return super().forward(x + self.fc2(torch.nn.functional.gelu(y)))


class Broken(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.a, self.b, self.c, self.d = (Block(dim) for _ in range(4))
        self.e, self.f = BreakInside(dim), BreakInside(dim)

    def forward(self, x):
        x = self.b(self.a(x))
        torch._dynamo.graph_break()  # between blocks: two graphs, one compiled block
        return self.f(self.e(self.d(self.c(x))))


def test_graph_breaks_between_and_inside_blocks():
    compare_with_eager(Broken(), torch.randn(2, 5, 16), options={"regions": "auto"}, rel=1e-5)
    parts = _parts()
    # a, b in the first graph, c, d in the second: one compile serves all four
    assert parts[("Block", "compiled")] == 1 and parts[("Block", "reused")] == 3, parts


def test_dynamic_batch_does_not_multiply_compiles_per_instance():
    m = Stack().eval()
    compiled = torch.compile(m, backend="convlower", options={"regions": "auto"}, dynamic=True)
    with torch.no_grad():
        for batch in (2, 3, 5):
            x = torch.randn(batch, 5, 16)
            torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-5)
    parts = _parts()
    assert parts[("Block", "compiled")] == 1, parts  # one symbolic compile serves all batches


def test_a_model_without_repeated_blocks_is_compiled_whole():
    m, x = Block(16).eval(), torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(_compile(m)(x), m(x), rtol=1e-5, atol=1e-5)
    assert convlower.report().to_dict()["regions"] == []


class ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(4, 4, 2, stride=2)  # kernel == stride: patchify_mm
        self.norm = nn.GroupNorm(2, 4)

    def forward(self, x):
        y = torch.nn.functional.interpolate(self.patch(self.norm(x)), scale_factor=2.0)
        return torch.sigmoid(y) * x + torch.tanh(y) - x.mean() * 0.5 + 1.0


def test_conv_rules_apply_inside_regions():
    m = nn.Sequential(ConvBlock(), ConvBlock(), ConvBlock())
    compare_with_eager(m, torch.randn(1, 4, 8, 8), options={"regions": "auto", "select": "always"},
                       rel=1e-5)
    report = convlower.report()
    assert {c.rule for c in report.convolutions} == {"patchify_mm"}
    assert _parts()[("ConvBlock", "reused")] == 2
    assert "regions" in str(report)


def test_auto_leaves_small_blocks_in_the_glue():
    from convlower.regions.blocks import MIN_AUTO_NODES

    class Small(nn.Module):
        def forward(self, x):
            return torch.relu(x) + 1.0

    m = nn.Sequential(*(Small() for _ in range(4)))
    with torch.no_grad():
        torch.compile(m, backend="convlower", options={"regions": "auto"})(torch.randn(4))
    assert MIN_AUTO_NODES > 2 and convlower.report().to_dict()["regions"] == []
    regions.clear()
    with torch.no_grad():  # named explicitly, it is a region all the same
        torch.compile(m, backend="convlower", options={"regions": ["Small"]})(torch.randn(4))
    assert _parts()[("Small", "reused")] == 3


def test_a_failure_while_splitting_compiles_the_graph_whole(monkeypatch, caplog):
    import convlower.regions.partition as partition

    def broken(*args, **kwargs):
        raise RuntimeError("split failed")

    monkeypatch.setattr(partition, "split_module", broken)
    m, x = Stack().eval(), torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(_compile(m)(x), m(x), rtol=1e-5, atol=1e-5)
    assert "regions failed (RuntimeError: split failed)" in caplog.text
    assert convlower.report().to_dict()["regions"] == []


def test_regions_option_values():
    assert parse({"regions": "auto"}, env={}).regions == "auto"
    assert parse({"regions": ["ResnetBlock2D"]}, env={}).regions == ("ResnetBlock2D",)
    assert parse({}, env={"CONVLOWER_REGIONS": "A,B"}).regions == ("A", "B")
    assert parse({}, env={}).regions == "off"
    with pytest.raises(OptionError, match="regions"):
        parse({"regions": 3}, env={})
    with pytest.raises(OptionError, match="regions"):
        parse({"regions": ["not a name"]}, env={})


@pytest.mark.slow
def test_sdxl_layout_unet_shares_its_blocks_and_matches_eager():
    from convlower.tools import zoo

    m, inputs = zoo.build("sdxl-unet", "tiny")
    with torch.no_grad():
        ref = m(*inputs)
        out = _compile(m)(*inputs)
    assert_close(out, ref, rel=1e-5)
    recs = convlower.report().to_dict()["regions"]
    reused = {r["block"] for r in recs if r["how"] == "reused"}
    assert {"ResnetBlock2D", "Transformer2DModel"} <= reused, reused


def test_auto_honours_a_models_repeated_blocks_list():
    class Declared(Stack):
        _repeated_blocks = ["Block"]  # diffusers' convention: these are the repeated blocks

    # Dynamo's nn_module_stack starts below the compiled module, so the list is read from the
    # modules inside it (a pipeline or wrapper holding the UNet); see docs/regions.md.
    m, x = nn.Sequential(Declared()).eval(), torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(_compile(m)(x), m(x), rtol=1e-5, atol=1e-5)
    blocks = [r for r in convlower.report().to_dict()["regions"] if r["block"] == "Block"]
    assert len(blocks) == 4  # the wide, unique one too: the model says it is a block


def test_a_step_calls_each_part_without_an_inner_dynamo_wrapper():
    """The split graph runs inside Dynamo's own disable wrapper; each part's AOTAutograd
    function is called without its second one, and a one-value part without a pytree unpack
    (a UNet step calls some 30 parts: these were 2-5 us each)."""
    import sys

    m, x = Stack().eval(), torch.randn(2, 5, 16)
    compiled = _compile(m)
    with torch.no_grad():
        compiled(x)
        calls = collections.Counter()

        def profile(frame, event, arg):
            if event == "call":
                code = frame.f_code
                where = "part" if code.co_filename.endswith("torch_saved.py") else \
                    code.co_filename.rsplit("/", 1)[-1]
                calls[(where, code.co_name)] += 1

        sys.setprofile(profile)
        try:
            out = compiled(x)
        finally:
            sys.setprofile(None)
        torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
    parts = calls[("part", "call")]
    assert parts >= 4, calls   # three Block instances and glue
    # Dynamo's own (the compiled module's and the compiled graph's), not one per part
    assert calls[("eval_frame.py", "_fn")] < parts, calls
    assert calls[("_pytree.py", "tree_unflatten")] == 0, calls


@pytest.mark.slow
def test_wan_vae_decode_of_four_latent_frames_through_regions_matches_eager():
    """Four frames: the decoder's later calls repeat and become regions.  One glue part there
    returns ``x[:, :, -2:].clone()`` of a value it also joins to the feature cache; Inductor
    (2.13) drops the clone and hands the output back inside the join's buffer, in a layout the
    next part's code rejects ("expected ... stride 256==128")."""
    from convlower.tools import zoo

    m, (z,) = zoo.build("wan-vae", "tiny")
    z = torch.randn(z.shape[0], z.shape[1], 4, *z.shape[3:])
    with torch.no_grad():
        ref = m(z)
        out = _compile(m)(z)
    assert_close(out, ref, rel=1e-5)
    assert any(r["how"] == "reused" for r in convlower.report().to_dict()["regions"])


def _outputs_in_a_wider_buffer(calls: list):
    """A compiled part's stand-in: returns (1, 4, 2, 3) inside a (1, 4, 3, 3) buffer, the
    layout Inductor gave the Wan VAE's cache output."""
    def fn(x):
        calls.append(x)
        return [torch.cat([x[:, :, :1], x], 2)[:, :, 1:]]
    return fn


def test_a_part_output_in_another_layout_than_traced_is_given_in_the_traced_one():
    from convlower import torch_internals as ti

    calls: list = []
    x = torch.randn(1, 4, 2, 3)
    call = ti.part_caller("compiled_part", _outputs_in_a_wider_buffer(calls), True, (x.stride(),))
    for _ in range(2):   # checked on the first call; the later ones are copied as well
        out = call(x)
        assert out.stride() == x.stride() and torch.equal(out, x)
    assert len(calls) == 2
    unchecked = ti.part_caller("compiled_part", _outputs_in_a_wider_buffer(calls), True)(x)
    assert unchecked.stride() != x.stride()   # what the check above corrects


def test_a_part_output_in_its_traced_layout_is_handed_on_as_is():
    from convlower import torch_internals as ti

    made: list = []

    def fn(x):
        made.append(x * 2)
        return [made[-1], None]

    x = torch.randn(2, 3)
    call = ti.part_caller("compiled_part", fn, False, ((7, 1), None))  # size 1: any stride
    for _ in range(2):
        assert call(x[:1])[0] is made[-1]   # no copy


def test_traced_strides_are_kept_only_where_a_copy_can_take_them():
    from convlower.regions.seams import _static_strides

    x = torch.randn(2, 3, 4)
    assert _static_strides(x.transpose(0, 2)) == (1, 4, 12)
    assert _static_strides(x[:, :1].expand(2, 5, 4)) is None   # overlapping
    assert _static_strides(3) is None


def test_a_split_saved_before_parts_carried_strides_still_loads(monkeypatch):
    """Index entries of format 1 were (entry, single): they load with no stride check."""
    import pickle

    from convlower import torch_saved

    monkeypatch.setattr(torch_saved, "part_caller", lambda name, fn, single, *rest: (fn, single, rest))
    gm = torch.fx.symbolic_trace(nn.Identity())
    monkeypatch.setattr(torch.fx._graph_pickler.GraphPickler, "loads", lambda data, mode: gm)
    monkeypatch.setattr(torch._functorch._aot_autograd.aot_autograd_result,
                        "deserialize_bundled_cache_entry", lambda e: f"fn{e}")
    old = pickle.dumps({"graph": b"", "entries": [7], "index": {"compiled_a": (0, True)}})
    new = pickle.dumps({"graph": b"", "entries": [7], "index": {"compiled_a": (0, True, ((4, 1),))}})
    assert torch_saved._deserialize_split(old)[1] == {"compiled_a": ("fn7", True)}
    assert torch_saved._deserialize_split(new)[1] == {"compiled_a": ("fn7", True, ((4, 1),))}
    pure = pickle.dumps({"graph": b"", "entries": [7],
                         "index": {"compiled_a": (0, True, ((4, 1),), False)}})
    assert torch_saved._deserialize_split(pure)[1] == {"compiled_a": ("fn7", True, ((4, 1),), False)}


def test_a_saved_split_keeps_which_parts_stay_wrapped(monkeypatch):
    """The saved index keeps each part's "always wrapped" flag; an entry saved before the
    flag existed (format 2) is written back as wrapped (never called straight)."""
    import pickle

    from convlower import torch_saved

    class Entry:
        def serialize(self):
            return b"entry"

    monkeypatch.setattr(torch.fx._graph_pickler.GraphPickler, "dumps", lambda gm, opts: b"")
    gm = torch.fx.symbolic_trace(nn.Identity())
    fn = Entry()
    parts = {"compiled_a": (fn, True, ((4, 1),), False), "compiled_b": (fn, False, ())}
    index = pickle.loads(torch_saved._serialize_split(gm, parts))["index"]
    assert index == {"compiled_a": (0, True, ((4, 1),), False), "compiled_b": (0, False, (), True)}
