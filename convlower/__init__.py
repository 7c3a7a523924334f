"""convlower: a torch.compile backend that lowers convolutions to cheaper equivalent forms.

    torch.compile(model, backend="convlower")          # no import needed (entry point)
    convlower.report()                                  # what was lowered, proven, guarded
"""
__version__ = "0.1.0"

from .backend import OptionError, Report, convlower_backend, report, reset_report  # noqa: E402

__all__ = ["__version__", "convlower_backend", "report", "reset_report", "Report", "OptionError"]
