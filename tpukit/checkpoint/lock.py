"""One writing ``CheckpointManager`` per directory: a lock file naming the process that owns it.

Two managers saving into one directory would overwrite each other's
same-numbered checkpoints and prune each other's files. So a manager takes the
directory's lock before its first save and holds it until it is closed, garbage
collected or its process exits. The lock is a small file (``host pid token``)
under the temporary directory (``<tmp>/tpukit-<uid>/checkpoint-locks/``), named
by a hash of the directory's real path, so the checkpoint directory holds only
checkpoints. It guards the processes of one machine, which is where a second
notebook or a forgotten script runs: another live process's manager is refused, a
lock whose process is gone is taken over. Within one process the newest manager
takes the directory over (re-running a notebook cell, or restarting after an
exception whose traceback still holds the old manager, must just work) and the
older one is refused from then on. The locks that killed processes left behind
(nothing runs at a SIGKILL) are removed by the next process that takes a lock
(:func:`sweep`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import socket
import tempfile
from pathlib import Path

from .. import environment
from ..errors import CheckpointError

log = logging.getLogger("tpukit")
_SWEPT: list[bool] = []  # this process swept the lock folder once


def lock_path(directory: str | os.PathLike) -> Path:
    """Where the lock of checkpoint ``directory`` lives (the same file for every spelling of its path)."""
    real = os.path.realpath(directory)
    uid = os.getuid() if hasattr(os, "getuid") else 0
    name = hashlib.sha256(real.encode()).hexdigest()[:24] + ".lock"
    return Path(tempfile.gettempdir()) / f"tpukit-{uid}" / "checkpoint-locks" / name


def sweep(folder: Path) -> list[str]:
    """Remove the lock files in ``folder`` whose owner is a process of this machine that is gone
    (each is taken over the same way a manager takes a stale lock); returns their names."""
    removed = []
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".lock")]
    except OSError:
        return removed
    for name in names:
        path = folder / name
        try:
            host, pid, _token = path.read_text().split()
        except (OSError, ValueError):
            continue  # gone meanwhile, or not a lock this code wrote
        if host == socket.gethostname() and pid.isdigit() and not environment.pid_alive(int(pid)):
            stale = path.with_name(f".{name}.stale.{secrets.token_hex(4)}")
            with contextlib.suppress(FileNotFoundError):
                os.rename(path, stale)
                os.unlink(stale)
                removed.append(name)
    return removed


class DirectoryLock:
    """The lock of one checkpoint directory, held by one manager object of one process."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.path.realpath(directory)
        self.path = lock_path(directory)
        self.owner = f"{socket.gethostname()} {os.getpid()} {secrets.token_hex(8)}"
        self.held = False

    def acquire(self) -> bool:
        """Take the lock, or check it is still ours; True when it was taken over from another manager of this process.

        Raises CheckpointError naming the owner when a live manager of another
        process holds it, or when a newer manager of this process took it over.
        """
        if self.held:
            if self._owner_line() != self.owner:
                self.held = False
                raise CheckpointError(
                    f"A newer CheckpointManager of this process took {self.directory} over, so this one no longer "
                    "saves there (two managers on one directory prune each other's checkpoints). Save with the "
                    "newer one, or give each manager its own directory."
                )
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not _SWEPT:
            _SWEPT.append(True)
            sweep(self.path.parent)
        for _ in range(3):  # a lost race with another taker: look again
            if self._create():
                self.held = True
                return False
            holder = self._holder()
            if holder is None:
                continue  # released meanwhile
            host, pid = holder
            if host == socket.gethostname() and pid == os.getpid():
                self._write(replace=True)  # the newest manager of this process wins; the older one is refused
                self.held = True
                return True
            if host == socket.gethostname() and not environment.pid_alive(pid):
                self._take_over_stale(pid)
                continue
            raise CheckpointError(self._refusal(host, pid))
        raise CheckpointError(f"Could not take the lock {self.path} of {self.directory}; save again.")

    def release(self) -> None:
        """Give the lock up, if this manager holds it (the file is removed only while it is still ours)."""
        if self.held:
            self.held = False
            with contextlib.suppress(OSError):
                if self._owner_line() == self.owner:
                    os.unlink(self.path)

    def _owner_line(self) -> str | None:
        try:
            return self.path.read_text()
        except OSError:
            return None

    def _create(self) -> bool:
        """Create the lock file with our owner line atomically; False if it exists."""
        return self._write(replace=False)

    def _write(self, replace: bool) -> bool:
        """Write our owner line whole to a temp file, then link it into place (or replace what is there)."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        tmp.write_text(self.owner)
        try:
            if replace:
                os.replace(tmp, self.path)
            else:
                os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _holder(self) -> tuple[str, int] | None:
        """``(host, pid)`` written in the lock file, or None when it is gone."""
        try:
            host, pid, _token = self.path.read_text().split()
            return host, int(pid)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return "?", -1  # unreadable: treated as held by an unknown owner

    def _take_over_stale(self, pid: int) -> None:
        stale = self.path.with_name(f".{self.path.name}.stale.{secrets.token_hex(4)}")
        with contextlib.suppress(FileNotFoundError):  # another taker may have moved it first
            os.rename(self.path, stale)
            os.unlink(stale)
            log.info("took over the checkpoint lock of %s from process %d, which is gone", self.directory, pid)

    def _refusal(self, host: str, pid: int) -> str:
        where = "this machine" if host == socket.gethostname() else f"host {host}"
        return (
            f"{self.directory} is in use: process {pid} on {where} has a CheckpointManager saving into it "
            f"(lock file {self.path}). Two managers on one directory overwrite and prune each other's "
            "checkpoints: save into another directory, or end that process (a lock whose process is gone is "
            "taken over)."
        )
