"""Files that appear whole or not at all: temp file, fsync, rename, directory fsync.

Also the one sha256 loop (the write's read-back and ``verify`` share it), the
temp-file names (so stale ones from dead processes can be found) and the file
wrapper that keeps the real OSError of a failed write.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import socket
from pathlib import Path
from typing import IO, Any, Callable

from .. import environment

log = logging.getLogger("tpukit")

TMP_PREFIX = ".tmp-"  # never a checkpoint file name (format.parse_name), so it is never listed as one


def temp_path(target: Path, kind: str = "") -> Path:
    """A temp name beside ``target``: ``.tmp-<name>~<kind><host>~<pid>~<random>``, naming the process that owns it."""
    owner = f"{socket.gethostname()}~{os.getpid()}~{secrets.token_hex(4)}"
    return target.parent / f"{TMP_PREFIX}{target.name}~{kind}{owner}"


def hash_file(f: IO[bytes]) -> tuple[int, str]:
    """Byte count and sha256 hex digest of the rest of an open binary file, read in 1 MiB chunks."""
    digest, size = hashlib.sha256(), 0
    while chunk := f.read(1 << 20):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def atomic_write(target: Path, write: Callable[[Path], Any]) -> tuple[int, str]:
    """Write ``target`` through a temp file in its directory: write, fsync, rename, fsync the directory.

    Returns the byte size and sha256 of what was written. ``write(tmp)`` may return
    them itself, having hashed the bytes as it wrote them and fsynced the file
    (the streamed payloads do, saving a read-back); otherwise the file is read back
    to hash it. On any failure the temp file is removed and ``target`` is untouched.
    """
    tmp = temp_path(target)
    try:
        written = write(tmp)
        if isinstance(written, tuple):
            size, sha = written
        else:
            with open(tmp, "r+b") as f:  # read back what is on disk, and fsync it
                size, sha = hash_file(f)
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)
    return size, sha


def fsync_dir(directory: Path) -> None:
    """Make renames in ``directory`` durable (skipped where the platform cannot fsync a directory)."""
    with contextlib.suppress(OSError):  # not supported on every platform / file system
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove_stale_temps(directory: Path, prefix: str) -> None:
    """Remove temp files named ``TMP_PREFIX + prefix...`` of writes that died on this host (their process is gone)."""
    host = socket.gethostname()
    for name in os.listdir(directory):
        if not name.startswith(TMP_PREFIX + prefix):
            continue
        parts = name.split("~")
        if len(parts) == 4 and parts[1] == host and parts[2].isdigit():
            pid = int(parts[2])
            if pid != os.getpid() and not environment.pid_alive(pid):
                remove_path(directory / name)
                log.info("removed stale temporary checkpoint file %s", name)


def remove_path(path: Path) -> None:
    """Remove a file, or a directory with its files (a sharded checkpoint); nothing if it is gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


class Sink:
    """A file wrapper that remembers the first OSError: torch.save swallows a failed write
    (e.g. ENOSPC) and later reports only "RuntimeError: unexpected pos"."""

    def __init__(self, f: Any):
        self._f, self.error = f, None

    def write(self, data: Any) -> int:
        """Write ``data``, remembering the first OSError before re-raising it."""
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        """Flush the wrapped file."""
        self._f.flush()

    def seek(self, offset: int, whence: int = 0) -> int:
        """Move the wrapped file's position (``skip_data`` saves seek past the holes they leave)."""
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        """The wrapped file's position."""
        return self._f.tell()
