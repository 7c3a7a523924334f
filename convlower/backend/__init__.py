"""The backend (``torch.compile(m, backend="convlower")``), its options and its graph passes."""
from .compiler import CompileError, convlower_backend
from .options import OptionError, Options, parse as parse_options

__all__ = ["convlower_backend", "CompileError", "OptionError", "Options", "parse_options"]
