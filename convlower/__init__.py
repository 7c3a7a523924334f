"""convlower: a torch.compile backend that lowers convolutions to cheaper equivalent forms.

    torch.compile(model, backend="convlower")          # no import needed (entry point)
    convlower.report()                                  # what was lowered, proven, guarded
    compiled, result = convlower.warmup(model, inputs, cache_dir=...)  # compile at session load
"""
__version__ = "0.1.0"

from .backend import OptionError, Report, convlower_backend, report, reset_report  # noqa: E402
from .backend.warmup import WarmupResult, warmup  # noqa: E402

__all__ = ["__version__", "convlower_backend", "report", "reset_report", "Report", "OptionError",
           "warmup", "WarmupResult"]
