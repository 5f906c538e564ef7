"""tpukit's version, in one place every module can import (pyproject.toml repeats it for packaging)."""

__version__ = "0.1.0"
