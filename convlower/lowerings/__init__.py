"""The lowering rules, one per module, in priority order (earlier rules are tried first)."""
from .patch_linear import RULE as patch_linear
from .patchify_mm import RULE as patchify_mm
from .rule import Condition, ConvCall, Rule

RULES = {r.name: r for r in (patch_linear, patchify_mm)}

__all__ = ["RULES", "Rule", "ConvCall", "Condition"]
