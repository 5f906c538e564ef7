"""TPU truth without a TPU: the real TPU compiler (libtpu, compile-only, in a worker process) for any target.

- :func:`estimate` / :func:`largest_batch`: trace a step, never run it, compile it for a TPU slice.
- :func:`compile_graph` / :func:`compile_graph_async`: a graph the kit already has, for the target.
- :func:`target` / :data:`TARGETS` / :func:`default_target`: the table of TPU slices (``TPUKIT_TARGET``).
- :func:`bucket_costs`: the bucket advisor's costs from the target's compiler.
- :class:`Refusal` (``TpuEstimate.refusal``): why a step does not fit, in the compiler's words (its totals
  and its largest allocations), read by :mod:`.refusal`.
- :class:`MemoryBreakdown` (``TpuEstimate.memory``, ``estimate(..., memory=True)``): the HBM at the peak by
  kind and source line, from the compiler's dump (:mod:`.dump`) or its refusal, with advice checked by a
  compile (:mod:`.advice`).
- :func:`follow` (``tpukit.setup(target=...)``): every graph the kit records, estimated in the background
  (:func:`unfollow` stops it).
- :func:`compiler` / :data:`RUNTIMES` / :class:`Compiler`: which TPU compiler answers (``compiler=`` of
  every estimate: ``"torch_xla 2.8"``, ``"libtpu 0.0.17"``, ``"newest"``; default: the installed torch_xla's),
  each in its own environment (:mod:`.envs`) unless installed here; :func:`compare`: one step, several
  targets and compilers, one table.

The parent process never imports jax or libtpu; only :mod:`._jax`, in the worker, does.
"""

from __future__ import annotations

from . import advice, compilers, dump, envs, memory, refusal
from .compare import Comparison, compare
from .compilers import RUNTIMES, Compiler, CompilerError, compiler
from .envs import CompilerEnvError
from .estimate import BatchFit, estimate, largest_batch
from .follow import Follower, follow, follower, line, unfollow, watch_follower
from .graphs import bucket_costs, compile_graph, compile_graph_async
from .memory import Buffer, MemoryBreakdown, MemoryRow
from .record import Suggestion, TpuCompileError, TpuEstimate, gb
from .refusal import Allocation, Refusal
from .targets import TARGETS, Chip, Target, TargetError, default_target, target
from .worker import (TpuCompilerMissingError, WorkerError, available, cache_dir, cache_info, check, require, stop, versions,
                     worker_pid)

__all__ = [
    "estimate", "largest_batch", "BatchFit", "TpuEstimate", "Suggestion", "compile_graph", "compile_graph_async",
    "bucket_costs", "target", "TARGETS", "Target", "Chip", "default_target", "available", "versions",
    "cache_dir", "cache_info", "worker_pid", "stop", "TargetError", "TpuCompileError", "TpuCompilerMissingError",
    "WorkerError", "Follower", "follow", "follower", "unfollow", "line", "require", "gb", "Refusal", "Allocation",
    "refusal", "compilers", "envs", "compiler", "Compiler", "CompilerError", "CompilerEnvError", "RUNTIMES",
    "compare", "Comparison", "MemoryBreakdown", "MemoryRow", "Buffer", "memory", "dump", "advice",
]
