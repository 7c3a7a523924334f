"""The backend, its options, statistics and warm-up."""
from .compiler import convlower_backend
from .options import OptionError, Options, parse as parse_options
from .report import Report, report, reset_report

__all__ = ["convlower_backend", "OptionError", "Options", "parse_options", "Report", "report",
           "reset_report"]
