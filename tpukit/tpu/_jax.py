"""The jax/jaxlib/libtpu adapter: the only module of tpukit that imports jax (only ever in the worker process).

libtpu's TPU compiler is reached through jax's compile-only TPU client: a
topology description of a TPU slice (``jax.experimental.topologies``) gives
devices that can be compiled for but never run on, so no chip is opened even on
a TPU host. The HLO module torch_xla traced is turned into MLIR, its donated
arguments (``tf.aliasing_output``) and shardings are written onto the entry
function, and the compiler's memory statistics and cost analysis are read back.

Private jax calls sit behind named version gates, as ``tpukit/_xla.py`` does
for torch_xla: jaxlib 0.10 (``pip install "jax[tpu]"`` here) compiles a parsed
``ir.Module``, jaxlib 0.7.2 (Colab's TPU runtime) takes the module as text.
"""

from __future__ import annotations

import os
import re
from typing import Any, Sequence

from ._versions import versions

# libtpu otherwise asks a cloud metadata server for minutes, and a stale /tmp/libtpu_lockfile (left by
# any earlier libtpu process) fails the next start. Both must be set before libtpu loads.
os.environ["TPU_SKIP_MDS_QUERY"] = "1"
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "compile-only")  # silences libtpu's host-bounds warning
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

INSTALL = 'pip install "tpukit[tpu-estimate]"  (or: pip install "jax[tpu]")'

_TOPOLOGIES: dict[tuple[str, tuple[int, ...]], Any] = {}


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def check() -> dict[str, str]:
    """Import jax and libtpu's compile-only client; raise ImportError with the install line when missing."""
    try:
        import jax  # noqa: F401
        from jax.experimental import topologies  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"the TPU compiler (jax with libtpu) is not installed: {exc}. Install it with: {INSTALL}")
    v = versions()
    if not v.get("libtpu"):
        raise ImportError(f"jax is installed but libtpu (the TPU compiler) is not. Install it with: {INSTALL}")
    return v


# Gate: jaxlib >= 0.8 compiles a parsed ir.Module (0.10.2 checked); 0.7.x (Colab: 0.7.2 checked) takes the
# module as bytes (its text, UTF-8).
def _compile_takes_ir_module() -> bool:
    return _version_tuple(versions()["jaxlib"]) >= (0, 8, 0)


# Gate: jax 0.7 asks for the Shardy partitioner by default, and libtpu before 0.0.21 (torch_xla 2.8's 0.0.17,
# which Kaggle's TPU image pairs with jax 0.7.2) drops the sharding of torch_xla's Sharding custom calls on
# that path ("expected CustomCallOp with a sharding attribute"): it compiles them on the GSPMD path. 0.0.21.1
# (Colab's) reads either.
def _shardy_unreadable() -> bool:
    return _version_tuple(versions()["libtpu"]) < (0, 0, 21)


def devices(topology: str, chips_per_host: tuple[int, ...], count: int) -> list:
    """``count`` compile-only devices of a TPU topology (e.g. 'v5e:2x4'); never opens a chip."""
    from jax.experimental import topologies

    key = (topology, tuple(chips_per_host))
    if key not in _TOPOLOGIES:
        _TOPOLOGIES[key] = topologies.get_topology_desc(
            platform="tpu", topology_name=topology, chips_per_host_bounds=tuple(chips_per_host))
    devs = list(_TOPOLOGIES[key].devices)
    if len(devs) < count:
        raise ValueError(f"topology {topology} has {len(devs)} devices, fewer than the {count} asked for")
    return devs[:count]


def _mlir_text(hlo_module_proto: bytes) -> str:
    from jax._src.lib import _jax, xla_client

    return str(_jax.mlir.xla_computation_to_mlir_module(xla_client.XlaComputation(hlo_module_proto)))


def _split(shape: Sequence[int], n: int) -> str | None:
    """HLO sharding text splitting one dimension over ``n`` devices: the first when it divides (a batch),
    else the largest that does (FSDP's choice for a parameter); None when none divides."""
    dims = [i for i, d in enumerate(shape) if d >= n and d % n == 0]
    if not dims:
        return None
    dim = 0 if 0 in dims else max(dims, key=lambda i: shape[i])
    tiles = [n if i == dim else 1 for i in range(len(shape))]
    return "{devices=[%s]%s}" % (",".join(map(str, tiles)), ",".join(map(str, range(n))))


def _annotate(module: Any, aliases: Sequence[tuple[int, int]], shard_over: int) -> None:
    """Write donation (argument -> output it aliases) onto the entry function and, with ``shard_over`` > 1,
    split every argument that divides over that many devices (an FSDP layout imposed on a 1-device graph)."""
    from jax._src.lib.mlir import ir

    main = None
    for op in module.body.operations:
        if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            main = op
    if main is None or not (aliases or shard_over > 1):
        return
    inputs = list(ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).inputs)
    n = len(inputs)
    old = list(main.attributes["arg_attrs"]) if "arg_attrs" in main.attributes else [ir.DictAttr.get({})] * n
    alias_of = dict(aliases)
    i32 = ir.IntegerType.get_signless(32)
    new, out_sharding = [], {}
    for i in range(n):
        entries = {a.name: a.attr for a in ir.DictAttr(old[i])}
        if i in alias_of:
            entries["tf.aliasing_output"] = ir.IntegerAttr.get(i32, alias_of[i])
        spec = _split(ir.ShapedType(inputs[i]).shape, shard_over) if shard_over > 1 else None
        if spec:
            entries["mhlo.sharding"] = ir.StringAttr.get(spec)
        if i in alias_of and "mhlo.sharding" in entries:  # a donated buffer keeps its layout
            out_sharding[alias_of[i]] = entries["mhlo.sharding"]
        new.append(ir.DictAttr.get(entries))
    if out_sharding:
        m = len(ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).results)
        res = list(main.attributes["res_attrs"]) if "res_attrs" in main.attributes else [ir.DictAttr.get({})] * m
        fixed = []
        for o in range(m):
            entries = {a.name: a.attr for a in ir.DictAttr(res[o])}
            if o in out_sharding:
                entries["mhlo.sharding"] = out_sharding[o]
            fixed.append(ir.DictAttr.get(entries))
        main.attributes["res_attrs"] = ir.ArrayAttr.get(fixed)
    main.attributes["arg_attrs"] = ir.ArrayAttr.get(new)


# Gate: the compiler's own peak of the program's HBM (``peak_memory_in_bytes``) is in the memory statistics of
# jaxlib 0.7.2 and 0.12 (checked); older ones lack the attribute, and a compiler that does not fill it in
# leaves 0 there (seen once under libtpu 0.0.17): both are "not reported".
def _peak(stats: Any) -> int | None:
    """The compiler's peak HBM of the program (bytes per chip), or None when it did not report one."""
    peak = getattr(stats, "peak_memory_in_bytes", None)
    return int(peak) if peak else None


def compile_hlo(hlo_module_proto: bytes, devs: list, num_partitions: int = 1,
                aliases: Sequence[tuple[int, int]] = (), shard_over: int = 1,
                flags: dict[str, str] | None = None) -> dict:
    """Compile an HLO module for ``devs`` (compile-only); the compiler's memory and cost figures.

    ``aliases``: (argument, output index) pairs of donated buffers. ``shard_over``: impose an FSDP
    layout over that many devices (see :func:`_annotate`); otherwise the module's own shardings hold. With
    ``num_partitions`` > 1 the module is SPMD-partitioned and its outputs keep the propagated shardings.
    ``flags``: compiler flags for this compile only (name -> value, as in ``LIBTPU_INIT_ARGS``).
    Raises whatever the compiler raises (a refusal: ``RESOURCE_EXHAUSTED: ...``).
    """
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir

    text = _mlir_text(hlo_module_proto)
    # Per-compile flags (jax's compiler_options): jaxlib 0.7.2 and 0.10+ take them as strings.
    options = compiler.get_compile_options(num_replicas=1, num_partitions=num_partitions,
                                           env_options_overrides={k: str(v) for k, v in (flags or {}).items()} or None)
    if num_partitions > 1:
        options.executable_build_options.use_spmd_partitioning = True
        options.executable_build_options.allow_spmd_sharding_propagation_to_output = [True]
    if _shardy_unreadable():
        options.executable_build_options.use_shardy_partitioner = False
    client = devs[0].client
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        _annotate(module, aliases, shard_over)
        program = module if _compile_takes_ir_module() else str(module).encode()
        exe = client.compile(program, executable_devices=_jax.DeviceList(tuple(devs)), compile_options=options)
    stats = exe.get_compiled_memory_stats()
    costs = exe.cost_analysis()
    if isinstance(costs, (list, tuple)):  # older jaxlib: one dict per partition program
        costs = costs[0] if costs else {}
    return {
        "peak_bytes": _peak(stats),
        "arguments_bytes": int(stats.argument_size_in_bytes),
        "outputs_bytes": int(stats.output_size_in_bytes),
        "aliased_bytes": int(stats.alias_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "code_bytes": int(stats.generated_code_size_in_bytes),
        "flops": float(costs.get("flops", 0.0) or 0.0),
        "bytes_accessed": float(costs.get("bytes accessed", 0.0) or 0.0),
    }
