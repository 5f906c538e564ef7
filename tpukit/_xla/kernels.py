"""torch_xla's Pallas kernels, traced here for the TPU compiler: flash attention without a TPU.

torch_xla's flash attention (``torch_xla.experimental.custom_kernel.flash_attention``) is a Pallas kernel:
at trace time it asks jax to lower the kernel and puts the result in the graph as a ``tpu_custom_call``. jax
lowers it for the platform of its default backend, which is the CPU here, and Pallas refuses that ("Only
interpret mode is supported on CPU backend"). Lowered for the TPU platform instead (``lowering_platforms=
("tpu",)``, what :func:`for_tpu` does while a step is traced), the kernel is the same Mosaic program a TPU
host's trace puts in the graph, and the TPU compiler compiles it ahead of time (measured here: a causal
2 x 4 x 1024 x 64 forward and backward compiles for a v5e with libtpu 0.0.21.1 and 0.0.17).

The Mosaic program is serialized at a version of its format, which a libtpu reads up to a limit: jax 0.7.2
writes version 7 when it lowers without a TPU, libtpu 0.0.21.1 reads it, libtpu 0.0.17 (Kaggle's) refuses it
("Unsupported version: expected <= 4 but got 7") and reads the same kernel written at version 4.
``for_tpu(version)`` writes the version given; :func:`mosaic_version_wanted` reads a refusal's limit. The
kernel is compiled after the compiler's buffer assignment: a compile stopped there (``ask(early=True)``) says
nothing of whether the kernel compiles, so a full compile comes first.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

_WANTS = re.compile(r"Unsupported version: expected <= (\d+) but got \d+")


def mosaic_version_wanted(message: str | None) -> int | None:
    """The Mosaic format version a TPU compiler's refusal says it reads at most, or None when the refusal is
    about something else."""
    m = _WANTS.search(message or "")
    return int(m.group(1)) if m else None


@contextlib.contextmanager
def for_tpu(version: int | None = None) -> Iterator[None]:
    """While inside, torch_xla's Pallas kernels (flash attention) are lowered for the TPU, not this host's
    backend, and serialized at Mosaic format ``version`` (None: jax's own choice). For tracing a step for the
    TPU compiler only: the graph cannot run on XLA:CPU."""
    import torch

    from .loader import torch_xla

    torch_xla()
    import jax

    # jax in this process lowers only: its backends are XLA:CPU's. Left to itself it would also start the TPU
    # backend, loading libtpu beside torch_xla's runtime (the kit keeps libtpu in the compiler's worker).
    if not _backends_started(jax):
        jax.config.update("jax_platforms", "cpu")
    import jax._src.tpu_custom_call as tpu_custom_call
    import torch_xla.experimental.custom_kernel as kernels

    real_trace, real_version = kernels.trace_pallas, tpu_custom_call.get_ir_version

    def trace_pallas(kernel: Any, *args: Any, static_argnums: Any = None, static_argnames: Any = None,
                     use_cache: bool = False, **kwargs: Any) -> tuple[Any, list]:
        # torch_xla's own trace_pallas, lowered for the TPU (its cache is skipped: the payload depends on it)
        import jax._src.pallas.mosaic.pallas_call_registration  # noqa: F401  (registers the TPU lowering)

        shapes = [kernels.to_jax_shape_dtype_struct(a) if torch.is_tensor(a) else a for a in args]
        lowered = jax.jit(kernel, static_argnums=static_argnums, static_argnames=static_argnames).trace(
            *shapes, **kwargs).lower(lowering_platforms=("tpu",))
        return kernels._extract_backend_config(lowered.compiler_ir()), [a for a in args if torch.is_tensor(a)]

    kernels.trace_pallas = trace_pallas
    if version is not None:
        tpu_custom_call.get_ir_version = lambda ctx: version
        jax.clear_caches()  # jax keeps lowered kernels by their arguments, not by the version they were written at
    try:
        yield
    finally:
        kernels.trace_pallas, tpu_custom_call.get_ir_version = real_trace, real_version
        if version is not None:
            jax.clear_caches()


def _backends_started(jax: Any) -> bool:
    """Whether jax has started its backends in this process (its platforms can no longer be chosen)."""
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", None))


def flash_attention(query: Any, key: Any, value: Any, scale: float | None = None, causal: bool = True) -> Any:
    """torch_xla's Pallas flash attention of ``[batch, heads, length, head_dim]`` tensors (key and value heads
    repeated to the query's when fewer: grouped-query attention); ``scale`` defaults to ``head_dim ** -0.5``."""
    from .loader import torch_xla

    torch_xla()
    from torch_xla.experimental.custom_kernel import flash_attention as pallas_flash

    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return pallas_flash(query, key, value, causal=causal,
                        sm_scale=float(scale if scale is not None else query.shape[-1] ** -0.5))
