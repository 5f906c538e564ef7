"""The parent's side of the TPU compiler's worker processes: one request in, the compiler's reply out.

libtpu never loads into the process that runs torch_xla: one worker process
per compiler (:class:`~.pins.Compiler`: a jax/libtpu pair) holds jax's
compile-only TPU client and answers one request at a time (:mod:`.serve`). It
runs the Python of that compiler's environment (:mod:`.venvs`: this one's when
the pair is installed here, else its own, built on first use). It starts on
first use, is restarted if it dies, and stops when this process exits. A request
interrupted while the worker compiles it (Jupyter's stop button) stops that
worker: its reply would otherwise answer the next request. Every function here
takes a resolved :class:`~.targets.Target` and :class:`~.pins.Compiler` (the
edge, :mod:`tpukit.tpu.ask`, resolves names once). Answers are kept by
:mod:`.cache`.

The worker's stderr (libtpu's warnings) goes to ``worker.log`` there. libtpu's
own log files, a new one in ``/tmp/tpu_logs`` for every start, are off
(``TPU_LOG_DIR=disabled``) unless ``TPU_LOG_DIR`` names a folder.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import logging
import os
import pickle
import re
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ...errors import TpukitError
from . import cache, pins, venvs
from .cache import cache_dir
from .flags import compile_flags
from .pins import Compiler
from .refusal import is_memory_refusal
from .targets import Target
from .installed import versions

log = logging.getLogger("tpukit")

INSTALL = 'pip install "tpukit[tpu-estimate]"  (or: pip install "jax[tpu]")'
_BOOT = (  # bare packages: the worker runs serve and _jax, no __init__ of tpukit's
    "import sys, types\n"
    "for name, path in (('tpukit', {root!r}), ('tpukit.tpu', {tpu!r}), ('tpukit.tpu.compiler', {here!r})):\n"
    "    m = types.ModuleType(name); m.__path__ = [path]; sys.modules[name] = m\n"
    "from tpukit.tpu.compiler import serve\n"
    "serve.main()\n"
)


def allocator() -> str | None:
    """The mimalloc library the ``tpu-estimate`` extra installs (the ``cmeel-mimalloc`` wheel), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        files = importlib.metadata.files("cmeel-mimalloc") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libmimalloc.so"):
            path = Path(f.locate())
            if path.exists():
                return str(path)
    return None


def allocator_env(env: dict[str, str]) -> dict[str, str]:
    """The worker's ``LD_PRELOAD``: mimalloc, unless ``env`` preloads something already or sets
    ``TPUKIT_TPU_MALLOC=system``. libtpu's compiler spends about a fifth of its time in glibc's malloc;
    with mimalloc a BERT-base step compiled for a v5e in 84 s instead of 103 s here, to the same bytes."""
    if env.get("TPUKIT_TPU_MALLOC", "").strip().lower() == "system" or env.get("LD_PRELOAD", "").strip():
        return {}
    lib = allocator()
    return {"LD_PRELOAD": lib} if lib else {}


class TpuCompilerMissingError(TpukitError, ImportError):
    """The TPU compiler (jax with libtpu) is not installed; the message has the install line."""


class WorkerError(TpukitError):
    """The TPU compiler's worker process could not start or died."""


class BudgetSpent(TpukitError):
    """A time budget ran out before the compiler answered (the compile under way was stopped)."""


def available() -> bool:
    """True when jax and libtpu are installed (without importing them)."""
    v = versions()
    return bool(v["jaxlib"] and v["libtpu"]) and importlib.util.find_spec("jax") is not None


def require(compiler: Compiler) -> dict[str, str]:
    """The versions of the compiler that will answer. One installed here must be complete, else
    :class:`TpuCompilerMissingError` with the install line; any other pair gets its own environment on first
    use (:mod:`.venvs`)."""
    found = compiler.versions()
    if not venvs.is_installed(found):
        return found
    if not available():
        v = versions()
        missing = [d for d in ("jax", "jaxlib", "libtpu") if not v[d]] or ["jax"]
        raise TpuCompilerMissingError(
            f"tpukit's TPU estimates need the TPU compiler ({', '.join(missing)} not installed). "
            f"Install it with: {INSTALL}")
    return found


# What a reply holds: 2 added the compiler's peak (``peak_bytes``). Part of the cache key, so answers kept
# before a change are compiled again rather than read without the new figures. (Replies no longer carry the
# worker's reading of a refusal's figures; the kernel's side reads the refusal's text, which replies of 2 carry
# too, so the format stays 2.)
_REPLY_FORMAT = 2
# The folder of a Jupyter kernel's cells' files (ipykernel: <tmp>/ipykernel_<pid>/<hash of the cell>.py).
_KERNEL_FOLDER = re.compile(rb"ipykernel_[0-9]+")


@dataclass(frozen=True)
class Request:
    """One compile for the worker: an HLO module, the slice to compile it for, donation and layout."""

    hlo: bytes
    target: Target
    num_partitions: int = 1
    aliases: tuple[tuple[int, int], ...] = ()
    shard_over: int = 1  # impose an FSDP layout over this many chips (1: the module's own shardings)
    compiler: Compiler | None = None  # the compiler to answer (resolved by the caller; None: the runtime's own)

    def __post_init__(self):
        if not isinstance(self.compiler, Compiler):
            object.__setattr__(self, "compiler", pins.resolve(self.compiler))

    def versions(self) -> dict[str, str]:
        """The jax, jaxlib and libtpu that answer (the compiler's)."""
        return self.compiler.versions()

    def key(self) -> str:
        """The cache key: the graph (its ops' files without a kernel's process id: the same notebook cell
        asks the same after a kernel restart; an edited cell is another file), the settings, the compiler."""
        h = hashlib.sha256(_KERNEL_FOLDER.sub(b"ipykernel", self.hlo))
        settings = [self.target.topology, self.target.host_bounds, self.devices, self.num_partitions,
                    self.aliases, self.shard_over, sorted(self.versions().items()), sorted(self.flags.items()),
                    os.environ.get("LIBTPU_INIT_ARGS", ""), _REPLY_FORMAT]
        h.update(json.dumps(settings, default=list).encode())
        return h.hexdigest()

    @property
    def devices(self) -> int:
        return max(self.num_partitions, self.shard_over)

    @property
    def flags(self) -> dict[str, str]:
        """The flags torch_xla's runtime would compile this target's graphs with (:mod:`.flags`)."""
        return compile_flags(self.target)

    def message(self) -> dict:
        t = self.target
        return {"op": "compile", "hlo": self.hlo, "topology": t.topology, "host_bounds": t.host_bounds,
                "devices": self.devices, "num_partitions": self.devices, "aliases": self.aliases,
                "shard_over": self.shard_over, "flags": self.flags}


class _Process:
    """One compiler's worker process; ``call`` sends one request and waits for its reply (one at a time)."""

    def __init__(self, found: dict[str, str] | None = None, label: str = "") -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.libtpu_args: str | None = None  # the LIBTPU_INIT_ARGS the running worker's libtpu read
        self.found = found  # the compiler's versions (None: those installed here)
        self.label = label  # its name, for the progress lines of a first build
        self.ids = itertools.count(1)  # each request's id, which its reply carries back

    @property
    def log_path(self) -> Path:
        """The worker's stderr: ``worker.log``, ``worker-<libtpu>-<jax>.log`` for a compiler of its own env."""
        own = self.found is not None and not venvs.is_installed(self.found)
        return cache_dir() / (f"worker-{venvs.key(self.found)}.log" if own else "worker.log")

    def _start(self) -> subprocess.Popen:
        python = venvs.python(self.found, self.label) if self.found is not None else sys.executable
        here = Path(__file__).resolve().parent
        tpu, root = str(here.parent), str(here.parent.parent)
        env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu")
        env.pop("PJRT_DEVICE", None)
        if python != sys.executable:  # torch_xla points these at the libtpu installed here: jax would load it
            for name in ("TPU_LIBRARY_PATH", "PTXLA_TPU_LIBRARY_PATH"):
                env.pop(name, None)
        env.setdefault("TPU_LOG_DIR", "disabled")  # else every start leaves a file in /tmp/tpu_logs
        env.update(allocator_env(env))
        self.libtpu_args = os.environ.get("LIBTPU_INIT_ARGS", "")
        logdir = cache_dir()
        logdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as err:
            return subprocess.Popen([python, "-c", _BOOT.format(root=root, tpu=tpu, here=str(here))],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env)

    def ensure(self) -> None:
        """Start the worker unless it runs (with the current ``LIBTPU_INIT_ARGS``)."""
        with self.lock:
            self._ensure_locked()

    def _ensure_locked(self) -> None:
        if self.proc is not None and self.libtpu_args != os.environ.get("LIBTPU_INIT_ARGS", ""):
            self._stop_locked()  # libtpu reads its flags once, when it loads: a new worker reads the new ones
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()

    def call(self, message: dict, deadline: float | None = None, until: Callable[[], Any] | None = None) -> dict:
        """Send ``message``, wait for its reply. Interrupted while waiting (a KeyboardInterrupt), the worker is
        stopped: it would go on compiling for nobody, and its reply would answer the next request. At
        ``deadline`` (``time.monotonic()``) without a reply the worker is killed and :class:`BudgetSpent`
        raised. ``until``: polled while the worker works (every ``POLL_S``); once it returns something other
        than None the worker is killed (a new one starts at once, to load while the caller goes on) and the
        reply is ``{"early": that value}``: what the caller needed came before the compile's end."""
        with self.lock:
            for attempt in (1, 2):
                self._ensure_locked()
                sent = next(self.ids)
                ended = threading.Event()
                why: list = []  # ("budget",) or ("early", value): what stopped the worker
                watcher = None
                if deadline is not None or until is not None:
                    watcher = threading.Thread(target=_watch, args=(self.proc, ended, why, deadline, until),
                                               daemon=True)
                    watcher.start()
                try:
                    reply = self._exchange(dict(message, id=sent), sent)
                    if reply is not None and not why:
                        return reply
                except (BrokenPipeError, OSError):
                    pass
                except BaseException:
                    self._kill_locked()
                    raise
                finally:
                    ended.set()
                    if watcher is not None:
                        watcher.join()
                if why and why[0][0] == "budget":
                    self._kill_locked()
                    raise BudgetSpent("the time budget ran out while the TPU compiler compiled")
                if why:
                    self._kill_locked()
                    self.proc = self._start()  # the next compile's worker loads now
                    return {"early": why[0][1]}
                code = self.proc.wait()
                self.proc = None
                log.warning("tpukit: the TPU compiler's worker exited (code %s), attempt %d", code, attempt)
            raise WorkerError(f"the TPU compiler's worker process died twice (exit code {code}); "
                              f"its log is {self.log_path}.")

    def _exchange(self, message: dict, sent: int) -> dict | None:
        """Write one request, read replies until its own (an older one's, of a request given up on, is
        dropped); None when the worker closed its end."""
        data = pickle.dumps(message, protocol=4)
        self.proc.stdin.write(struct.pack(">I", len(data)) + data)
        self.proc.stdin.flush()
        while True:
            head = self.proc.stdout.read(4)
            if len(head) < 4:
                return None
            reply = pickle.loads(self.proc.stdout.read(struct.unpack(">I", head)[0]))
            if reply.pop("id", sent) == sent:
                return reply
            log.warning("tpukit: dropped a TPU compiler reply of an earlier request")

    def _kill_locked(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        with self.lock:
            self._stop_locked()

    def _stop_locked(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


POLL_S = 0.1  # how often a call's watcher looks at its deadline and its ``until``


def _watch(proc: subprocess.Popen, ended: threading.Event, why: list, deadline: float | None,
           until: Callable[[], Any] | None) -> None:
    """Until ``ended``: kill ``proc`` at ``deadline`` (``why``: ("budget",)) or once ``until()`` returns a value
    (``why``: ("early", value))."""
    while not ended.wait(POLL_S):
        if deadline is not None and time.monotonic() >= deadline:
            why.append(("budget",))
        elif until is not None and (got := until()) is not None:
            why.append(("early", got))
        else:
            continue
        proc.kill()
        return


_PROCESSES: dict[tuple, _Process] = {}  # one per compiler, by its versions
_PROCESSES_LOCK = threading.Lock()


def _process(compiler: Compiler) -> _Process:
    """The worker of ``compiler``, made on first use."""
    found = compiler.versions()
    key = tuple(sorted(found.items()))
    with _PROCESSES_LOCK:
        if key not in _PROCESSES:
            _PROCESSES[key] = _Process(found, compiler.name)
        return _PROCESSES[key]


@atexit.register
def _stop_all() -> None:
    with _PROCESSES_LOCK:
        running = list(_PROCESSES.values())
    for proc in running:
        proc.stop()


_INFLIGHT: dict[str, Future] = {}  # key -> the answer of the compile under way for it
_INFLIGHT_LOCK = threading.Lock()


def worker_pid(compiler: Compiler) -> int | None:
    """The id of ``compiler``'s worker process while it runs (None before its first compile or after it
    stopped)."""
    return _process(compiler).pid()


def warm(compiler: Compiler) -> None:
    """Start ``compiler``'s worker now, so it loads jax and libtpu while the caller traces (no-op when it runs,
    or when its jax and libtpu are only partly installed here). Builds its environment first if it has none."""
    if not venvs.is_installed(compiler.versions()) or available():
        _process(compiler).ensure()


def stop() -> None:
    """Stop every worker process (the next compile starts a new one)."""
    _stop_all()


def compile(request: Request, deadline: float | None = None) -> dict:
    """The compiler's answer for ``request``: its figures, or ``{"error": ..., "memory": bool, ...}``.

    Served from the cache when this graph was compiled for this target before. Requests for the same
    key at once (``%%xla`` and the follower, say) share one compile: the first compiles, the others wait
    for its answer (or its exception). At ``deadline`` (``time.monotonic()``) a compile still running is
    stopped: :class:`BudgetSpent`. Raises :class:`TpuCompilerMissingError` without the extra,
    :class:`WorkerError` if the worker cannot run. The answer names its compiler (``compiler``: the versions
    that answered, ``compiler_name``: the name it was asked by).
    """
    require(request.compiler)
    key = request.key()
    with _INFLIGHT_LOCK:  # the cache is read under the lock the compiling request removes its entry with
        reply = cache.get(key)
        shared = _INFLIGHT.get(key) if reply is None else None
        mine = reply is None and shared is None
        if mine:
            shared = _INFLIGHT[key] = Future()
    if not mine:
        reply = reply if reply is not None else shared.result()  # another request's compile of this key
        cache.count(hit=True)
        return _named(reply, request.compiler)
    try:
        reply = _compile(request, key, deadline)
    except BaseException as exc:
        shared.set_exception(exc if isinstance(exc, Exception) else WorkerError(
            f"the compile this request waited for was interrupted ({type(exc).__name__})"))
        raise
    else:
        shared.set_result(reply)
    finally:
        with _INFLIGHT_LOCK:
            del _INFLIGHT[key]
    return _named(reply, request.compiler)


def compile_dump(request: Request, folder: str | Path, deadline: float | None = None,
                 until: Callable[[], Any] | None = None) -> dict:
    """Compile ``request`` with the compiler's dump written into ``folder`` (:func:`tpukit.tpu.dump.files`
    lists what it wrote); the worker's answer, naming its compiler. Not kept here: the breakdown read from
    the dump is (:func:`.cache.put_dump`, by :mod:`tpukit.tpu.ask`). ``until``: as for :meth:`_Process.call`
    (the compile is stopped once it returns a value: the reply is ``{"early": value}``)."""
    require(request.compiler)
    reply = _process(request.compiler).call(dict(request.message(), dump_to=str(folder)), deadline, until)
    if "fatal" in reply:
        raise WorkerError(f"the TPU compiler's worker failed: {reply['fatal']}")
    return _named(reply, request.compiler)


def _named(reply: dict, compiler: Compiler) -> dict:
    """A copy of ``reply`` that names the compiler that answered (an answer cached before replies named it
    is from the versions asked for: they are part of its key) and the name it was asked by (answers are shared
    between names of one pair: ``"torch_xla 2.8"`` and ``"libtpu 0.0.17"``)."""
    return dict(reply, compiler=reply.get("compiler") or compiler.versions(), compiler_name=compiler.name)


def _compile(request: Request, key: str, deadline: float | None = None) -> dict:
    """Have the worker compile ``request`` and keep its answer (a refusal for memory too)."""
    reply = _process(request.compiler).call(request.message(), deadline)
    if "fatal" in reply:
        if reply.get("missing"):
            raise TpuCompilerMissingError(f"{reply['fatal']}")
        raise WorkerError(f"the TPU compiler's worker failed: {reply['fatal']}")
    cache.count(hit=False)
    if "error" in reply and not is_memory_refusal(reply["error"]):
        return reply  # another refusal may be a passing fault of this install: asked again next time
    cache.put(key, reply)
    return reply


def check(compiler: Compiler) -> dict[str, str]:
    """Start ``compiler``'s worker, load jax, libtpu and a v5e topology there; the
    versions it runs and its malloc (``allocator``: the preloaded library's file name, or ``glibc``), as
    ``make install`` prints them."""
    require(compiler)
    reply = _process(compiler).call({"op": "check"})
    if "fatal" in reply:
        raise (TpuCompilerMissingError if reply.get("missing") else WorkerError)(
            f"the TPU compiler's worker cannot run: {reply['fatal']}")
    return dict(reply["versions"], allocator=os.path.basename(reply.get("allocator") or "") or "glibc")
