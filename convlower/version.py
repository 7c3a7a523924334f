"""convlower's version: a leaf module, so any module can name it without importing the package."""
__version__ = "0.2.0"
