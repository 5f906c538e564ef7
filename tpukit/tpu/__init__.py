"""TPU truth without a TPU: the real TPU compiler (libtpu, compile-only, in a worker process) for any target.

Two rooms, along the process line:

- :mod:`.compiler` (the far side: nothing of torch): the TPU slices (:mod:`~.compiler.targets`), which
  compiler answers (:mod:`~.compiler.pins`), its environment, worker process, flags, answer cache and
  refusal reading.
- The rest (this process): :mod:`.trace` turns a step into a graph without running it; :mod:`.ask` is the one
  seam from a traced step to an outcome (:mod:`.outcome`: :class:`TpuEstimate`, its status, its forms) and
  where names become objects; :mod:`.estimate`, :mod:`.search` (:func:`largest_batch`), :mod:`.compare`,
  :mod:`.recorded` (:func:`compile_graph` of a graph the kit recorded) and :mod:`.followers` (every recorded
  graph, in the background) all call it; :mod:`.memory` and :mod:`.dump` say why (the HBM at the peak by
  kind and line), :mod:`.advice` what to change (one list, each checked by a compile); :mod:`.plan`
  (:func:`plan`) answers for a decoder LM in its fine-tuning modes (:mod:`.modes`), per sequence length, as
  one table (:mod:`.table`), and :func:`fit` for one of its steps, with what to change.

The public names below are bound on first use (importing :mod:`.compiler` alone, as the runtime does, loads
nothing of this side). The parent process never loads libtpu: only :mod:`.compiler._jax`, in the worker,
imports jax for the TPU compiler (``tpukit._xla.kernels`` has jax, on its CPU platform, lower torch_xla's
Pallas kernels while a ``+flash`` step is traced, as torch_xla itself does).
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module that defines it.
_WHERE = {
    "estimate": "estimate", "largest_batch": "search", "BatchFit": "search", "compare": "compare",
    "Comparison": "compare", "TpuEstimate": "outcome", "Suggestion": "outcome", "TpuCompileError": "outcome",
    "line": "outcome", "gb": "outcome", "compile_graph": "recorded", "compile_graph_async": "recorded",
    "bucket_costs": "recorded", "Follower": "followers", "follow": "followers", "follower": "followers",
    "unfollow": "followers", "MemoryBreakdown": "memory", "MemoryRow": "memory", "Buffer": "memory",
    "check": "tools", "require": "tools", "worker_pid": "tools", "stop": "tools",
    "target": "compiler", "TARGETS": "compiler", "Target": "compiler", "TargetError": "compiler",
    "RUNTIMES": "compiler", "Compiler": "compiler", "CompilerError": "compiler", "Refusal": "compiler",
    "available": "compiler", "versions": "compiler", "cache_dir": "compiler", "cache_info": "compiler",
    "TpuCompilerMissingError": "compiler", "WorkerError": "compiler", "CompilerEnvError": "compiler",
    "BudgetSpent": "compiler", "TpuProgress": "progress", "plan": "plan", "Plan": "table", "fit": "plan", "Fit": "table",
}
__all__ = list(_WHERE)
_MODULES = ("trace", "outcome", "progress", "dump", "memory", "ask", "search", "advice", "estimate", "compare", "recorded",
            "followers", "tools", "modes", "table", "plan")


def _load() -> None:
    """Import this side's modules and bind the public names (a submodule's import binds its own name on this
    package: ``estimate`` is a module and a function, so the function is bound after)."""
    for name in _MODULES:
        importlib.import_module(f".{name}", __name__)
    for name, where in _WHERE.items():
        globals()[name] = getattr(importlib.import_module(f".{where}", __name__), name)


def __getattr__(name: str) -> Any:
    if name in _WHERE or name in _MODULES:
        _load()
        return globals()[name] if name in _WHERE else importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'tpukit.tpu' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE) | set(_MODULES))
