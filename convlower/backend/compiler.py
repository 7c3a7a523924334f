"""The ``convlower`` backend: Inductor, plus convlower's graph passes.

``torch.compile(m, backend="convlower", mode=..., options=...)`` reaches
:func:`convlower_backend`.  It validates the options, then hands the graph to Inductor exactly
as ``backend="inductor"`` would (same mode handling, same config) with one addition: the
post-grad custom pass that lowers convolutions.  A graph without an eligible convolution
therefore compiles to the same kernels as under Inductor.
"""
from __future__ import annotations

import itertools
import logging
from typing import Optional

import torch

from . import options as _options
from .graph_pass import ConvLowerPass

log = logging.getLogger("convlower")
_graph_ids = itertools.count()


def _inductor(mode: Optional[str], inductor_options: dict):
    # The wrapper torch.compile itself builds for backend="inductor": it applies `mode` and
    # validates Inductor options the same way.
    return torch._TorchCompileInductorWrapper(mode, inductor_options or None, None)


def convlower_backend(gm: torch.fx.GraphModule, example_inputs, mode: Optional[str] = None,
                      options: Optional[dict] = None):
    """A ``torch.compile`` backend (entry point ``convlower``)."""
    opts = _options.parse(options)
    name = f"graph{next(_graph_ids)}"
    patches = {"post_grad_custom_pre_pass": ConvLowerPass(opts, name)}
    return _inductor(mode, dict(opts.inductor))(gm, example_inputs, config_patches=patches)
