"""The torch_xla adapter: the only module of tpukit that imports torch_xla.

torch_xla is imported lazily, on first use, so that ``import tpukit`` is cheap
and so that tpukit can set environment variables (device kind, virtual CPU
devices, compile tracing) *before* the runtime reads them. Every function here
is a thin wrapper over the current torch_xla API; when torch_xla changes (or is
replaced by a native backend) this is the one file to edit.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable, Sequence

from ..errors import RuntimeStateError, TorchXlaMissingError, VersionMismatchError

_MODULES: dict[str, Any] = {}


def is_imported() -> bool:
    """True when torch_xla has been imported in this process (by anyone)."""
    return "torch_xla" in sys.modules


def _module(name: str = "torch_xla"):
    mod = _MODULES.get(name)
    if mod is None:
        mod = _MODULES[name] = _import(name)
        _watch_eager_mode()
    return mod


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        from .. import environment

        text = str(exc)
        if "undefined symbol" in text or "torch_xla/_XLAC" in text:
            v = environment.versions()
            raise VersionMismatchError(
                f"torch_xla {v.get('torch_xla')} cannot load with torch {v.get('torch')}: "
                f"its C extension was built for another torch release ({text.splitlines()[0][:160]}). "
                f"Install a matching pair: {environment.install_command()}"
            ) from None
        if exc.name and exc.name.split(".")[0] == "torch_xla":
            raise TorchXlaMissingError(
                "torch_xla is not installed in this Python environment. "
                f"Install it with: {environment.install_command()}"
            ) from None
        raise


def torch_xla():
    """The imported ``torch_xla`` module (imports it on first call)."""
    return _module("torch_xla")


def runtime():
    """The ``torch_xla.runtime`` module."""
    return _module("torch_xla.runtime")


def _xm():
    return _module("torch_xla.core.xla_model")


def _met():
    return _module("torch_xla.debug.metrics")


# --------------------------------------------------------------------------- runtime

def runtime_initialized() -> bool:
    """True when the PJRT runtime has started (a device was used). Never starts it."""
    if not is_imported():
        return False
    mod = sys.modules["torch_xla"]
    try:
        return bool(mod._XLAC._xla_runtime_is_initialized())
    except AttributeError:  # torch_xla partially imported
        return False


def device(index: int | None = None):
    """The default XLA device (``torch_xla.device()``); starts the runtime."""
    return torch_xla().device(index)


def sync(wait: bool = False) -> None:
    """Cut the lazy graph and launch it (``torch_xla.sync``); runs step closures."""
    torch_xla().sync(wait=wait)


def wait_device_ops() -> None:
    """Block until every launched execution finished."""
    _xm().wait_device_ops()


def device_type() -> str | None:
    """The PJRT device type: 'TPU', 'CPU', 'CUDA', ..."""
    return runtime().device_type()


def device_count() -> int:
    """Number of devices of the whole runtime (virtual SPMD device aside)."""
    return int(runtime().global_runtime_device_count())


def world_size() -> int:
    """Number of replicas (processes x threads) taking part."""
    return int(runtime().world_size())


def process_count() -> int:
    """Number of processes in the job."""
    return int(runtime().process_count())


def global_ordinal() -> int:
    """This replica's global ordinal (0 is the master)."""
    return int(runtime().global_ordinal())


def use_spmd() -> None:
    """Switch the runtime to SPMD mode (call before creating device tensors)."""
    runtime().use_spmd()


def is_spmd() -> bool:
    """True when SPMD mode is on. Does not import torch_xla when it is not loaded."""
    if not is_imported():
        return os.environ.get("XLA_USE_SPMD", "") in ("1", "true", "True")
    return bool(runtime().is_spmd())


def initialize_cache(path: str, readonly: bool = False) -> None:
    """Enable torch_xla's persistent compilation cache at ``path``."""
    runtime().initialize_cache(path, readonly=readonly)


def accelerator_type() -> str | None:
    """The accelerator model as the runtime names it (e.g. 'v5litepod-8'), or None."""
    try:
        attrs = runtime().global_runtime_device_attributes()
    except Exception:
        attrs = []
    for attr in attrs or []:
        for key in ("accelerator_type", "device_kind", "name"):
            if attr.get(key):
                return str(attr[key])
    return None


def version() -> str:
    """torch_xla's version string."""
    return str(getattr(torch_xla(), "__version__", "unknown"))


def memory_info(dev=None) -> dict | None:
    """Device memory use in bytes, or None where the device does not report it (CPU)."""
    try:
        info = _xm().get_memory_info(dev if dev is not None else device())
    except Exception:
        return None
    if not info:
        return None
    used = info.get("bytes_used", info.get("kb_total", 0) and None)
    limit = info.get("bytes_limit")
    if used is None and "kb_total" in info:  # older key layout
        used = (info["kb_total"] - info["kb_free"]) * 1024
        limit = info["kb_total"] * 1024
    return {"bytes_used": int(used or 0), "bytes_limit": int(limit or 0)}


# --------------------------------------------------------------------------- metrics


def metric_data(name: str):
    """``(count, accumulator, samples)`` of one metric, or None if never recorded."""
    return _met().metric_data(name)


def counter_names() -> list[str]:
    """Names of torch_xla's counters (plain event counts)."""
    return list(_met().counter_names())


def counter_value(name: str) -> int | None:
    """Value of one counter, or None if it was never incremented."""
    return _met().counter_value(name)


# --------------------------------------------------------------------------- tensors

def add_step_closure(fn: Callable[..., Any], args: Sequence[Any] = (), run_async: bool = False) -> None:
    """Run ``fn(*args)`` right after the next sync, when tensor values are on hand."""
    _xm().add_step_closure(fn, args=tuple(args), run_async=run_async)


def is_xla_tensor(t: Any) -> bool:
    """True for a torch tensor that lives on an XLA device."""
    dev = getattr(t, "device", None)
    return dev is not None and getattr(dev, "type", None) == "xla"


def pending_ir(tensors: Sequence[Any]) -> str:
    """The lazy IR text that would compute ``tensors``."""
    return torch_xla()._XLAC._get_xla_tensors_text(list(tensors))


def pending_hlo(tensors: Sequence[Any]) -> str:
    """The HLO text that would compute ``tensors``."""
    return torch_xla()._XLAC._get_xla_tensors_hlo(list(tensors))


# --------------------------------------------------------------------------- checkpoints

def rng_seed() -> int:
    """The default XLA device's running random-number seed (advanced by every random op traced)."""
    return int(torch_xla()._XLAC._xla_get_rng_seed(str(torch_xla()._XLAC._xla_get_default_device())))


def set_rng_seed(seed: int) -> None:
    """Set the default XLA device's running random-number seed (``xm.set_rng_state``)."""
    torch_xla()._XLAC._xla_set_rng_seed(int(seed), str(torch_xla()._XLAC._xla_get_default_device()))


def tensor_id(t: Any) -> int:
    """torch_xla's id of an XLA tensor; equal ids: the same data (tied weights, ``state_dict()`` detaches)."""
    return int(torch_xla()._XLAC._xla_get_tensor_id(getattr(t, "global_tensor", t)))


def to_cpu(tensors: Sequence[Any], sync: bool = True) -> list:
    """Copy XLA tensors (``nn.Parameter`` and ``XLAShardedTensor`` too, sharded ones whole) to new CPU
    tensors in one batch, computing pending values first unless ``sync=False`` (already device data)."""
    tensors = [getattr(t, "global_tensor", t) for t in tensors]
    if not tensors:
        return []
    xlac = torch_xla()._XLAC
    if sync:  # tensors already synced (e.g. logged values) need no graph run, only the copy
        xlac._xla_sync_multi(tensors, devices=[], wait=True, sync_xla_data=False)
    return list(xlac._xla_get_cpu_tensors(tensors))


# --------------------------------------------------------------------------- SPMD and replicas (tpukit.spmd, tpukit.launch)

def _xs():
    return _module("torch_xla.distributed.spmd")


def make_mesh(shape: Sequence[int], axis_names: Sequence[str]):
    """A ``torch_xla.distributed.spmd.Mesh`` over every global device, in device-id order."""
    import numpy as np

    return _xs().Mesh(np.arange(device_count()), tuple(int(s) for s in shape), tuple(axis_names))


def rename_mesh_axes(mesh: Any, axis_names: Sequence[str]):
    """A mesh with the same devices and shape as ``mesh`` under other axis names."""
    return _xs().Mesh(mesh.device_ids, tuple(mesh.mesh_shape), tuple(axis_names))


def mesh_axes(mesh: Any) -> dict[str, int]:
    """``{axis name: number of devices}`` of a mesh, in axis order."""
    return {str(name): int(size) for name, size in mesh.shape().items()}


def is_mesh(obj: Any) -> bool:
    """True for a ``torch_xla.distributed.spmd.Mesh`` (never imports torch_xla)."""
    return is_imported() and isinstance(obj, _xs().Mesh)


def mark_sharding(t: Any, mesh: Any, partition_spec: Sequence[Any]) -> None:
    """Annotate an XLA tensor's sharding in place; ``t`` stays a plain ``torch.Tensor``."""
    _xs().mark_sharding(t, mesh, tuple(partition_spec))


def to_device_sharded(t: Any, mesh: Any, partition_spec: Sequence[Any]):
    """Copy a CPU tensor to the SPMD device, each shard straight to its own device."""
    spec = _xs().ShardingSpec(mesh, tuple(partition_spec))
    return _xm().send_cpu_data_to_device(t, device(), spec)[0]


def sharding_spec(t: Any) -> str:
    """The XLA sharding of a device tensor as text (e.g. '{devices=[4,1]0,1,2,3}'); '' if none."""
    return str(torch_xla()._XLAC._get_xla_sharding_spec(t))


def is_sharded(t: Any) -> bool:
    """True for an XLA tensor split over several devices (a sharding that is not replicated)."""
    spec = sharding_spec(getattr(t, "global_tensor", t)) if is_xla_tensor(t) else ""
    return bool(spec) and "replicated" not in spec and "maximal" not in spec


def spmd_checkpoint_planners() -> tuple[Any, Any]:
    """torch_xla's (save, load) planners for ``torch.distributed.checkpoint`` with sharded tensors."""
    dc = _module("torch_xla.experimental.distributed_checkpoint")
    return dc.SPMDSavePlanner(), dc.SPMDLoadPlanner()


def prime_optimizer(optimizer: Any) -> None:
    """Create an optimizer's state (a zero-gradient step) so a sharded checkpoint can load into it."""
    _module("torch_xla.experimental.distributed_checkpoint").prime_optimizer(optimizer)


class _FirstDimSharding:
    """``input_sharding`` for torch_xla's loaders: split dim 0 of every tensor over one mesh axis, with
    one ``ShardingSpec`` per rank (a batch mixes ranks); scalars replicated; ``check(t)`` may raise first."""

    minibatch = False

    def __init__(self, mesh: Any, axis: str, check: Callable[[Any], None] | None = None):
        self._mesh, self._axis, self._check = mesh, axis, check
        self._specs: dict[int, Any] = {}

    def can_apply(self, t: Any) -> bool:
        return t.dim() >= 1

    def xla_spec(self, t: Any):
        if t.dim() == 0:
            return None
        if self._check is not None:
            self._check(t)
        spec = self._specs.get(t.dim())
        if spec is None:
            spec = self._specs[t.dim()] = _xs().ShardingSpec(self._mesh, (self._axis,) + (None,) * (t.dim() - 1))
        return spec.xla_spec(t)


def first_dim_sharding(mesh: Any, axis: str, check: Callable[[Any], None] | None = None) -> _FirstDimSharding:
    """An ``input_sharding`` for ``MpDeviceLoader`` that splits every batch tensor's dim 0 over ``axis``."""
    return _FirstDimSharding(mesh, axis, check)


def mp_device_loader(loader: Any, dev: Any, input_sharding: Any = None, sync_each_batch: bool = True):
    """``MpDeviceLoader``: background host-to-device copies; syncs before yielding each batch
    unless ``sync_each_batch`` is False (then only when the loader is exhausted)."""
    pl = _module("torch_xla.distributed.parallel_loader")
    kwargs = {} if input_sharding is None else {"input_sharding": input_sharding}
    if not sync_each_batch:
        kwargs["batches_per_execution"] = sys.maxsize  # its next() never syncs: the caller does
    return pl.MpDeviceLoader(loader, dev, **kwargs)


def spmd_fsdp(module: Any, mesh: Any, shard_output: Callable[[Any, Any], None]):
    """Wrap ``module`` in torch_xla's ``SpmdFullyShardedDataParallel`` (mesh needs an 'fsdp' axis)."""
    mod = _module("torch_xla.experimental.spmd_fully_sharded_data_parallel")
    return mod.SpmdFullyShardedDataParallel(module, mesh=mesh, shard_output=shard_output)


def local_process_count() -> int:
    """Processes torch_xla's launcher starts on this host: one per chip on TPU, 1 on CPU/GPU (mirrors
    ``torch_xla._internal.pjrt.run_multiprocess``; does not start the runtime)."""
    plugins = _module("torch_xla.experimental.plugins")
    if plugins.using_dynamic_plugins():
        return int(plugins.default().physical_chip_count())
    kind = device_type()
    if kind == "TPU":
        return int(_module("torch_xla._internal.tpu").num_local_processes())
    if kind == "NEURON":
        return int(_module("torch_xla._internal.neuron").num_local_processes())
    return 1


class _IndexedCall:
    """``fn(global ordinal, *args)`` returning its value (torch_xla's ``_SpawnFn`` drops it)."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any]):
        self.fn, self.args = fn, tuple(args)

    def __call__(self):
        return self.fn(global_ordinal(), *self.args)


def run_replica_process(local_rank: int, local_world_size: int, fn: Callable[..., Any],
                        args: Sequence[Any]) -> dict[int, Any]:
    """Body of one ``xmp.spawn`` process (a fresh one): set up its chips with torch_xla 2.9's private ``pjrt``
    helpers, as ``torch_xla.launch`` does, run ``fn`` in one thread per device; ``{global ordinal: value}``."""
    pjrt = _module("torch_xla._internal.pjrt")
    return dict(pjrt._run_thread_per_device(local_rank, local_world_size, fn=_IndexedCall(fn, args),
                                            initializer_fn=pjrt.initialize_multiprocess))


def run_single_process(fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    """``xmp.spawn(nprocs=1)``: one replica on one chip in this process; returns ``fn(0, *args)``."""
    pjrt = _module("torch_xla._internal.pjrt")
    return pjrt._run_singleprocess(_IndexedCall(fn, args))


# --------------------------------------------------------------------------- lazy state (tpukit.magics)

def has_pending(tensors: Sequence[Any]) -> list[bool]:
    """For each XLA tensor, True when it holds a computation not yet run (lazy IR), asking torch_xla: synced
    or freshly transferred data is False; a result of ops, or a view of device data, True until the sync."""
    tensors = list(tensors)
    if not tensors:
        return []
    return [bool(x) for x in torch_xla()._XLAC._check_tensor_need_materialization(tensors)]


# --------------------------------------------------------------------------- profiler (tpukit.profile)

def profiler_start(logdir: str) -> None:
    """Start torch_xla's in-process profiler session (``xp.start_trace``): host and device activity until
    :func:`profiler_stop` writes it under ``logdir`` (unlike ``xp.trace_detached``'s fixed duration)."""
    try:
        _module("torch_xla.debug.profiler").start_trace(str(logdir))
    except RuntimeError as exc:  # "Profile has already been started"
        raise RuntimeStateError(
            f"a torch_xla profiler trace is already running ({exc}); only one can run at a time. "
            "Let the other profile finish (leave its `with` block) before starting this one.") from None


def profiler_stop() -> None:
    """Stop :func:`profiler_start`'s session; writes ``<logdir>/plugins/profile/<run>/<host>.xplane.pb``."""
    _module("torch_xla.debug.profiler").stop_trace()


# --------------------------------------------------------------------------- eager mode (tpukit.eager)

_EAGER_HOOKS: list[Callable[[bool], None]] = []


def on_eager_mode(fn: Callable[[bool], None]) -> None:
    """Call ``fn(enabled)`` each time eager mode is switched (and now if it is on): ``eager_mode()``, its
    context manager and ``torch_xla.compile`` all call ``_XLAC._set_use_eager_mode``, which this wraps."""
    _EAGER_HOOKS.append(fn)
    if is_imported():
        _watch_eager_mode()


def _watch_eager_mode() -> None:
    xlac = getattr(sys.modules.get("torch_xla"), "_XLAC", None)
    setter = getattr(xlac, "_set_use_eager_mode", None)
    if not _EAGER_HOOKS or setter is None or hasattr(setter, "tpukit_original"):
        return

    def set_use_eager_mode(enable: bool) -> None:
        setter(enable)
        for hook in _EAGER_HOOKS:
            hook(bool(enable))

    set_use_eager_mode.tpukit_original = setter
    xlac._set_use_eager_mode = set_use_eager_mode
    if xlac._get_use_eager_mode():
        set_use_eager_mode(True)
