"""What a lowering rule is: an identity, the conditions under which it holds, an emission.

A rule never looks at an FX graph.  It sees one convolution call (:class:`ConvCall`, built from
the fake tensors of an ``aten.convolution`` node), states its eligibility as sympy relations
over the call's parameters and sizes (plain integers, or SymInt expressions under dynamic
shapes), and emits the equivalent computation as ordinary torch ops on real or fake tensors.
Whether the relations hold is decided by :mod:`convlower.lowerings.proof`; the forward and
backward functions built from the emission are :mod:`convlower.decompositions` (the pass
splices them, selection times them).  A rule also states where it is known to win
(:meth:`Rule.heuristic`), so adding a rule is one file plus one line in ``RULES``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import sympy
import torch


def sym(v) -> sympy.Expr:
    """A size or parameter as a sympy expression (SymInt -> its expression)."""
    if isinstance(v, torch.SymInt):
        return v.node.expr
    return sympy.Integer(int(v))


@dataclasses.dataclass(frozen=True)
class Condition:
    """One eligibility fact: a readable statement and the sympy relation that proves it."""

    text: str
    relation: sympy.Basic


@dataclasses.dataclass(frozen=True)
class ConvCall:
    """The arguments of one ``aten.convolution`` call, as the rules see them."""

    x: torch.Tensor  # input (fake or real)
    weight: torch.Tensor
    has_bias: bool
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool
    output_padding: tuple[int, ...]
    groups: int

    @property
    def ndim(self) -> int:
        """Number of spatial dims (1, 2 or 3)."""
        return self.weight.dim() - 2

    @property
    def kernel(self) -> tuple[int, ...]:
        return tuple(self.weight.shape[2:])

    def in_size(self, d: int) -> sympy.Expr:
        """Spatial input size of dim ``d`` (0-based among spatial dims)."""
        return sym(self.x.shape[2 + d])

    def out_size(self, d: int, x: Optional[torch.Tensor] = None):
        """Output size of spatial dim ``d`` by the convolution formula (int or SymInt).
        An emission passes the tensor it computes with, so that under dynamic shapes the size
        is derived from that tensor (the tracer must see where every SymInt comes from)."""
        k, s, p, dl = self.kernel[d], self.stride[d], self.padding[d], self.dilation[d]
        size = (self.x if x is None else x).shape[2 + d]
        return (size + 2 * p - dl * (k - 1) - 1) // s + 1

    def describe(self) -> dict:
        def shape(t):
            return [str(s) for s in t.shape]

        return {
            "input": shape(self.x),
            "weight": shape(self.weight),
            "bias": self.has_bias,
            "stride": list(self.stride),
            "padding": list(self.padding),
            "dilation": list(self.dilation),
            "transposed": self.transposed,
            "output_padding": list(self.output_padding),
            "groups": self.groups,
            "dtype": str(self.x.dtype).replace("torch.", ""),
            "device": str(self.x.device),
        }

    @staticmethod
    def from_args(args: Sequence) -> "ConvCall":
        """From ``aten.convolution`` args (x, w, b, stride, padding, dilation, transposed,
        output_padding, groups); tensors are meta values (fake tensors)."""
        x, w, b, stride, padding, dilation, transposed, output_padding, groups = args
        n = w.dim() - 2

        def expand(v):
            v = tuple(int(i) for i in v)
            return v * n if len(v) == 1 and n > 1 else v

        return ConvCall(x, w, b is not None, expand(stride), expand(padding), expand(dilation),
                        bool(transposed), expand(output_padding), int(groups))


class Rule:
    """Base class of a lowering rule.  Subclasses set ``name`` and ``summary`` and implement
    :meth:`conditions`, :meth:`emit` and :meth:`heuristic`.  Rules whose :meth:`emit` is the
    same function set the same ``emission`` name: selection times that emission once."""

    name: str = ""
    summary: str = ""
    emission: str = ""  # defaults to ``name``
    lowers: bool = True  # False: keeps the original computation; select="always" skips it
    follows_compute_dtype: bool = True  # runs in the opt-in ``compute_dtype``
    # Computes with the original conv's own ATen kernels (as an opaque call, in another memory
    # format): it inherits eager's numerics, errors of torch's reduced-precision CPU convs too.
    eager_numerics: bool = False
    # Its emission is traced into the graph (False: it is one custom op already, its own
    # opaque form; decompositions/opaque_form.py).
    traced: bool = True

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if not cls.__dict__.get("emission"):
            cls.emission = cls.__dict__.get("name", "")

    def conditions(self, c: ConvCall) -> list[Condition]:
        raise NotImplementedError

    def emit(self, c: ConvCall, x: torch.Tensor, weight: torch.Tensor,
             bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The convolution's value, computed the lowered way.  ``c`` carries the parameters;
        ``x``, ``weight``, ``bias`` are the tensors to compute with (their sizes may be SymInts)."""
        raise NotImplementedError

    def site_conditions(self, site) -> list[Condition]:
        """Conditions on the conv's place in its graph (a ``ConvSite``: its context, Inductor's
        layout decision), checked with :meth:`conditions` when a site is known."""
        return []

    def emit_backward(self, c: ConvCall, output_mask) -> Optional[Callable]:
        """An opaque backward ``(grad_out, x, weight) -> (grad_x, grad_weight, grad_bias)``, or
        None (every lowering): the backward is autograd of :meth:`emit`."""
        return None

    def wins_by_construction(self, c: ConvCall) -> Optional[str]:
        """Why this rule is faster on every device without timing it (e.g. one GEMM of the
        conv's own FLOPs, reading each input once), or None: then it is screened."""
        return None

    def heuristic(self, c: ConvCall, platform: str) -> tuple[bool, str]:
        """Static knowledge of where this rule wins on ``platform`` ("cpu", "cuda", "hip"):
        (use it without timing?, why).  Figures are measured ratios, see docs/selection.md."""
        return False, "no static knowledge about this rule"

    def __repr__(self) -> str:
        return f"<rule {self.name}>"


def common_conditions(c: ConvCall) -> list[Condition]:
    """Conditions every rule of this package needs: a plain (not transposed) convolution with
    at least one input channel per group (eager returns an empty result for zero channels),
    input and weight of one dtype (eager raises otherwise; torch < 2.13 lets such a conv reach
    the backend, and an mm would raise another error)."""
    return [Condition("not transposed", sympy.sympify(not c.transposed)),
            Condition("in_channels per group > 0", sympy.Gt(sym(c.weight.shape[1]), 0)),
            Condition("input dtype == weight dtype", sympy.sympify(c.x.dtype == c.weight.dtype))]
