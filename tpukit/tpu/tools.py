"""The TPU compiler's worker, by name: check it, require it, its process id, stop it (what ``make install``
prints and a notebook asks by hand). Each resolves the compiler once (:func:`.ask.resolve`) and calls
:mod:`.compiler.worker` with it."""

from __future__ import annotations

from .ask import resolve
from .compiler import worker
from .compiler.pins import Compiler


def check(compiler: str | Compiler | None = None) -> dict[str, str]:
    """Start ``compiler``'s worker (default: the runtime's), load jax, libtpu and a v5e topology there; the
    versions it runs and its malloc (``allocator``), as ``make install`` prints them."""
    return worker.check(resolve(None, compiler, need_target=False)[1])


def require(compiler: str | Compiler | None = None) -> dict[str, str]:
    """The versions of the compiler that will answer (default: the runtime's); a clear error with the install
    line when one that should be installed here is not."""
    return worker.require(resolve(None, compiler, need_target=False)[1])


def worker_pid(compiler: str | Compiler | None = None) -> int | None:
    """The id of ``compiler``'s worker process (default: the runtime's) while it runs, else None."""
    return worker.worker_pid(resolve(None, compiler, need_target=False)[1])


def stop() -> None:
    """Stop every worker process (the next compile starts a new one)."""
    worker.stop()
