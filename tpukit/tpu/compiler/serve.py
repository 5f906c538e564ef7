"""The TPU compiler's worker process: reads compile requests on stdin, answers on stdout (pickled records).

Started by :mod:`.worker` as ``python -c`` with bare ``tpukit``, ``tpukit.tpu`` and
``tpukit.tpu.compiler`` packages (no ``__init__`` is run), so the worker loads jax
and libtpu and nothing of torch or torch_xla. It is compile-only: its devices come
from a topology description and no chip is ever opened. The protocol is a 4-byte
big-endian length then a pickled dict, one request then one reply that carries
the request's ``id`` back (a reply is never taken for another request's); libtpu's
own logging goes to stderr, never to the protocol's stream. A refusal comes back
as the compiler's text (``error``): the kernel's side reads it (:mod:`.refusal`).
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import time
from typing import BinaryIO

def loaded_allocator() -> str | None:
    """The malloc library preloaded into this process (``LD_PRELOAD`` took effect), or None for glibc's."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "malloc" in line.rsplit("/", 1)[-1] and ".so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return None


def handle(request: dict) -> dict:
    """Serve one request: ``{"op": "compile", ...}`` -> the compiler's figures or its refusal (``error``: its
    text). A ``"dump_to"`` folder in the request gets the compiler's dump of that compile (:mod:`tpukit.tpu.dump`
    reads it)."""
    from . import _jax

    if request.get("op") == "check":
        found = _jax.check()
        _jax.devices("v5e:1x1", (1, 1, 1), 1)
        return {"versions": found, "allocator": loaded_allocator()}
    devs = _jax.devices(request["topology"], request["host_bounds"], request["devices"])
    start = time.perf_counter()
    try:
        stats = _jax.compile_hlo(request["hlo"], devs, num_partitions=request["num_partitions"],
                                 aliases=request.get("aliases", ()), shard_over=request.get("shard_over", 1),
                                 flags=request.get("flags") or {}, dump_to=request.get("dump_to"))
    except Exception as exc:  # the compiler's refusal is the answer, not a failure of the worker
        return {"error": str(exc).strip(), "compile_s": time.perf_counter() - start, "compiler": _jax.versions()}
    stats["compile_s"] = time.perf_counter() - start
    stats["compiler"] = _jax.versions()  # the jax, jaxlib and libtpu that answered
    return stats


def _read(stream: BinaryIO) -> dict | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    return pickle.loads(stream.read(n))


def _write(stream: BinaryIO, reply: dict) -> None:
    data = pickle.dumps(reply, protocol=4)
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def watch_parent(interval: float = 1.0) -> threading.Thread:
    """End this process as soon as the process that started it is gone (a killed or restarted kernel):
    stdin's end is only read between requests, and a compile can run for minutes for nobody."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:  # re-parented: the starter died
                os._exit(0)

    thread = threading.Thread(target=watch, name="tpukit-tpu-parent-watch", daemon=True)
    thread.start()
    return thread


def main() -> None:
    """Serve requests until stdin closes or the starting process dies. stdout is the protocol's alone:
    fd 1 is pointed at stderr."""
    watch_parent()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:  # load jax and libtpu before the first request arrives (it may still be being traced)
        from . import _jax

        _jax.check()
    except ImportError:
        pass  # the first request says so
    inp = sys.stdin.buffer
    while True:
        request = _read(inp)
        if request is None:
            return
        try:
            reply = handle(request)
        except ImportError as exc:
            reply = {"fatal": str(exc), "missing": True}
        except Exception as exc:  # a bad topology or a broken install: say so, keep serving
            reply = {"fatal": f"{type(exc).__name__}: {exc}"}
        _write(out, dict(reply, id=request.get("id")))
