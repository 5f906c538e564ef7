"""Running a TPU compiler: everything on the far side of the process line, and nothing of torch.

- :mod:`.targets`: the TPU slices to compile for (:class:`Target`, :data:`TARGETS`, :func:`target`).
- :mod:`.pins`: which compiler answers: the libtpu/jax pair each torch_xla release's runtime pins
  (:data:`RUNTIMES`), :class:`Compiler`, :func:`resolve` of a name.
- :mod:`.venvs`: one Python environment per compiler pair not installed here, built on first use.
- :mod:`.worker`: the worker process of each compiler and its protocol (:class:`Request` in, a reply out);
  :mod:`.serve` and :mod:`._jax` run inside that process (jax and libtpu load only there).
- :mod:`.flags`: the libtpu flags torch_xla's runtime compiles with; :mod:`.versions`: the installed pair.
- :mod:`.cache`: the answers kept, by request; :mod:`.refusal`: the compiler's account of a refusal.

Every function here takes resolved :class:`Target` and :class:`Compiler` objects; names are resolved once, at
the edge (:func:`tpukit.tpu.ask.resolve`).
"""

from __future__ import annotations

from .cache import cache_dir, cache_info
from .pins import RUNTIMES, Compiler, CompilerError, resolve
from .refusal import Allocation, Refusal
from .targets import TARGETS, Chip, Target, TargetError, target
from .venvs import CompilerEnvError
from .worker import BudgetSpent, Request, TpuCompilerMissingError, WorkerError, available, versions

__all__ = ["cache_dir", "cache_info", "RUNTIMES", "Compiler", "CompilerError", "resolve", "Allocation", "Refusal",
           "TARGETS", "Chip", "Target", "TargetError", "target", "CompilerEnvError", "Request",
           "TpuCompilerMissingError", "WorkerError", "BudgetSpent", "available", "versions"]
