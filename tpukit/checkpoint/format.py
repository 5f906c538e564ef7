"""What a checkpoint is on disk: the manifest record and the checkpoint file names.

A checkpoint is a payload plus a JSON manifest next to it (the same name with a
``.json`` suffix). A ``CheckpointManager`` names its files ``ckpt-<step>.<suffix>``
with the step zero-padded to 8 digits; ``checkpoint_name`` writes that pattern and
``parse_name`` reads it back, so the pattern lives in one place.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import CheckpointError

FILE_FORMAT_VERSION = 1  # a single-file payload
SHARDED_FORMAT_VERSION = 2  # a sharded checkpoint directory (sharded.py); older tpukit says "upgrade"
FORMAT_VERSION = SHARDED_FORMAT_VERSION  # the newest this tpukit reads
WEIGHTS_FORMATS = ("torch", "safetensors")
SUFFIX = {"torch": ".pt", "safetensors": ".safetensors", "dcp": ".dcp"}  # payload suffix per weights format
MANIFEST_SUFFIX = ".json"
NAME_PREFIX = "ckpt-"
_NAME_RE = re.compile(rf"^{re.escape(NAME_PREFIX)}(\d{{8,}})(\.[a-z]+)$")


def check_weights_format(weights_format: str) -> str:
    """``weights_format`` if it is one of WEIGHTS_FORMATS; raises CheckpointError otherwise."""
    if weights_format not in WEIGHTS_FORMATS:
        raise CheckpointError(f"weights_format={weights_format!r} is not known; use one of {WEIGHTS_FORMATS}.")
    return weights_format


def checkpoint_name(step: int, suffix: str) -> str:
    """The file name of checkpoint ``step`` with ``suffix`` (``.json``, ``.pt``, ``.safetensors``, ``.dcp``)."""
    return f"{NAME_PREFIX}{step:08d}{suffix}"


def parse_name(name: str) -> tuple[int, str] | None:
    """``(step, suffix)`` of a checkpoint file name (manifest or payload); None for any other name."""
    m = _NAME_RE.match(name)
    if m is None or m.group(2) not in (MANIFEST_SUFFIX, *SUFFIX.values()):
        return None
    return int(m.group(1)), m.group(2)


def committed_steps(directory: Path) -> list[int]:
    """Steps in ``directory`` that have a manifest (committed), oldest first; [] when it does not exist."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(parsed[0] for parsed in map(parse_name, names) if parsed and parsed[1] == MANIFEST_SUFFIX)


@dataclass(frozen=True)
class Manifest:
    """The JSON record written next to a payload; its presence commits the checkpoint."""

    payload: str  # file name of the payload, in the manifest's directory
    weights_format: str  # "torch" or "safetensors"
    step: int | None
    time: float  # unix wall time of the save
    bytes: int
    sha256: str
    tpukit: str
    torch: str | None
    torch_xla: str | None
    format_version: int = FILE_FORMAT_VERSION
    files: dict | None = None  # sharded checkpoints: {file name: [bytes, sha256]} of the directory's files

    def to_json(self) -> str:
        """The manifest as JSON text."""
        return json.dumps({"kind": "tpukit-checkpoint", **asdict(self)}, indent=1) + "\n"

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Manifest":
        """Read and check a manifest file; raises CheckpointError when it is unusable."""
        try:
            data = json.loads(Path(path).read_text())
            if data.pop("kind") != "tpukit-checkpoint":
                raise ValueError("not a tpukit manifest")
            if data.get("format_version", 0) > FORMAT_VERSION:
                raise CheckpointError(
                    f"Checkpoint {path} has format version {data['format_version']}, newer than this "
                    f"tpukit understands ({FORMAT_VERSION}). Upgrade tpukit to load it."
                )
            return cls(**data)
        except FileNotFoundError:
            raise CheckpointError(
                f"Checkpoint manifest {path} is missing: the save did not finish or the payload "
                "was not written by tpukit.save, so it is not trusted. Load another checkpoint."
            ) from None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CheckpointError(
                f"Checkpoint manifest {path} is unreadable ({exc!r}); the checkpoint is not trusted. "
                "Load another checkpoint."
            ) from None


def manifest_path(path: str | os.PathLike) -> Path:
    """Where the manifest of payload ``path`` lives: the same name with a ``.json`` suffix."""
    return Path(path).with_suffix(MANIFEST_SUFFIX)
