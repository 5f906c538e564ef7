"""HLO's shapes and protos as the kit reads them, with the standard library only: one parser of each.

- :func:`varint`: a protobuf base-128 varint (the wire format of ``HloModuleProto``), read at an offset;
  :func:`encode_varint` writes one.
- :func:`strip_layout`: a shape without its layouts (``f32[8,128]{1,0:T(8,128)}`` -> ``f32[8,128]``).
- :func:`dims`: a shape's dimensions (``f32[8,1024,32000]{2,1,0}`` -> ``(8, 1024, 32000)``).

Used by the compile reader (:mod:`tpukit.compiles.graphs`), the torch_xla adapter (:mod:`tpukit._xla.hlo`),
and the TPU compiler's dump and refusal readers (:mod:`tpukit.tpu.dump`, :mod:`tpukit.tpu.compiler.refusal`).
"""

from __future__ import annotations

import re

_DIMS = re.compile(r"\d+")


def varint(data: bytes, i: int) -> tuple[int, int]:
    """The varint at ``data[i:]`` and the offset after it."""
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def encode_varint(n: int) -> bytes:
    """``n`` (>= 0) as a varint."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def strip_layout(shape: str) -> str:
    """``f32[524288,8192]{1,0:T(8,128)}`` -> ``f32[524288,8192]``: every ``{...}`` (nested too) removed, so a
    tuple keeps its elements' shapes (``(f32[2]{0}, s32[])`` -> ``(f32[2], s32[])``)."""
    out, depth = [], 0
    for ch in shape:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip()


def dims(shape: str) -> tuple[int, ...]:
    """The dimensions of a shape's first array (``f32[8,1024,32000]{2,1,0}``: 8, 1024, 32000; a layout's
    numbers never count); () when the shape has none (a scalar ``f32[]``, or an unknown shape)."""
    if "[" not in shape:
        return ()
    return tuple(int(d) for d in _DIMS.findall(shape.split("[", 1)[1].split("]", 1)[0]))
