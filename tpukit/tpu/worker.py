"""The parent's side of the TPU compiler's worker process, and the cache of its answers.

libtpu never loads into the process that runs torch_xla: one worker process
per Python process holds jax's compile-only TPU client and answers one request
at a time (:mod:`tpukit.tpu._serve`). It starts on first use, is restarted if
it dies, and stops when this process exits. Answers are cached by
sha256(HLO bytes) + target + compile settings + jax/jaxlib/libtpu versions, in
memory and on disk under ``~/.cache/tpukit/tpu`` (``TPUKIT_TPU_CACHE``
overrides), so the same graph is compiled for a target once.

The worker's stderr (libtpu's warnings) goes to ``worker.log`` there. libtpu's
own log files, a new one in ``/tmp/tpu_logs`` for every start, are off
(``TPU_LOG_DIR=disabled``) unless ``TPU_LOG_DIR`` names a folder.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import TpukitError
from ._versions import versions
from .flags import compile_flags
from .targets import Target

log = logging.getLogger("tpukit")

INSTALL = 'pip install "tpukit[tpu-estimate]"  (or: pip install "jax[tpu]")'
_BOOT = (  # a bare tpukit.tpu package: the worker runs _serve and _jax, not tpukit's __init__
    "import sys, types\n"
    "for name, path in (('tpukit', {root!r}), ('tpukit.tpu', {here!r})):\n"
    "    m = types.ModuleType(name); m.__path__ = [path]; sys.modules[name] = m\n"
    "from tpukit.tpu import _serve\n"
    "_serve.main()\n"
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


def available() -> bool:
    """True when jax and libtpu are installed (without importing them)."""
    v = versions()
    return bool(v["jaxlib"] and v["libtpu"]) and importlib.util.find_spec("jax") is not None


def require() -> dict[str, str]:
    """The versions, or :class:`TpuCompilerMissingError` with the install line."""
    if not available():
        v = versions()
        missing = [d for d in ("jax", "jaxlib", "libtpu") if not v[d]] or ["jax"]
        raise TpuCompilerMissingError(
            f"tpukit's TPU estimates need the TPU compiler ({', '.join(missing)} not installed). "
            f"Install it with: {INSTALL}")
    return versions()


# What a reply holds: 2 added the compiler's peak (``peak_bytes``). Part of the cache key, so answers kept
# before a change are compiled again rather than read without the new figures.
_REPLY_FORMAT = 2


@dataclass(frozen=True)
class Request:
    """One compile for the worker: an HLO module, the slice to compile it for, donation and layout."""

    hlo: bytes
    target: Target
    num_partitions: int = 1
    aliases: tuple[tuple[int, int], ...] = ()
    shard_over: int = 1  # impose an FSDP layout over this many chips (1: the module's own shardings)

    def key(self) -> str:
        """The cache key: the graph, the compile settings, the compiler's flags and versions."""
        h = hashlib.sha256(self.hlo)
        settings = [self.target.topology, self.target.host_bounds, self.devices, self.num_partitions,
                    self.aliases, self.shard_over, sorted(versions().items()), sorted(self.flags.items()),
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
    """The worker process; ``call`` sends one request and waits for its reply (one at a time)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.libtpu_args: str | None = None  # the LIBTPU_INIT_ARGS the running worker's libtpu read

    def _start(self) -> subprocess.Popen:
        here = str(Path(__file__).resolve().parent)
        root = str(Path(here).parent)
        env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu")
        env.pop("PJRT_DEVICE", None)
        env.setdefault("TPU_LOG_DIR", "disabled")  # else every start leaves a file in /tmp/tpu_logs
        env.update(allocator_env(env))
        self.libtpu_args = os.environ.get("LIBTPU_INIT_ARGS", "")
        logdir = cache_dir()
        logdir.mkdir(parents=True, exist_ok=True)
        with open(logdir / "worker.log", "ab") as err:
            return subprocess.Popen([sys.executable, "-c", _BOOT.format(root=root, here=here)],
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

    def call(self, message: dict) -> dict:
        with self.lock:
            for attempt in (1, 2):
                self._ensure_locked()
                try:
                    data = pickle.dumps(message, protocol=4)
                    self.proc.stdin.write(struct.pack(">I", len(data)) + data)
                    self.proc.stdin.flush()
                    head = self.proc.stdout.read(4)
                    if len(head) == 4:
                        return pickle.loads(self.proc.stdout.read(struct.unpack(">I", head)[0]))
                except (BrokenPipeError, OSError):
                    pass
                code = self.proc.wait()
                self.proc = None
                log.warning("tpukit: the TPU compiler's worker exited (code %s), attempt %d", code, attempt)
            raise WorkerError(f"the TPU compiler's worker process died twice (exit code {code}); "
                              f"its log is {cache_dir() / 'worker.log'}.")

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


_PROCESS = _Process()
atexit.register(_PROCESS.stop)
_MEMORY: dict[str, dict] = {}
_STATS = {"hits": 0, "misses": 0}
_STATS_LOCK = threading.Lock()
_INFLIGHT: dict[str, Future] = {}  # key -> the answer of the compile under way for it
_INFLIGHT_LOCK = threading.Lock()


def cache_dir() -> Path:
    """Where answers are kept on disk: ``TPUKIT_TPU_CACHE`` or ``~/.cache/tpukit/tpu``."""
    return Path(os.environ.get("TPUKIT_TPU_CACHE") or Path.home() / ".cache" / "tpukit" / "tpu")


def cache_info() -> dict[str, int]:
    """Answers served from the cache or shared with a compile under way (``hits``) and compiled by the
    worker (``misses``) in this process."""
    with _STATS_LOCK:
        return dict(_STATS)


def worker_pid() -> int | None:
    """The worker process's id while it runs (None before the first compile or after it stopped)."""
    return _PROCESS.pid()


def warm() -> None:
    """Start the worker now, so it loads jax and libtpu while the caller traces (no-op when it runs, or
    without the extra)."""
    if available():
        _PROCESS.ensure()


def stop() -> None:
    """Stop the worker process (the next compile starts a new one)."""
    _PROCESS.stop()


def compile(request: Request) -> dict:
    """The compiler's answer for ``request``: its figures, or ``{"error": ..., "memory": bool, ...}``.

    Served from the cache when this graph was compiled for this target before. Requests for the same
    key at once (``%%xla`` and the follower, say) share one compile: the first compiles, the others wait
    for its answer (or its exception). Raises :class:`TpuCompilerMissingError` without the extra,
    :class:`WorkerError` if the worker cannot run.
    """
    require()
    key = request.key()
    path = cache_dir() / key[:2] / f"{key}.json"
    with _INFLIGHT_LOCK:  # the cache is read under the lock the compiling request removes its entry with
        reply = _cached(key, path)
        shared = _INFLIGHT.get(key) if reply is None else None
        mine = reply is None and shared is None
        if mine:
            shared = _INFLIGHT[key] = Future()
    if not mine:
        reply = reply if reply is not None else shared.result()  # another request's compile of this key
        with _STATS_LOCK:
            _STATS["hits"] += 1
        return _named(reply)
    try:
        reply = _compile(request, key, path)
    except BaseException as exc:
        shared.set_exception(exc if isinstance(exc, Exception) else WorkerError(
            f"the compile this request waited for was interrupted ({type(exc).__name__})"))
        raise
    else:
        shared.set_result(reply)
    finally:
        with _INFLIGHT_LOCK:
            del _INFLIGHT[key]
    return _named(reply)


def _named(reply: dict) -> dict:
    """A copy of ``reply`` that names the compiler that answered (an answer cached before replies named it
    is from the versions installed here: they are part of its key)."""
    return dict(reply, compiler=reply.get("compiler") or versions())


def _cached(key: str, path: Path) -> dict | None:
    """The answer for ``key`` from memory or disk, or None."""
    reply = _MEMORY.get(key)
    if reply is None and path.exists():
        try:
            reply = _MEMORY[key] = json.loads(path.read_text())
        except (OSError, ValueError):
            reply = None
    return reply


def _compile(request: Request, key: str, path: Path) -> dict:
    """Have the worker compile ``request`` and keep its answer (a refusal for memory too)."""
    reply = _PROCESS.call(request.message())
    if "fatal" in reply:
        if reply.get("missing"):
            raise TpuCompilerMissingError(f"{reply['fatal']}")
        raise WorkerError(f"the TPU compiler's worker failed: {reply['fatal']}")
    with _STATS_LOCK:
        _STATS["misses"] += 1
    if "error" in reply and not reply.get("memory"):
        return reply  # another refusal may be a passing fault of this install: asked again next time
    _MEMORY[key] = reply
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(reply))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("tpukit: could not write the TPU estimate cache %s: %s", path, exc)
    return reply


def check() -> dict[str, str]:
    """Start the worker, load jax, libtpu and a v5e topology there; the versions it runs and its malloc
    (``allocator``: the preloaded library's file name, or ``glibc``), as ``make install`` prints them."""
    require()
    reply = _PROCESS.call({"op": "check"})
    if "fatal" in reply:
        raise (TpuCompilerMissingError if reply.get("missing") else WorkerError)(
            f"the TPU compiler's worker cannot run: {reply['fatal']}")
    return dict(reply["versions"], allocator=os.path.basename(reply.get("allocator") or "") or "glibc")
