"""The spike's zoo: every entry builds offline from its documented config and runs eagerly."""
import pytest
import torch

from convlower.tools import zoo


@pytest.mark.parametrize("name", zoo.names())
def test_entry_builds_and_runs_eagerly(name):
    model, inputs = zoo.build(name, "tiny")
    assert isinstance(model, torch.nn.Module) and not model.training
    with torch.no_grad():
        out = model(*inputs)
    assert isinstance(out, torch.Tensor) and out.numel() > 0
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", zoo.names())
def test_entry_documents_every_size(name):
    entry = zoo.ZOO[name]
    assert set(entry.configs) == set(zoo.SIZES)
    assert entry.summary
    text = zoo.describe()
    for size, cfg in entry.configs.items():
        assert f"{size}: " + ", ".join(f"{k}={v}" for k, v in cfg.items()) in text


def test_build_is_deterministic():
    (a, xa), (b, xb) = zoo.build("wan-dit-patch", "tiny"), zoo.build("wan-dit-patch", "tiny")
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.equal(xa[0], xb[0])


def test_small_configs_keep_the_real_layer_shapes():
    conv = zoo.build("mochi-downsample", "small")[0]
    assert (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride) == (128, 256, (2, 2, 2), (2, 2, 2))
    embed = zoo.build("qwen2.5-vl-patch-embed", "small")[0].proj
    assert (embed.out_channels, embed.kernel_size, embed.stride) == (1280, (2, 14, 14), (2, 14, 14))
    patch = zoo.build("wan-dit-patch", "small")[0].patch_embedding
    assert (patch.in_channels, patch.out_channels, patch.kernel_size) == (16, 1536, (1, 2, 2))


def test_unknown_names_and_sizes_are_named():
    with pytest.raises(KeyError, match="zoo models: qwen2.5-vl-patch-embed"):
        zoo.build("resnet")
    with pytest.raises(ValueError, match="valid sizes: tiny, small"):
        zoo.build("oobleck", "huge")
    assert zoo.DEFAULT in zoo.ZOO
