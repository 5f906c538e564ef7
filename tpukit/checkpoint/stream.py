"""Payloads written tensor by tensor, so a save holds a piece of one tensor in host memory, not the state.

Both formats are laid out first and filled in after:

- **torch**: ``torch.save`` writes the archive with ``torch.serialization.skip_data``
  from a skeleton of never-touched ``torch.empty`` stand-ins (no host memory is
  committed for them), leaving the storage records as holes in the file. Loading
  that file with ``torch.load(mmap=True)`` places each storage at its record's
  offset (torch's own layout, nothing read), and each tensor is then copied to the
  CPU and written at its offset with ``os.pwrite``, one at a time, its CRC-32 put
  into the zip's data descriptor and central directory. The file is an ordinary
  ``torch.save`` archive: ``torch.load`` and zip tools read it.
- **safetensors**: the header (names, dtypes, shapes, offsets, and the tree's
  structure as metadata) is written from the shapes alone, then the data, tensor by
  tensor; ``safetensors.safe_open`` reads it.

The sha256 of the file is computed as it is written (the small gaps between
tensors read back, the tensors hashed from memory), so the 1 GB state is not read
back to be hashed. Tensors that are one object, one XLA tensor or one CPU view are
written once, so tied weights stay tied. Each tensor comes to the host in pieces
of at most ``copy_chunk`` bytes (``chunks``); the next piece is copied from the
device while one is written, so the extra host memory of a save is a small
multiple of the chunk size, not of its largest tensor. Write errors are the real ``OSError``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _xla
from .._tree import is_tensor, tree_leaves, tree_map
from ..errors import CheckpointError
from .chunks import COPY_CHUNK, ahead, peak_host_bytes, pieces
from .files import Sink

_CHUNK = 64 << 20  # bytes per pwrite call

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
}


@dataclass
class Entry:
    """One distinct tensor of a state: where it comes from and the stand-in that takes its place."""

    source: torch.Tensor
    stand_in: torch.Tensor
    name: str = ""  # safetensors record name
    offset: int = 0  # byte offset of its data in the file

    @property
    def nbytes(self) -> int:
        """Bytes of its data."""
        return self.source.numel() * self.source.element_size()


def tensor_key(t: torch.Tensor) -> Any:
    """Equal for tensors that are the same data: one XLA tensor, or one view of one CPU storage."""
    if _xla.is_xla_tensor(t):
        return ("xla", _xla.tensor_id(t))
    storage = t.untyped_storage()
    if t.device.type == "cpu" and storage.data_ptr():
        return ("cpu", storage.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
    return ("obj", id(t))


def skeleton(state: Any) -> tuple[Any, list[Entry]]:
    """``state`` with each distinct tensor replaced by an untouched ``torch.empty`` of its shape and dtype."""
    entries: dict[Any, Entry] = {}

    def replace(t: torch.Tensor, _path: str) -> torch.Tensor:
        key = tensor_key(t)
        if key not in entries:
            entries[key] = Entry(t, torch.empty(tuple(t.shape), dtype=t.dtype))
        return entries[key].stand_in

    return tree_map(replace, state, is_tensor), list(entries.values())


def payload_bytes(state: Any, copy_chunk: int = COPY_CHUNK) -> tuple[int, int]:
    """(data bytes of the distinct tensors, peak extra host bytes while they are written) of ``state``.

    The peak is ``chunks.peak_host_bytes``: a few ``copy_chunk`` pieces for device
    tensors, once the largest CPU tensor.
    """
    seen: dict[Any, tuple[int, bool]] = {}
    for _, t in tree_leaves(state, is_tensor):
        seen.setdefault(tensor_key(t), (t.numel() * t.element_size(), _xla.is_xla_tensor(t)))
    return sum(size for size, _ in seen.values()), peak_host_bytes(list(seen.values()), copy_chunk)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:done + _CHUNK], offset + done)


def _hash_range(fd: int, digest: Any, start: int, end: int) -> None:
    while start < end:
        chunk = os.pread(fd, min(_CHUNK, end - start), start)
        if not chunk:
            raise OSError(f"{end - start} bytes missing while hashing the checkpoint")
        digest.update(chunk)
        start += len(chunk)


def _fill(tmp: Path, entries: list[Entry], crc_at: dict[int, list[int]] | None = None,
          copy_chunk: int = COPY_CHUNK) -> tuple[int, str]:
    """Copy each entry to the host, a piece of at most ``copy_chunk`` bytes at a time, and write it at its offset.

    Pieces go in file order. The next piece's copy from the device runs in a
    helper thread (``chunks.ahead``) while this one is checksummed and written
    (both release the GIL), so the copy costs little time and the save holds two
    pieces at most.
    ``crc_at`` maps an entry's offset to the positions of its CRC-32 fields (zip
    archives), written once its last piece is. Returns the file's byte size and
    sha256, hashed as it is written, after an fsync.
    """
    digest, position, crc = hashlib.sha256(), 0, 0
    order = sorted(entries, key=lambda e: e.offset)
    plan = ((entry, piece) for entry in order if _check_source(entry) for piece in pieces(entry.source, copy_chunk))
    fd = os.open(tmp, os.O_RDWR)
    try:
        with contextlib.closing(ahead(plan, lambda item: item[1].copy())) as copies:
            for (entry, piece), cpu in copies:
                _check_piece(entry, piece.nbytes, cpu)
                data = memoryview(cpu.reshape(-1).view(torch.uint8).numpy()) if cpu.numel() else memoryview(b"")
                if piece.start == 0:
                    _hash_range(fd, digest, position, entry.offset)  # headers before it (its CRC fields come after)
                    crc = 0
                crc = zlib.crc32(data, crc)
                _pwrite_all(fd, data, entry.offset + piece.start)
                digest.update(data)
                position = entry.offset + piece.start + len(data)
                if piece.last:
                    for field in (crc_at or {}).get(entry.offset, ()):
                        os.pwrite(fd, crc.to_bytes(4, "little"), field)
                del data, cpu
        size = os.fstat(fd).st_size
        _hash_range(fd, digest, position, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    return size, digest.hexdigest()


def _check_source(entry: Entry) -> bool:
    """True, or CheckpointError when the tensor no longer has the shape and dtype it was laid out with."""
    src, stand_in = entry.source, entry.stand_in
    if tuple(src.shape) != tuple(stand_in.shape) or src.dtype != stand_in.dtype:
        raise CheckpointError(
            f"A tensor changed from {tuple(stand_in.shape)} {stand_in.dtype} to {tuple(src.shape)} "
            f"{src.dtype} while it was being saved. Save when no other thread modifies the state."
        )
    return True


def _check_piece(entry: Entry, nbytes: int, cpu: torch.Tensor) -> None:
    if cpu.dtype != entry.stand_in.dtype or cpu.numel() * cpu.element_size() != nbytes:
        raise CheckpointError(
            f"A tensor of shape {tuple(entry.stand_in.shape)} {entry.stand_in.dtype} came back from the device as "
            f"{tuple(cpu.shape)} {cpu.dtype} while it was being saved. Save when no other thread modifies the state."
        )


# --------------------------------------------------------------------------- torch archive

def _save_torch(obj: Any, tmp: Path) -> None:
    """``torch.save`` to ``tmp``, raising the real OSError of a failed write."""
    with open(tmp, "wb") as f:
        sink = Sink(f)
        try:
            torch.save(obj, sink)
        except Exception:
            if sink.error is not None:
                raise sink.error from None
            raise


def _safe_globals() -> list:
    """numpy's array and scalar rebuilders: data only, so safe to allow (numpy RNG states)."""
    try:
        import numpy as np
    except ImportError:
        return []
    arr, scalar = np.zeros(1), np.float64(0)
    dtypes = {type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDGSU"}
    return [arr.__reduce__()[0], scalar.__reduce__()[0], np.ndarray, np.dtype, *dtypes]


def read_torch(path: Path, mmap: bool = False) -> Any:
    """``torch.load`` of a payload: CPU tensors, data-only unpickling (numpy values allowed)."""
    allow = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5
    with allow(_safe_globals()) if allow else contextlib.nullcontext():
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def write_torch(state: Any, tmp: Path, copy_chunk: int = COPY_CHUNK) -> tuple[int, str]:
    """Write ``state`` to ``tmp`` as a ``torch.save`` archive, tensor data streamed in afterwards.

    Returns the file's byte size and sha256.
    """
    frame, entries = skeleton(state)
    with torch.serialization.skip_data():
        _save_torch(frame, tmp)
    _locate(tmp, frame, entries)
    return _fill(tmp, entries, _crc_fields(tmp), copy_chunk)


def _crc_fields(tmp: Path) -> dict[int, list[int]]:
    """For each data record of the zip archive ``tmp``: its data offset -> the positions of its CRC-32 fields.

    torch's archives set the data-descriptor flag, so a record's CRC sits in the
    descriptor after its data and in its central-directory entry (never in the
    local header); ``skip_data`` leaves both zero.
    """
    fields: dict[int, list[int]] = {}
    with zipfile.ZipFile(tmp) as archive, open(tmp, "rb") as f:
        f.seek(archive.start_dir)
        directory = f.read()
        central: dict[str, int] = {}
        at = 0
        while directory[at:at + 4] == b"PK\x01\x02":
            name_len, extra_len, comment_len = struct.unpack("<HHH", directory[at + 28:at + 34])
            central[directory[at + 46:at + 46 + name_len].decode()] = archive.start_dir + at
            at += 46 + name_len + extra_len + comment_len
        for info in archive.infolist():
            if "/data/" not in info.filename or not info.file_size:
                continue  # an empty record has no descriptor, and its CRC-32 (of nothing) is 0 already
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            data = info.header_offset + 30 + name_len + extra_len
            f.seek(data + info.file_size)
            descriptor = data + info.file_size + (4 if f.read(4) == b"PK\x07\x08" else 0)
            fields[data] = [descriptor, central[info.filename] + 16]
    return fields


def _locate(tmp: Path, frame: Any, entries: list[Entry]) -> None:
    """Set each entry's byte offset in the archive ``tmp`` written from ``frame``.

    ``torch.load(mmap=True)`` maps the file and makes each storage a slice of that
    one mapping at its record's offset (nothing is read), so a storage's address
    minus the mapping's base is its offset; the base is pinned by the archive's
    first data record and every offset is checked against the archive's records.
    """
    reader = torch._C.PyTorchFileReader(str(tmp))
    records = {reader.get_record_offset(name) for name in reader.get_all_records() if name.startswith("data/")}
    laid_out = read_torch(tmp, mmap=True)
    pairs = [(stand_in, loaded) for (_, stand_in), (_, loaded)
             in zip(tree_leaves(frame, is_tensor), tree_leaves(laid_out, is_tensor))]
    addresses = {id(s): loaded.untyped_storage().data_ptr() for s, loaded in pairs}
    base = min(addresses.values(), default=0) - min(records, default=0)
    for entry in entries:
        entry.offset = addresses[id(entry.stand_in)] - base
    if len(pairs) != len(list(tree_leaves(frame, is_tensor))) or any(e.offset not in records for e in entries):
        raise CheckpointError(f"Could not lay out the checkpoint {tmp}: torch.load saw a different archive.")


# --------------------------------------------------------------------------- safetensors

def write_safetensors(state: Any, tmp: Path, structure_key: str,
                      copy_chunk: int = COPY_CHUNK) -> tuple[int, str]:
    """Write ``state`` to ``tmp`` as a safetensors file whose metadata holds the tree's structure.

    Returns the file's byte size and sha256.
    """
    frame, entries = skeleton(state)
    by_stand_in = {id(e.stand_in): e for e in entries}
    used: set[str] = set()

    def encode(obj: Any, keys: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            entry = by_stand_in[id(obj)]
            if not entry.name:
                name = "/".join(map(str, keys)) or "tensor"
                while name in used:
                    name += "~"
                used.add(name)
                entry.name = name
            return {"T": entry.name}
        if isinstance(obj, dict):
            tag = "O" if type(obj) is OrderedDict else "D"
            return {tag: [[k, encode(v, keys + (k,))] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            tag = {list: "L", tuple: "U"}.get(type(obj), "S")
            return {tag: [encode(v, keys + (i,)) for i, v in enumerate(obj)]}
        if isinstance(obj, torch.dtype):
            return {"dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"device": str(obj)}
        return obj

    structure = json.dumps(encode(frame, ()))
    header: dict[str, Any] = {"__metadata__": {"format": "pt", structure_key: structure}}
    position = 0
    for entry in entries:
        header[entry.name] = {"dtype": SAFETENSORS_DTYPES[entry.stand_in.dtype],
                              "shape": list(entry.stand_in.shape), "data_offsets": [position, position + entry.nbytes]}
        entry.offset = position
        position += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    start = 8 + len(text)
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        f.truncate(start + position)
    for entry in entries:
        entry.offset += start
    return _fill(tmp, entries, copy_chunk=copy_chunk)
