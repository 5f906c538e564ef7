"""``tpukit.setup()``: configure the XLA runtime once and describe it honestly; ``rank()``.

The runtime reads its settings (device kind, number of virtual CPU devices,
compile tracing) from environment variables when it starts, and cannot be
reconfigured afterwards. ``setup()`` therefore does everything that must happen
before the start first, then starts the runtime and returns a frozen
:class:`Runtime` record. Settings that could not be applied (because the runtime
had already started) are reported in ``Runtime.problems`` and warned about once
(``TpukitWarning``, saying who started it and what to do), never dropped.
``rank()`` says which replica this process is (under ``tpukit.launch``). The records
(:class:`Request`, :class:`Runtime` and its report) are in :mod:`tpukit.runtime_record`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import warnings

from ._version import __version__
from . import _ipython, _stderr, _xla, cache, compiles, environment
from .tpu import compiler as tpu_compilers
from .runtime_record import Request, Runtime
from .errors import DeviceNotFoundError, TorchXlaMissingError, TpukitWarning, VersionMismatchError

DEVICE_CHOICES = ("auto", "tpu", "cpu")
METRIC_SAMPLES_ENV, METRIC_SAMPLES = "XLA_METRICS_SAMPLES", "64"  # set it yourself to keep more
TARGET_ENV = "TPUKIT_TARGET"  # the TPU the user means to run on, e.g. "v5e-8" (see tpukit.tpu.TARGETS)
COMPILER_ENV = "TPUKIT_COMPILER"  # the TPU compiler that answers, e.g. "torch_xla 2.9" (see tpukit.tpu.compiler.pins)
RANK_ENV = "TPUKIT_REPLICA_RANK"  # set by tpukit.launch in independent replicas, by run_on_slice on each host
GSPMD_NOTICE = "GSPMD sharding propagation is going to be deprecated"  # XLA's C++ log at each SPMD compile (2.8/2.9)


_LOCK = threading.RLock()
_STATE: tuple[Runtime, Request] | None = None
_WARNED: set[str] = set()  # the problems setup() has warned about in this process


def _trace_row(path: str | None) -> str:
    """The report's row for the trace file: its name and where it lives in words, not a machine's temp
    path (the report is kept in saved notebooks); the full path is ``Runtime.trace_file``."""
    if not path:
        return "off (counts only, no causes)"
    if compiles.config.inherited(path) or os.path.dirname(path) == compiles.config.folder():
        return f"on ({os.path.basename(path)} in tpukit's temp folder; Runtime.trace_file has the path)"
    return f"on (into {path}, set by PT_XLA_DEBUG_FILE)"


def current() -> Runtime | None:
    """The Runtime returned by the first ``setup()`` in this process, or None."""
    return _STATE[0] if _STATE else None


def started() -> bool:
    """True once the XLA runtime runs (a device was used); never starts it or imports torch_xla."""
    return _xla.runtime_initialized()


def trace_file() -> str | None:
    """Path of the compile-trace file torch_xla writes to in this process, if tracing is on."""
    rt = current()
    return rt.trace_file if rt is not None else compiles.trace_file()


def _validate(req: Request) -> None:
    if req.device not in DEVICE_CHOICES:
        raise ValueError(f"device={req.device!r} is not one of {DEVICE_CHOICES}; use 'auto' to let tpukit pick.")
    if req.cpu_devices is not None and (not isinstance(req.cpu_devices, int) or req.cpu_devices < 1):
        raise ValueError(f"cpu_devices={req.cpu_devices!r} must be a positive int (the number of virtual CPU devices).")


def resolve_device(req: Request, env: environment.Environment) -> str:
    """The PJRT device type ('CPU', 'TPU', ...) ``req`` resolves to here; never starts the runtime."""
    if req.device == "cpu":
        return "CPU"
    if req.device == "tpu":
        if env.has_tpu or (env.pjrt_device or "").upper() == "TPU":
            return "TPU"
        how = environment.SWITCH_TO_TPU.get(env.platform)
        where = f"On {env.platform.capitalize()}: {how}." if how else ""
        raise DeviceNotFoundError(
            f"device='tpu' was requested but no TPU is attached to this {env.platform} machine "
            f"(no TPU device files, PCI devices or TPU environment variables; only the CPU). "
            f"{where} Or call tpukit.setup(device='cpu') to run on XLA:CPU.".replace("  ", " "))
    if env.pjrt_device:
        return env.pjrt_device.upper().split("_")[0]
    return "TPU" if env.has_tpu else "CPU"


def rank() -> int:
    """This replica's rank under ``tpukit.launch()``: the index passed to ``fn`` (torch_xla's global
    ordinal on TPU). 0 outside ``launch()`` and in SPMD, where one process drives all devices.
    Independent XLA:CPU replicas each have a world of one, so ``rank()`` is what tells them apart.
    Under ``tpukit.run_on_slice()`` it is the host index (one SPMD process per host)."""
    env = os.environ.get(RANK_ENV)
    if env:
        return int(env)
    return _xla.global_ordinal() if _xla.runtime_initialized() else 0


def check_installation(env: environment.Environment | None = None) -> environment.Environment:
    """Raise a clear error if torch_xla is missing or does not match torch; never imports it."""
    env = env or environment.inspect()
    if env.versions.get("torch_xla") is None:
        raise TorchXlaMissingError(
            "torch_xla is not installed in this Python environment. Install it with: "
            + environment.install_command(env.platform, env.versions.get("torch")))
    mismatch = environment.version_mismatch(env.versions)
    if mismatch:
        raise VersionMismatchError(mismatch)
    return env


def configure(req: Request | None = None, env: environment.Environment | None = None) -> tuple[str | None, list[str]]:
    """Set the environment variables the runtime reads at start; does not start it.

    Returns the trace-file path (or None) and the problems found. Safe to call
    before torch_xla is imported (that is when it can do the most).
    """
    req = req or Request()
    env = env or environment.inspect()
    kind = resolve_device(req, env)
    if not _xla.is_imported():
        # torch_xla keeps 1024 timing samples per metric and copies them all on every
        # read; tpukit reads counters every step and needs only the newest few.
        os.environ.setdefault(METRIC_SAMPLES_ENV, METRIC_SAMPLES)
    if not _xla.runtime_initialized():
        os.environ["PJRT_DEVICE"] = kind
        if req.cpu_devices and kind == "CPU":
            os.environ["CPU_NUM_DEVICES"] = str(req.cpu_devices)
    if not req.trace_compiles:
        return None, []
    imported = _xla.is_imported()
    trace, problems = compiles.configure(runtime_imported=imported)
    if trace is None and problems and imported and _xla.imported_by():
        # compiles says torch_xla was imported too early, as if by the user; it was tpukit itself
        problems = [f"Compile causes are unavailable: torch_xla was loaded {_started_by()} before tpukit.setup() "
                    "could configure compile tracing (counts still work). Restart the kernel and call tpukit.setup() "
                    "first, before anything that uses the device."]
    return trace, problems


def _started_by() -> str:
    """Who loaded torch_xla before ``setup()`` did: a tpukit call by its public name, or code outside tpukit."""
    by = _xla.imported_by()
    if not by:
        return "by code outside tpukit (your own or a library's)"
    mod, _, fn = by.rpartition(".")
    for pkg in ("tpukit", mod.rpartition(".")[0], mod):  # the shortest public name that is this function
        obj = getattr(sys.modules.get(pkg), fn, None)
        if getattr(obj, "__module__", None) == mod and getattr(obj, "__name__", None) == fn:
            return f"by {pkg}.{fn}()"
    return f"by {by}()"


def _asked(req: Request, first: Request) -> tuple[str, ...]:
    """The settings a later ``setup()`` asks to change: given other than the first call's and other
    than their defaults (a setting left at its default asks for nothing)."""
    default = Request()
    return tuple(f.name for f in dataclasses.fields(Request)
                 if getattr(req, f.name) != getattr(first, f.name) and getattr(req, f.name) != getattr(default, f.name))


def _unapplied(req: Request, rt: Runtime, only: tuple[str, ...] = ("device", "cpu_devices", "spmd", "trace_compiles",
                                                                      "compile_cache"), since: str = "") -> list[str]:
    """Sentences for each requested setting (among ``only``) the running runtime does not have.

    ``since``: how the runtime came to be started already (``"as the first tpukit.setup() call started it"``).
    """
    how = f" ({since})" if since else ""
    fix = "Restart the kernel (or Python) and call tpukit.setup(...) with it before anything uses the device."
    out = []
    if "device" in only and req.device != "auto" and req.device.upper() != rt.device_type:
        out.append(f"device={req.device!r} was requested but the runtime already runs on {rt.device_type}{how}. {fix}")
    if "cpu_devices" in only and req.cpu_devices and rt.device_type == "CPU" and req.cpu_devices != rt.device_count:
        out.append(f"cpu_devices={req.cpu_devices} was requested but the runtime already started with "
                   f"{rt.device_count} CPU device(s){how}. {fix}")
    if "spmd" in only and req.spmd and not rt.spmd:
        out.append(f"spmd=True was requested but the runtime already started without SPMD{how}. {fix}")
    if "trace_compiles" in only and req.trace_compiles and not rt.trace_file:
        out.append("trace_compiles=True was requested but torch_xla was already running without compile "
                   f"tracing{how}, so compile causes are unavailable (counts still work). {fix}")
    if "trace_compiles" in only and not req.trace_compiles and rt.trace_file:
        out.append(f"trace_compiles=False was requested but compile tracing is already on{how} and stays on in this "
                   f"process (into {rt.trace_file}). {fix}")
    if "compile_cache" in only and req.compile_cache is False and rt.compile_cache:
        out.append(f"compile_cache=False was requested but the persistent compile cache is already on{how} and "
                   f"stays on (at {rt.compile_cache}). {fix}")
    if ("compile_cache" in only and isinstance(req.compile_cache, str)
            and not (rt.compile_cache or "").startswith(req.compile_cache)):
        if rt.device_type == "TPU":
            now = f"at {rt.compile_cache}" if rt.compile_cache else "off"
            out.append(f"compile_cache={req.compile_cache!r} was requested but the runtime already started with the "
                       f"compile cache {now}{how}. {fix}")
        else:
            out.append(f"compile_cache={req.compile_cache!r} was requested but the persistent compile cache is "
                       f"{rt.cache_note or 'off'}.")
    return out


def _warn(problems: tuple[str, ...] | list[str]) -> None:
    """One TpukitWarning per problem ``setup()`` could not fix, each distinct sentence once per process."""
    for p in problems:
        if p not in _WARNED:
            _WARNED.add(p)
            warnings.warn(p, TpukitWarning, stacklevel=3)


def tpu_target(name: "str | tpu_compilers.Target | None" = None, ready: bool = False) -> "tpu_compilers.Target | None":
    """The TPU the kit compiles for: ``name`` when given, else the one ``setup(target=...)`` set, else
    ``$TPUKIT_TARGET``; None when there is none. The runtime owns the target and every consumer reads it
    here: ``tpukit.estimate`` and ``largest_batch`` without ``target=``, the follower ``setup`` registers,
    ``%%xla``, the Trainer callback. An unknown name raises, listing the known targets. ``ready=True``
    also checks that the TPU compiler is installed (else a clear error with the install line)."""
    if name is None:
        rt = current()
        name = (rt.target if rt is not None else None) or os.environ.get(TARGET_ENV, "").strip() or None
    if name is None:
        return None
    found = tpu_compilers.target(name)
    if ready:
        tpu_compilers.worker.require(tpu_compilers.resolve(tpu_compiler()))
    return found


def tpu_compiler(name: "str | None" = None) -> str | None:
    """The name of the TPU compiler that answers: ``name`` when given, else the one ``setup(compiler=...)``
    set, else ``$TPUKIT_COMPILER``; None for the default (the libtpu the installed torch_xla's runtime loads).
    The runtime owns it as it owns the target: ``tpukit.estimate``, ``largest_batch``, ``compile_graph`` and
    the follower read it here (:func:`tpukit.tpu.compiler.resolve` resolves it)."""
    if name is None:
        rt = current()
        name = (rt.compiler if rt is not None else None) or os.environ.get(COMPILER_ENV, "").strip() or None
    return name


_TARGET_WATCHERS: list[Callable[[Any, "str | None"], None]] = []


def watch_target(fn: Callable[[Any, "str | None"], None]) -> None:
    """Call ``fn(target, compiler)`` each time ``setup()`` names a target (a :class:`~tpukit.tpu.compiler.Target`)
    or changes the compiler of the one it named (the compiler's name, None: the runtime's own). tpukit.tpu's
    follower registers here when it is imported: the runtime, below it, only says what was set."""
    if fn not in _TARGET_WATCHERS:
        _TARGET_WATCHERS.append(fn)


def _follow(name: str | None, compiler: str | None = None) -> str | None:
    """Compile every graph recorded from now on for :func:`tpu_target` ``(name)`` too, with
    :func:`tpu_compiler` ``(compiler)`` (the watchers do: :func:`watch_target`); the target's name, or None."""
    found = tpu_target(name, ready=True)
    if found is None:
        return None
    for fn in list(_TARGET_WATCHERS):
        fn(found, tpu_compiler(compiler))
    return found.name


def setup(device: str = "auto", cpu_devices: int | None = None, spmd: bool = False,
          compile_cache: str | bool | None = None, trace_compiles: bool = True, target: str | None = None,
          compiler: str | None = None) -> Runtime:
    """Detect the platform, configure and start the XLA runtime, and return its report.

    device: 'auto' (PJRT_DEVICE if set, else TPU if one is attached, else CPU), 'tpu' or 'cpu'.
    cpu_devices: number of virtual XLA:CPU devices (try multi-core code on a laptop).
    spmd: turn on SPMD (one process drives all devices; see tpukit.mesh()).
    compile_cache: the persistent compilation cache (TPU only). By default it is on for a TPU, under
      $TPUKIT_CACHE_DIR (else ~/.cache/tpukit/xla) in a folder keyed by the torch_xla and libtpu
      versions and the topology; a directory puts it there; False turns it off.
    trace_compiles: record every compilation's cause and Python frames for tpukit.compiles.
    target: the TPU you mean to run on ("v5e-1" on Colab, "v5e-8" on Kaggle, ...; default
      ``$TPUKIT_TARGET``): every graph is also compiled for it by the real TPU compiler, in a
      worker process, and what it says (fits in HBM or not, compile time, the step's floor)
      reaches the dashboard, ``%%xla`` and ``tracker.summary()["tpu"]``; ``tpukit.estimate`` and
      ``largest_batch`` compile for it when not given ``target=``. Can be set or changed by a later
      call (:func:`tpu_target` reads it).
    compiler: the TPU compiler that answers (``"torch_xla 2.8"``, ``"libtpu 0.0.17"``, ``"newest"``;
      default ``$TPUKIT_COMPILER``, else the libtpu the installed torch_xla's runtime loads): the target's
      compiles and ``tpukit.estimate`` use it. Can be set or changed by a later call (:func:`tpu_compiler`).

    Idempotent: later calls return the same Runtime. A setting the running runtime cannot
    take (it was started already: by an earlier ``setup()``, or before it by another call
    that used the device) is listed in ``Runtime.problems`` with the fix and warned about
    once (a :class:`~tpukit.TpukitWarning`: restart the kernel and call ``setup()`` first).
    A later call asks only for the settings it gives other than the first call's and other
    than their defaults: ``setup(cpu_devices=4)`` after ``setup(spmd=True)`` does not ask to
    turn SPMD off.
    """
    global _STATE
    req = Request(device, cpu_devices, bool(spmd), compile_cache, bool(trace_compiles))
    _validate(req)
    compiler = tpu_compilers.resolve(compiler).name if compiler is not None else None  # an unknown name raises
    _ipython.watch_cells()  # cell labels on IPython 7 kernels (Colab)
    with _LOCK:
        if _STATE is not None:
            rt, first = _STATE
            if compiler is not None and compiler != rt.compiler:
                rt = dataclasses.replace(rt, compiler=compiler, target=_follow(rt.target, compiler))
                _STATE = (rt, first)
            if target is not None and target != rt.target:
                rt = dataclasses.replace(rt, target=_follow(target, rt.compiler))
                _STATE = (rt, first)
            if req == first or req == Request():
                return rt
            asked = _asked(req, first)
            extra = [p for p in _unapplied(req, rt, only=asked, since="as the first tpukit.setup() call started it")
                     if p not in rt.problems]
            _warn(extra)
            return dataclasses.replace(rt, problems=rt.problems + tuple(extra)) if extra else rt

        env = check_installation()
        started_before = _xla.runtime_initialized()
        since = f"torch_xla was loaded {_started_by()}, before tpukit.setup()" if started_before else ""
        kind = resolve_device(req, env)
        if kind == "TPU" and not started_before:  # another process holding the chips: say which, before torch_xla fails
            environment.check_tpu_free()
        trace, problems = configure(req, env)
        no_tpu = environment.no_tpu_problem(env) if req.device == "auto" else None
        if no_tpu:  # Colab/Kaggle without a TPU: how to switch
            problems.append(no_tpu)

        cache_plan = cache.plan(kind, compile_cache, env, started_before)
        if cache_plan.path:
            cache.enable(cache_plan.path)
        elif isinstance(compile_cache, str) and compile_cache:  # asked for explicitly: say why not
            problems.append(f"The persistent compile cache was not enabled: {cache_plan.note}.")

        _xla.torch_xla()  # import (raises a tpukit error on a broken install)
        if spmd and not _xla.is_spmd():
            if started_before:
                problems.append(f"spmd=True could not be applied: the runtime had already started without SPMD "
                                f"({since}). Restart the kernel and call tpukit.setup(spmd=True) first, before "
                                "anything uses the device.")
            else:
                _xla.use_spmd()
        if _xla.is_spmd():  # XLA's GSPMD notice says nothing to the user, once per compile: drop that line only
            _stderr.filter_stderr(GSPMD_NOTICE)
        dev = _xla.device()
        rt = Runtime(
            platform=env.platform,
            device_type=_xla.device_type() or kind,
            accelerator_type=_xla.accelerator_type() if kind == "TPU" else None,
            device=str(dev),
            device_count=_xla.device_count(),
            process_count=_xla.process_count(),
            world_size=_xla.world_size(),
            spmd=_xla.is_spmd(),
            versions={**env.versions, "tpukit": __version__},
            compile_cache=cache_plan.path,
            trace_file=trace,
            trace_note=_trace_row(trace),
            problems=(),
            tpu_signals=env.tpu_signals,
            bf16=kind == "TPU",
            cache_note=cache_plan.note,
            target=_follow(target, compiler),
            compiler=compiler,
        )
        if started_before:
            problems.extend(_unapplied(req, rt, only=("device", "cpu_devices"), since=since))
        rt = dataclasses.replace(rt, problems=tuple(problems))
        _STATE = (rt, req)
        _warn(rt.problems)
        return rt

