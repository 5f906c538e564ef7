"""Tensors copied to the host in bounded pieces, so a save's extra host memory is set by a chunk size.

A device tensor larger than ``WHOLE_UP_TO`` chunks (32 MiB at the default 4
MiB) is not copied to the host whole:
its flattened data is viewed as rows of ``chunk`` bytes and one row at a time is
selected on the device (``index_select`` with the row number as a device tensor,
so every row of every tensor of that shape runs the same compiled graph: one
small compile per shape, never one per offset) and copied to the host. A
remainder shorter than a row is copied as one more slice. torch_xla's copy to
the host passes through a second buffer, so a piece briefly takes twice its
size, and the next piece is copied while one is written: a few chunks are live
at once (on XLA:CPU, where the device's memory is host memory too, the selected
row counts as well). Measured on XLA:CPU, the resident memory a save adds,
allocator retention included, is about twelve chunks (48 MiB at the default 4
MiB), whatever the size of the largest tensor; 16 MiB chunks added 165 MiB.
Smaller device tensors, CPU tensors and SPMD-sharded tensors (gathered whole, as
before) are copied in one piece: a whole copy needs no graph, and each shape that
is chunked costs one small compile at its first save (which tpukit's compile
classifier, comparing graphs by place, reports as a recompilation when two large
shapes are chunked in one save), so only tensors whose whole copy would cost
more than ``WHOLE_UP_TO`` chunks are cut.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .. import _xla, compiles

COPY_CHUNK = 4 << 20  # default bytes per device-to-host copy of a large tensor
WHOLE_UP_TO = 8  # a device tensor of at most this many chunks is copied whole
MIN_CHUNK = 1 << 20  # smaller pieces would cost more in per-copy overhead than they save in memory


def check_chunk(copy_chunk: Any) -> int:
    """``copy_chunk`` as bytes if it is an int >= 1 MiB; raises TypeError/ValueError with the fix otherwise."""
    if isinstance(copy_chunk, bool) or not isinstance(copy_chunk, int):
        raise TypeError(
            f"copy_chunk={copy_chunk!r} is a {type(copy_chunk).__name__}; pass the chunk size in bytes as an int, "
            f"e.g. copy_chunk={COPY_CHUNK} ({COPY_CHUNK >> 20} MiB)."
        )
    if copy_chunk < MIN_CHUNK:
        raise ValueError(
            f"copy_chunk={copy_chunk} bytes is below the minimum of {MIN_CHUNK} (1 MiB); pass a larger chunk size."
        )
    return copy_chunk


@dataclass(frozen=True)
class Piece:
    """One host copy of a save: bytes ``start`` onwards of a tensor's data, made by ``copy()``."""

    start: int  # byte offset of this piece within its tensor's data
    nbytes: int
    last: bool  # the tensor's final piece (its CRC is complete after it)
    copy: Callable[[], torch.Tensor]  # returns a contiguous CPU tensor of ``nbytes`` bytes


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with ``t``'s data (an XLA tensor copied without a sync: the caller synced)."""
    return (_xla.to_cpu([t], sync=False)[0] if _xla.is_xla_tensor(t) else t.detach()).contiguous()


def chunked(t: torch.Tensor, chunk: int) -> bool:
    """True when ``t`` is copied to the host in pieces: an unsharded device tensor over ``WHOLE_UP_TO`` chunks."""
    return (_xla.is_xla_tensor(t) and t.numel() * t.element_size() > WHOLE_UP_TO * chunk
            and not hasattr(t, "global_tensor") and not _xla.is_sharded(t))


def pieces(t: torch.Tensor, chunk: int) -> Iterator[Piece]:
    """The host copies that make up ``t``'s data, in order: ``chunk`` bytes each for a large device tensor."""
    size = t.element_size()
    total = t.numel() * size
    if not chunked(t, chunk):
        yield Piece(0, total, True, lambda: host_copy(t))
        return
    per_row = max(1, chunk // size)  # elements per piece
    rows, rest = divmod(t.numel(), per_row)
    for i in range(rows):
        yield Piece(i * per_row * size, per_row * size, not rest and i == rows - 1,
                    lambda i=i: _row(t, rows, per_row, i))
    if rest:
        yield Piece(rows * per_row * size, rest * size, True, lambda: _tail(t, rows * per_row))


def _row(t: torch.Tensor, rows: int, per_row: int, i: int) -> torch.Tensor:
    """Row ``i`` of ``t``'s flattened data viewed as ``rows`` x ``per_row``, selected on the device, on the host."""
    flat = t.detach().reshape(-1)
    body = flat if flat.numel() == rows * per_row else flat[:rows * per_row]
    index = torch.tensor([i], dtype=torch.int64, device=t.device)  # device data: one graph for every row
    selected = body.view(rows, per_row).index_select(0, index)
    # Named as tpukit's own graph: each chunked shape compiles once, never a recompilation alarm.
    return compiles.own(lambda: _xla.to_cpu([selected], sync=False)[0]).reshape(-1)


def _tail(t: torch.Tensor, start: int) -> torch.Tensor:
    """The flattened data of ``t`` from element ``start`` on, on the host."""
    return compiles.own(lambda: _xla.to_cpu([t.detach().reshape(-1)[start:]], sync=False)[0]).contiguous()


def peak_host_bytes(sizes: list[tuple[int, bool]], chunk: int) -> int:
    """Peak extra host bytes of a streamed save of tensors with ``(bytes, on a device)`` ``sizes``.

    A save holds the piece it writes while the next one is copied, and a device
    copy passes through a second buffer: about three times the largest device
    tensor copied whole, four chunks for a chunked one (the selected row counts
    on XLA:CPU), once the largest CPU tensor.
    """
    device = [4 * chunk if n > WHOLE_UP_TO * chunk else 3 * n for n, on_device in sizes if on_device]
    host = [n for n, on_device in sizes if not on_device]
    return max(device + host, default=0)


def ahead(items: Iterator[Any], work: Callable[[Any], Any]) -> Iterator[tuple[Any, Any]]:
    """``(item, work(item))`` for each item, the next one's ``work`` running in a helper thread meanwhile.

    At most one result waits while the caller uses the current one, so a save
    holds two pieces. A plain thread, not ``concurrent.futures``: that refuses new
    work once the interpreter starts to exit, when a background save may still be
    writing. Once the interpreter is exiting, Python 3.12 starts no new thread at all: then each
    item's work runs in the caller's thread, one after the other. Close the generator
    (``contextlib.closing``) to stop the helper early.
    """
    results: queue.Queue = queue.Queue()
    go, stop = threading.Semaphore(1), threading.Event()

    def run() -> None:
        try:
            for item in items:
                go.acquire()
                if stop.is_set():
                    return
                results.put((item, work(item), None))
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            results.put((None, None, exc))
            return
        results.put(None)

    helper = threading.Thread(target=run, name="tpukit-checkpoint-copy", daemon=True)
    try:
        helper.start()
    except RuntimeError:  # Python >= 3.12 starts no thread once the interpreter exits (a save flushed at exit)
        for item in items:
            yield item, work(item)
        return
    try:
        while (got := results.get()) is not None:
            item, result, error = got
            if error is not None:
                raise error
            go.release()  # start the next copy while this result is used
            yield item, result
            del got, result
    finally:
        stop.set()
        go.release()
        helper.join()
