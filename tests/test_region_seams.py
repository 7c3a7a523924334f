"""Seams between compiled parts (convlower/regions/seams.py): channels-last where Inductor
computes channels-last, eager's layout wherever a consumer or the caller could tell."""
import pytest
import torch
from torch import nn

import convlower
from convlower.regions import seams

from helpers import compare_with_eager

pytestmark = pytest.mark.usefixtures("fresh_regions")  # no parts compiled by other tests


class ConvBlock(nn.Module):
    """A ResNet-style block: over regions.blocks.MIN_AUTO_NODES, so "auto" takes it."""

    def __init__(self, ch=8):
        super().__init__()
        self.n1, self.n2 = nn.GroupNorm(2, ch), nn.GroupNorm(2, ch)
        self.c1, self.c2 = nn.Conv2d(ch, ch, 3, padding=1), nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        h = self.c1(nn.functional.silu(self.n1(x)))
        h = self.c2(nn.functional.silu(self.n2(h)))
        return (x + h) * 0.5


class FlattensItsInput(ConvBlock):
    """Reads its input through ``view``, which eager's strides allow and channels-last not."""

    def forward(self, x):
        flat = x.view(x.shape[0], -1)
        return super().forward(x) + flat.mean(-1)[:, None, None, None]


class Net(nn.Module):
    def __init__(self, block=ConvBlock, ch=8):
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, padding=1)
        self.blocks = nn.ModuleList([block(ch) for _ in range(3)])
        self.head = nn.Conv2d(ch, 3, 1)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _channels_last_outputs():
    return sum(r["channels_last_out"] for r in convlower.report().to_dict()["regions"])


def _run(model, x):
    m = torch.compile(model.eval(), backend="convlower", options={"regions": "auto"})
    with torch.no_grad():
        return m(x), model(x)


def test_seams_between_conv_blocks_go_channels_last_and_the_output_keeps_eagers_layout():
    out, ref = _run(Net(), torch.randn(2, 3, 12, 12))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert out.is_contiguous() and out.stride() == ref.stride()
    # stem, three blocks and head give their output channels-last; the split graph converts
    # the head's back for the caller
    assert _channels_last_outputs() == 5
    assert "5 seams channels-last" in str(convlower.report())
    # the first and last block meet the stem and the head like the middle one: one compile
    recs = [r for r in convlower.report().to_dict()["regions"] if r["block"] == "ConvBlock"]
    assert sorted(r["how"] for r in recs) == ["compiled", "reused", "reused"]


def test_training_across_channels_last_seams_matches_eager():
    compare_with_eager(Net(), torch.randn(2, 3, 12, 12), options={"regions": "auto"}, rel=1e-5)
    assert _channels_last_outputs() > 0


def test_a_block_that_views_its_input_keeps_its_seams_in_eagers_layout():
    out, ref = _run(Net(FlattensItsInput), torch.randn(2, 3, 12, 12))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    recs = convlower.report().to_dict()["regions"]
    assert any(r["block"] == "FlattensItsInput" and r["how"] == "reused" for r in recs)
    # every block reads its input through a view: the blocks stay in eager's layout, the stem
    # and the head (no view) still work channels-last, converted where they meet the blocks
    recs = convlower.report().to_dict()["regions"]
    assert all(r["channels_last_out"] == 0 for r in recs if r["block"] == "FlattensItsInput")
    assert _channels_last_outputs() == 2


def test_without_onednn_seams_keep_eagers_layout():
    x = torch.randn(2, 3, 12, 12)
    with torch.backends.mkldnn.flags(enabled=False):
        out, ref = _run(Net(), x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert _channels_last_outputs() == 0


def test_channels_last_is_wanted_only_for_a_convolving_graph_on_a_cpu_with_onednn():
    class Linear(nn.Module):
        def forward(self, x):
            return torch.nn.functional.gelu(x) * 2

    conv_gm = torch.fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 3, 1)))
    conv_gm.graph.call_function(torch.conv2d, ())  # Dynamo's graphs call the functional form
    plain_gm = torch.fx.symbolic_trace(Linear())
    x = torch.randn(1, 3, 4, 4)
    assert seams.channels_last_wanted(conv_gm)(x) == torch.backends.mkldnn.is_available()
    assert not seams.channels_last_wanted(plain_gm)(x)
    with torch.backends.mkldnn.flags(enabled=False):
        assert not seams.channels_last_wanted(conv_gm)(x)
    assert not seams.channels_last_wanted(conv_gm)(torch.randn(1, 3, 4, 4, device="meta"))


class SequenceBlock(nn.Module):
    """4-D (batch, sequence, heads, dim) tensors, no convolution or group norm."""

    def __init__(self, dim=12):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        h = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        return x + h.softmax(dim=1) * 0.5 - h.mean(dim=2, keepdim=True)


def test_parts_that_do_not_work_on_images_keep_eagers_layout():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 12, 1)   # the graph convolves: channels-last is wanted
            self.blocks = nn.ModuleList([SequenceBlock() for _ in range(3)])

        def forward(self, x):
            x = self.stem(x).permute(0, 2, 3, 1).contiguous()   # (batch, seq, heads, dim)
            for b in self.blocks:
                x = b(x)
            return x

    out, ref = _run(Mixed(), torch.randn(2, 3, 5, 6))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    recs = convlower.report().to_dict()["regions"]
    blocks = [r for r in recs if r["block"] == "SequenceBlock"]
    assert len(blocks) == 3 and all(r["channels_last_out"] == 0 for r in blocks)


def test_skip_connections_joined_along_channels_stay_channels_last():
    class Skips(Net):
        def forward(self, x):
            a = self.blocks[0](self.stem(x))
            b = self.blocks[1](a)
            joined = torch.cat([a[:, :4], b[:, 4:]], dim=1)   # a part of its own, between blocks
            return self.head(self.blocks[2](joined))

    out, ref = _run(Skips(), torch.randn(2, 3, 12, 12))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    recs = convlower.report().to_dict()["regions"]
    # only the graph's input is converted: the joins take the blocks' channels-last outputs
    assert sum(r["inputs_converted"] for r in recs) == 1, recs
