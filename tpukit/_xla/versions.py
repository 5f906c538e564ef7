"""The torch_xla releases tpukit supports, and the named gates where they differ.

Two releases matter: torch_xla 2.8 (Kaggle's TPU image) and torch_xla 2.9
(Colab's TPU runtime, and the last release). Every place where the adapter
behaves differently by release tests a gate named here, with
:func:`at_least`, so that the differences are listed in one file and the
day a release drops out of use its gates can be found and removed.

Compared for the calls tpukit makes (the Python sources of both wheels, and
the ``_XLAC`` functions the adapter uses, present in both):

- ``torch_xla.device``, ``torch_xla.sync``, the metrics API, the eager-mode
  switch, the profiler session, ``parallel_loader`` and the SPMD checkpoint
  planners are the same in 2.8 and 2.9.
- 2.8 still runs on CUDA (``PJRT_DEVICE=CUDA``, one launcher process per GPU,
  ``torch_xla._internal.gpu``); 2.9 removed it: :data:`CUDA_REMOVED`.
- 2.9's ``XLAShardedTensor`` subclasses ``DTensor``; 2.8's is a plain
  ``torch.Tensor`` subclass. Both keep the whole tensor in ``.global_tensor``,
  which is all the adapter reads, so no gate is needed there.

This module never imports torch_xla: it reads the installed version from the
package metadata, so a gate can be tested before the runtime starts.
"""

from __future__ import annotations

import functools

from .. import environment

KAGGLE = (2, 8)  # torch_xla on Kaggle's TPU image (a v5e-8)
COLAB = (2, 9)  # torch_xla on Colab's TPU runtime (a v5e-1); the last torch_xla release
OLDEST = KAGGLE  # the oldest release tpukit is tested with

CUDA_REMOVED = (2, 9)  # from 2.9 on, no CUDA device and no per-GPU launcher processes


@functools.lru_cache(maxsize=1)
def installed() -> tuple[int, int] | None:
    """(major, minor) of the installed torch_xla, or None when it is not installed."""
    release = environment._release(environment.versions()["torch_xla"])
    return release[:2] if release else None


def at_least(gate: tuple[int, int]) -> bool:
    """True when the installed torch_xla is ``gate`` or newer (a missing torch_xla counts as newest)."""
    release = installed()
    return release is None or release >= gate
