"""Golden aten graphs: the exact rewrite each rule emits, forward and backward, on one small
static case.  A change to a rule's emission shows up here as a diff for review.
Regenerate with EXPECTTEST_ACCEPT=1 after checking the new graph is right."""
import expecttest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from convlower.backend.conv_pass import ConvLowerPass
from convlower.backend.options import parse

aten = torch.ops.aten


def lowered_code(rule, x, w, b, stride, padding, backward=False):
    args = (stride, padding, [1] * (w.dim() - 2), False, [0] * (w.dim() - 2), 1)

    if backward:
        def fn(g, x, w):
            return aten.convolution_backward(g, x, w, [w.shape[0]], *args, [True, True, True])

        out = aten.convolution(x, w, b, *args)
        gm = make_fx(fn, tracing_mode="fake")(torch.randn_like(out), x, w)
    else:
        gm = make_fx(lambda x, w, b: aten.convolution(x, w, b, *args), tracing_mode="fake")(x, w, b)
    ConvLowerPass(parse({"rules": [rule], "select": "always"}, env={}))(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm.code.strip()


class TestGolden(expecttest.TestCase):
    def test_patch_linear_forward(self):
        x, w, b = torch.randn(5, 3, 2, 4, 4), torch.randn(8, 3, 2, 4, 4), torch.randn(8)
        self.assertExpectedInline(lowered_code("patch_linear", x, w, b, [2, 4, 4], [0, 0, 0]), """\
def forward(self, x_1, w_1, b_1):
    view_default = torch.ops.aten.view.default(w_1, [8, -1]);  w_1 = None
    view_default_1 = torch.ops.aten.view.default(x_1, [5, 96]);  x_1 = None
    permute_default = torch.ops.aten.permute.default(view_default, [1, 0]);  view_default = None
    addmm_default = torch.ops.aten.addmm.default(b_1, view_default_1, permute_default);  b_1 = view_default_1 = permute_default = None
    view_default_2 = torch.ops.aten.view.default(addmm_default, [5, 8, 1, 1, 1]);  addmm_default = None
    return view_default_2""")

    def test_patch_linear_backward(self):
        x, w, b = torch.randn(5, 3, 2, 4, 4), torch.randn(8, 3, 2, 4, 4), torch.randn(8)
        self.assertExpectedInline(
            lowered_code("patch_linear", x, w, b, [2, 4, 4], [0, 0, 0], backward=True), """\
def forward(self, g_1, x_1, w_1):
    view_default = torch.ops.aten.view.default(w_1, [8, -1]);  w_1 = None
    view_default_1 = torch.ops.aten.view.default(x_1, [5, 96]);  x_1 = None
    permute_default = torch.ops.aten.permute.default(view_default, [1, 0]);  view_default = None
    view_default_2 = torch.ops.aten.view.default(g_1, [5, 8])
    permute_default_1 = torch.ops.aten.permute.default(view_default_2, [1, 0])
    mm_default = torch.ops.aten.mm.default(permute_default_1, view_default_1);  permute_default_1 = view_default_1 = None
    permute_default_2 = torch.ops.aten.permute.default(mm_default, [1, 0]);  mm_default = None
    permute_default_3 = torch.ops.aten.permute.default(permute_default, [1, 0]);  permute_default = None
    mm_default_1 = torch.ops.aten.mm.default(view_default_2, permute_default_3);  view_default_2 = permute_default_3 = None
    permute_default_4 = torch.ops.aten.permute.default(permute_default_2, [1, 0]);  permute_default_2 = None
    view_default_3 = torch.ops.aten.view.default(mm_default_1, [5, 3, 2, 4, 4]);  mm_default_1 = None
    view_default_4 = torch.ops.aten.view.default(permute_default_4, [8, 3, 2, 4, 4]);  permute_default_4 = None
    sum_dim_int_list = torch.ops.aten.sum.dim_IntList(g_1, [0, 2, 3, 4]);  g_1 = None
    return (view_default_3, view_default_4, sum_dim_int_list)""")

    def test_patchify_mm_forward(self):
        x, w, b = torch.randn(2, 3, 9, 8), torch.randn(8, 3, 2, 2), torch.randn(8)
        self.assertExpectedInline(lowered_code("patchify_mm", x, w, b, [2, 2], [0, 0]), """\
def forward(self, x_1, w_1, b_1):
    slice_tensor = torch.ops.aten.slice.Tensor(x_1, 2, 0, 8);  x_1 = None
    view_default = torch.ops.aten.view.default(slice_tensor, [2, 3, 4, 2, 4, 2]);  slice_tensor = None
    permute_default = torch.ops.aten.permute.default(view_default, [0, 2, 4, 1, 3, 5]);  view_default = None
    dense_default = torch.ops.convlower.dense.default(permute_default);  permute_default = None
    view_default_1 = torch.ops.aten.view.default(dense_default, [32, 12]);  dense_default = None
    view_default_2 = torch.ops.aten.view.default(w_1, [8, -1]);  w_1 = None
    permute_default_1 = torch.ops.aten.permute.default(view_default_2, [1, 0]);  view_default_2 = None
    addmm_default = torch.ops.aten.addmm.default(b_1, view_default_1, permute_default_1);  b_1 = view_default_1 = permute_default_1 = None
    view_default_3 = torch.ops.aten.view.default(addmm_default, [2, 4, 4, 8]);  addmm_default = None
    permute_default_2 = torch.ops.aten.permute.default(view_default_3, [0, 3, 1, 2]);  view_default_3 = None
    dense_default_1 = torch.ops.convlower.dense.default(permute_default_2);  permute_default_2 = None
    return dense_default_1""")

    def test_patchify_mm_backward(self):
        x, w, b = torch.randn(2, 3, 9, 8), torch.randn(8, 3, 2, 2), torch.randn(8)
        self.assertExpectedInline(
            lowered_code("patchify_mm", x, w, b, [2, 2], [0, 0], backward=True), """\
def forward(self, g_1, x_1, w_1):
    slice_tensor = torch.ops.aten.slice.Tensor(x_1, 2, 0, 8);  x_1 = None
    view_default = torch.ops.aten.view.default(slice_tensor, [2, 3, 4, 2, 4, 2]);  slice_tensor = None
    permute_default = torch.ops.aten.permute.default(view_default, [0, 2, 4, 1, 3, 5]);  view_default = None
    dense_default = torch.ops.convlower.dense.default(permute_default);  permute_default = None
    view_default_1 = torch.ops.aten.view.default(dense_default, [32, 12]);  dense_default = None
    view_default_2 = torch.ops.aten.view.default(w_1, [8, -1]);  w_1 = None
    permute_default_1 = torch.ops.aten.permute.default(view_default_2, [1, 0]);  view_default_2 = None
    permute_default_2 = torch.ops.aten.permute.default(g_1, [0, 2, 3, 1])
    clone_default = torch.ops.aten.clone.default(permute_default_2, memory_format = torch.contiguous_format);  permute_default_2 = None
    view_default_3 = torch.ops.aten.view.default(clone_default, [32, 8]);  clone_default = None
    permute_default_3 = torch.ops.aten.permute.default(view_default_3, [1, 0])
    mm_default = torch.ops.aten.mm.default(permute_default_3, view_default_1);  permute_default_3 = view_default_1 = None
    permute_default_4 = torch.ops.aten.permute.default(mm_default, [1, 0]);  mm_default = None
    permute_default_5 = torch.ops.aten.permute.default(permute_default_1, [1, 0]);  permute_default_1 = None
    mm_default_1 = torch.ops.aten.mm.default(view_default_3, permute_default_5);  view_default_3 = permute_default_5 = None
    permute_default_6 = torch.ops.aten.permute.default(permute_default_4, [1, 0]);  permute_default_4 = None
    view_default_4 = torch.ops.aten.view.default(permute_default_6, [8, 3, 2, 2]);  permute_default_6 = None
    view_default_5 = torch.ops.aten.view.default(mm_default_1, [2, 4, 4, 3, 2, 2]);  mm_default_1 = None
    permute_default_7 = torch.ops.aten.permute.default(view_default_5, [0, 3, 1, 4, 2, 5]);  view_default_5 = None
    clone_default_1 = torch.ops.aten.clone.default(permute_default_7, memory_format = torch.contiguous_format);  permute_default_7 = None
    view_default_6 = torch.ops.aten.view.default(clone_default_1, [2, 3, 8, 8]);  clone_default_1 = None
    full_default = torch.ops.aten.full.default([2, 3, 9, 8], 0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    slice_scatter_default = torch.ops.aten.slice_scatter.default(full_default, view_default_6, 2, 0, 8);  full_default = view_default_6 = None
    sum_dim_int_list = torch.ops.aten.sum.dim_IntList(g_1, [0, 2, 3]);  g_1 = None
    return (slice_scatter_default, view_default_4, sum_dim_int_list)""")
