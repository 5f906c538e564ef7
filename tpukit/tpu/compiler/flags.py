"""The TPU compiler's flags for an estimate: the ones torch_xla's runtime sets on a TPU host, under the user's own.

On a TPU host, torch_xla sets libtpu flags before libtpu starts
(``torch_xla/__init__.py``, ``_setup_libtpu_flags``; the same in 2.8 and 2.9),
each only when ``LIBTPU_INIT_ARGS`` does not name it already. They change what
the compiler builds: with libtpu's own default, an attention graph is rewritten
into flash attention, which torch_xla turns off, so a step compiled without
them gets other temporaries and FLOPs than the user's runtime compiles (seen:
an 8192-token attention step, 8.91 GB of temporaries and 0.81 TFLOP with
libtpu's defaults, 8.73 GB and 0.95 TFLOP with torch_xla's). The estimate
compiles with torch_xla's flags for the target's generation; a flag the user
names in ``LIBTPU_INIT_ARGS`` is the user's (the worker inherits it).
"""

from __future__ import annotations

import os

from .targets import Target

# torch_xla's _setup_libtpu_flags, the flags that shape the compiled program (its one runtime-only flag,
# xla_tpu_use_enhanced_launch_barrier, is left out: a compile does not take it).
TORCH_XLA_FLAGS = {
    "xla_latency_hiding_scheduler_rerun": "1",
    "xla_tpu_prefer_async_allgather_to_allreduce": "true",
    "xla_tpu_enable_flash_attention": "false",
}
# ... and on TPU v5 (v5e and v5p) only.
TORCH_XLA_V5_FLAGS = {
    "xla_enable_async_all_gather": "true",
    "xla_enable_async_collective_permute": "true",
}


def user_flags(text: str | None = None) -> dict[str, str]:
    """The flags named in ``LIBTPU_INIT_ARGS`` (or ``text``): ``--name=value`` -> {name: value}."""
    text = os.environ.get("LIBTPU_INIT_ARGS", "") if text is None else text
    found = {}
    for word in text.split():
        name, _, value = word.lstrip("-").partition("=")
        if name:
            found[name] = value or "true"
    return found


def compile_flags(target: Target, libtpu_init_args: str | None = None) -> dict[str, str]:
    """The flags torch_xla would set for ``target``'s chip, less those ``LIBTPU_INIT_ARGS`` names."""
    flags = dict(TORCH_XLA_FLAGS)
    if target.chip.name.startswith("v5"):
        flags.update(TORCH_XLA_V5_FLAGS)
    mine = user_flags(libtpu_init_args)
    return {k: v for k, v in flags.items() if k not in mine}
