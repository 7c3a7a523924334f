"""convlower touches the compiled graph only: the model's modules, forwards, state_dict and
parameters are unchanged by compilation, the parameters are the model's own (no copies), and
an in-place weight update after compilation (LoRA-style merge) is seen by the compiled model."""
from __future__ import annotations

import torch

import convlower


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Conv2d(3, 8, 2, 2)   # patchify_mm
        self.mix = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.head = torch.nn.Conv2d(8, 4, 4)        # patch_linear on a 4x4 input

    def forward(self, x):
        return self.head(torch.relu(self.mix(self.embed(x))))


def _snapshot(m):
    return {
        "modules": [(n, type(mod), mod.forward.__func__) for n, mod in m.named_modules()],
        "params": [(n, id(p), p.data_ptr()) for n, p in m.named_parameters()],
        "state": {k: v.clone() for k, v in m.state_dict().items()},
        "state_ptrs": {k: v.data_ptr() for k, v in m.state_dict().items()},
    }


def test_module_seams_unchanged_and_parameters_are_the_models_own():
    torch.manual_seed(0)
    m = Net()
    before = _snapshot(m)
    x = torch.randn(2, 3, 8, 8)
    compiled = torch.compile(m, backend="convlower", options={"select": "always"})
    out = compiled(x)
    out.sum().backward()
    assert convlower.report().lowered("forward") and convlower.report().lowered("backward")
    after = _snapshot(m)
    assert compiled._orig_mod is m
    assert after["modules"] == before["modules"]  # same modules, same forward functions
    assert after["params"] == before["params"]    # same Parameter objects and storage
    assert after["state_ptrs"] == before["state_ptrs"]
    assert after["state"].keys() == before["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v), k
    # gradients land on the model's own parameters
    ref = Net()
    ref.load_state_dict(before["state"])
    ref(x).sum().backward()
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=n)

    # LoRA-style merge: W += B @ A in place, after compilation
    with torch.no_grad():
        for conv in (m.embed, m.head):
            o = conv.weight.shape[0]
            delta = (torch.randn(o, 2) @ torch.randn(2, conv.weight[0].numel())).view_as(conv.weight)
            conv.weight.add_(0.1 * delta)
        expected = m(x)
        torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-5)
