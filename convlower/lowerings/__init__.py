"""The lowering rules, one per module, in priority order (earlier rules are tried first)."""
from .channels_last_conv import RULE as channels_last_conv
from .eager_conv import RULE as eager_conv
from .patch_linear import RULE as patch_linear
from .patchify_mm import RULE as patchify_mm
from .rule import Condition, ConvCall, Rule
from .time_fold_conv2d import RULE as time_fold_conv2d
from .time_sum_conv2d import RULE as time_sum_conv2d
from .time_unfold_conv2d import RULE as time_unfold_conv2d

# Exact patch rules first; then the Conv3d -> conv2d rules from the narrowest identity (no
# duplicated activations) to the general ones; then the original Conv3d in another memory
# format; last the original as eager calls it (not a lowering: chosen only when Inductor's
# compiled original would be slower).
RULES = {r.name: r for r in (patch_linear, patchify_mm, time_fold_conv2d, time_unfold_conv2d,
                             time_sum_conv2d, channels_last_conv, eager_conv)}

__all__ = ["RULES", "Rule", "ConvCall", "Condition"]
