"""The TPU compiler's answers, kept: in memory and on disk, by the key of the request that asked.

A key is sha256 of the graph and every compile setting, with the answering
compiler's jax/jaxlib/libtpu versions (:meth:`.worker.Request.key`), so the same
graph is compiled for a target once per compiler and answers of two compilers
never mix. Files live under ``~/.cache/tpukit/tpu`` (``TPUKIT_TPU_CACHE``
overrides): ``<key>.json`` the compiler's figures, ``<key>.memory1.json`` the
breakdown a compile with a dump gave (:mod:`tpukit.tpu.memory`). Each is written
whole or not at all. Only a request's own reply is ever kept under its key.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from .venvs import write_json

log = logging.getLogger("tpukit")

_MEMORY: dict[str, dict] = {}
_STATS = {"hits": 0, "misses": 0}
_LOCK = threading.Lock()
DUMP_FORMAT = 1  # of the kept breakdowns (part of their file name)


def cache_dir() -> Path:
    """Where answers are kept on disk: ``TPUKIT_TPU_CACHE`` or ``~/.cache/tpukit/tpu``."""
    return Path(os.environ.get("TPUKIT_TPU_CACHE") or Path.home() / ".cache" / "tpukit" / "tpu")


def _path(key: str, suffix: str = "") -> Path:
    return cache_dir() / key[:2] / f"{key}{suffix}.json"


def get(key: str) -> dict | None:
    """The reply kept for ``key`` (memory, else disk), or None."""
    reply = _MEMORY.get(key)
    path = _path(key)
    if reply is None and path.exists():
        try:
            reply = _MEMORY[key] = json.loads(path.read_text())
        except (OSError, ValueError):
            reply = None
    return reply


def put(key: str, reply: dict) -> None:
    """Keep ``reply`` as the answer for ``key`` (a disk that cannot be written is logged, not raised)."""
    _MEMORY[key] = reply
    _write(_path(key), reply)


def get_dump(key: str) -> dict | None:
    """What :func:`put_dump` kept for ``key`` (``{"reply": ..., "dump": ...}``), or None."""
    path = _path(key, f".memory{DUMP_FORMAT}")
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError):
        return None


def put_dump(key: str, data: dict) -> None:
    """Keep a compile-with-dump's reply and dump (as JSON) for ``key``."""
    _write(_path(key, f".memory{DUMP_FORMAT}"), data)


def _write(path: Path, data: dict) -> None:
    try:
        write_json(path, data)
    except OSError as exc:
        log.warning("tpukit: could not write the TPU estimate cache %s: %s", path, exc)


def count(hit: bool) -> None:
    """Count one answer: from the cache or shared with a compile under way (``hit``), or compiled."""
    with _LOCK:
        _STATS["hits" if hit else "misses"] += 1


def cache_info() -> dict[str, int]:
    """Answers served from the cache or shared with a compile under way (``hits``) and compiled by the
    worker (``misses``) in this process."""
    with _LOCK:
        return dict(_STATS)
