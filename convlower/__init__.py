"""convlower: a torch.compile backend that lowers convolutions to cheaper equivalent forms.

    torch.compile(model, backend="convlower")          # no import needed (entry point)
    convlower.report()                                  # what was lowered, proven, guarded
    compiled, result = convlower.warmup(model, inputs, cache_dir=...)  # compile at session load
"""
from .version import __version__
from . import torch_internals  # first: refuses an unsupported torch, clearly

with torch_internals.quick_op_registration():  # the custom ops register as the modules load
    from .backend import CompileError, OptionError, convlower_backend
    from .observe.report import Report, report, reset_report
    from .tools.warmup import WarmupResult, warmup

__all__ = ["__version__", "convlower_backend", "report", "reset_report", "Report", "OptionError",
           "CompileError", "warmup", "WarmupResult"]
