"""The jax/jaxlib/libtpu adapter: the only module of tpukit that imports jax (only ever in the worker process).

libtpu's TPU compiler is reached through jax's compile-only TPU client: a
topology description of a TPU slice (``jax.experimental.topologies``) gives
devices that can be compiled for but never run on, so no chip is opened even on
a TPU host. The HLO module torch_xla traced is turned into MLIR, its donated
arguments (``tf.aliasing_output``) and shardings are written onto the entry
function, and the compiler's memory statistics and cost analysis are read back.

Private jax calls sit behind named version gates, as ``tpukit/_xla.py`` does
for torch_xla: jaxlib 0.10 (``pip install "jax[tpu]"`` here) compiles a parsed
``ir.Module``, jaxlib 0.7.2 (Colab's TPU runtime) takes the module as text;
0.4.38 and 0.5.3 (torch_xla 2.6's and 2.7's) name the extension ``xla_extension``
and take no devices, and 0.4.38 returns one tuple. Each runs in its own
environment (:mod:`tpukit.tpu.envs`), so every gate is read from the versions of
the process it runs in.
"""

from __future__ import annotations

import os
import re
from typing import Any, Sequence

from .installed import versions

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


# Gate: jaxlib 0.7 (0.7.2 checked) compiles for the devices it is given (``executable_devices``); 0.4.38 and
# 0.5.3 (torch_xla 2.6's and 2.7's jax) take no such argument: the devices are the compile options' device
# assignment (one replica, a partition per device).
def _compile_takes_devices() -> bool:
    return _version_tuple(versions()["jaxlib"]) >= (0, 7, 0)


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


# Gate: jaxlib's C++ extension is ``jax._src.lib._jax`` from 0.7 (0.7.2 checked); 0.4.38 and 0.5.3 call it
# ``xla_extension`` (same functions used here).
def _extension() -> Any:
    try:
        from jax._src.lib import _jax
    except ImportError:
        from jax._src.lib import xla_extension as _jax
    return _jax


def _mlir_text(hlo_module_proto: bytes) -> str:
    from jax._src.lib import xla_client

    return str(_extension().mlir.xla_computation_to_mlir_module(xla_client.XlaComputation(hlo_module_proto)))


def _split(shape: Sequence[int], n: int) -> str | None:
    """HLO sharding text splitting one dimension over ``n`` devices: the first when it divides (a batch),
    else the largest that does (FSDP's choice for a parameter); None when none divides."""
    dims = [i for i, d in enumerate(shape) if d >= n and d % n == 0]
    if not dims:
        return None
    dim = 0 if 0 in dims else max(dims, key=lambda i: shape[i])
    tiles = [n if i == dim else 1 for i in range(len(shape))]
    return "{devices=[%s]%s}" % (",".join(map(str, tiles)), ",".join(map(str, range(n))))


# Gate: jaxlib 0.4.38 (torch_xla 2.6's jax) turns a module into MLIR whose entry function returns one tuple, and
# a donated argument may then only alias output 0 ("Aliasing output must be 0 if only one output exists"): the
# tuple's elements are made the function's results, as 0.5.3 and later give them (the same program).
def _returns_one_tuple() -> bool:
    return _version_tuple(versions()["jaxlib"]) < (0, 5, 0)


def _untuple(main: Any) -> None:
    """Make the elements of the entry function's one tuple result its results (see the gate above)."""
    from jax._src.lib.mlir import ir

    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    if len(ftype.results) != 1 or not ir.TupleType.isinstance(ftype.results[0]):
        return
    ret = list(main.regions[0].blocks[0].operations)[-1].operation
    tup = ret.operands[0].owner
    tup = getattr(tup, "operation", tup)
    if tup.name not in ("stablehlo.tuple", "mhlo.tuple"):
        return
    values = list(tup.operands)
    with ir.InsertionPoint(ret):
        ir.Operation.create("func.return", operands=values, loc=ret.location)
    ret.erase()
    tup.erase()
    main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(list(ftype.inputs),
                                                                          [v.type for v in values]))


def _annotate(module: Any, aliases: Sequence[tuple[int, int]], shard_over: int) -> None:
    """Write donation (argument -> output it aliases) onto the entry function and, with ``shard_over`` > 1,
    split every argument that divides over that many devices (an FSDP layout imposed on a 1-device graph)."""
    from jax._src.lib.mlir import ir

    main = None
    for op in module.body.operations:
        if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            main = op
    if main is not None and _returns_one_tuple():
        _untuple(main)
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


def _assignment(devs: list) -> Any:
    """One replica with a partition on each of ``devs``: the device assignment of jaxlib before 0.7."""
    import numpy as np

    return np.array(devs, dtype=object).reshape(1, len(devs))


def compile_hlo(hlo_module_proto: bytes, devs: list, num_partitions: int = 1,
                aliases: Sequence[tuple[int, int]] = (), shard_over: int = 1,
                flags: dict[str, str] | None = None, dump_to: str | None = None) -> dict:
    """Compile an HLO module for ``devs`` (compile-only); the compiler's memory and cost figures.

    ``aliases``: (argument, output index) pairs of donated buffers. ``shard_over``: impose an FSDP
    layout over that many devices (see :func:`_annotate`); otherwise the module's own shardings hold. With
    ``num_partitions`` > 1 the module is SPMD-partitioned and its outputs keep the propagated shardings.
    ``flags``: compiler flags for this compile only (name -> value, as in ``LIBTPU_INIT_ARGS``).
    ``dump_to``: a folder for the compiler's dump of this compile (its optimized HLO, buffer assignment and
    memory-usage report, as text; read by :mod:`tpukit.tpu.memory`).
    Raises whatever the compiler raises (a refusal: ``RESOURCE_EXHAUSTED: ...``).
    """
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    text = _mlir_text(hlo_module_proto)
    # Per-compile flags (jax's compiler_options): jaxlib 0.7.2 and 0.10+ take them as strings.
    overrides: dict[str, Any] = {k: str(v) for k, v in (flags or {}).items()}
    if dump_to:  # boolean options as Python bools: the string "true" is refused
        overrides.update(xla_dump_to=str(dump_to), xla_dump_hlo_as_text=True)
    assignment = {} if _compile_takes_devices() else {"device_assignment": _assignment(devs)}
    options = compiler.get_compile_options(num_replicas=1, num_partitions=num_partitions,
                                           env_options_overrides=overrides or None, **assignment)
    if num_partitions > 1:
        options.executable_build_options.use_spmd_partitioning = True
        options.executable_build_options.allow_spmd_sharding_propagation_to_output = [True]
    if _shardy_unreadable():
        options.executable_build_options.use_shardy_partitioner = False
    client = devs[0].client
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        # torch_xla fixes its outputs' layouts ({0,1} for a gradient made by a transpose); libtpu 0.0.17 fails
        # on a module that names one ("Malformed shape proto: element_type TUPLE should not have a layout",
        # seen on a step that keeps its gradients): the TPU compiler picks its own tiled layouts.
        if "mhlo.xla_entry_computation_result_layout" in module.operation.attributes:
            del module.operation.attributes["mhlo.xla_entry_computation_result_layout"]
        _annotate(module, aliases, shard_over)
        # As text, with its locations (torch_xla's op names and Python source lines: the compiler's dump and
        # refusal name them); str(module) would drop them.
        program = module if _compile_takes_ir_module() else \
            module.operation.get_asm(enable_debug_info=True).encode()
        if _compile_takes_devices():
            exe = client.compile(program, executable_devices=_extension().DeviceList(tuple(devs)),
                                 compile_options=options)
        else:
            exe = client.compile(program, compile_options=options)
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
