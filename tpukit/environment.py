"""Platform detection and version checks, without importing torch or torch_xla.

Everything here reads environment variables, files under /dev and /sys, and the
installed distributions' metadata, so it is safe to call before the runtime
starts (and on a machine where torch_xla is broken or missing).
"""

from __future__ import annotations

import glob
import os
import platform as _platform
import re
import sys
from dataclasses import dataclass, field
from importlib import metadata

# Google's PCI vendor id; TPU chips enumerate under it on TPU VMs and hosts.
GOOGLE_PCI_VENDOR = "0x1ae0"
# The pair tpukit is developed against; used to suggest an install command.
DEFAULT_PAIR = "2.9.0"


@dataclass(frozen=True)
class Environment:
    """What the machine looks like before the runtime starts."""

    platform: str  # "colab" | "kaggle" | "tpu-vm" | "local"
    tpu_signals: tuple[str, ...]  # human-readable evidence of a TPU
    pjrt_device: str | None  # PJRT_DEVICE as the user set it, if at all
    versions: dict = field(default_factory=dict)

    @property
    def has_tpu(self) -> bool:
        """True when any signal says a TPU is attached."""
        return bool(self.tpu_signals)


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    """Installed versions of python, torch, torch_xla and libtpu (None when absent)."""
    libtpu = None
    for name in ("libtpu", "libtpu-nightly"):
        libtpu = libtpu or _dist_version(name)
    return {
        "python": _platform.python_version(),
        "torch": _dist_version("torch"),
        "torch_xla": _dist_version("torch_xla") or _dist_version("torch-xla"),
        "libtpu": libtpu,
    }


def detect_platform(environ: dict | None = None) -> str:
    """Name the notebook platform: 'colab', 'kaggle', 'tpu-vm' or 'local'."""
    env = os.environ if environ is None else environ
    if "google.colab" in sys.modules or any(k in env for k in ("COLAB_RELEASE_TAG", "COLAB_GPU", "COLAB_TPU_ADDR")):
        return "colab"
    if any(k in env for k in ("KAGGLE_KERNEL_RUN_TYPE", "KAGGLE_URL_BASE", "KAGGLE_DATA_PROXY_TOKEN")):
        return "kaggle"
    if env.get("TPU_ACCELERATOR_TYPE") or env.get("TPU_WORKER_ID") is not None or _tpu_devices():
        return "tpu-vm"
    return "local"


def _tpu_devices() -> list[str]:
    return sorted(glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*"))


def _google_pci_devices() -> list[str]:
    found = []
    for vendor_file in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor_file) as f:
                if f.read().strip().lower() == GOOGLE_PCI_VENDOR:
                    found.append(os.path.basename(os.path.dirname(vendor_file)))
        except OSError:
            continue
    return found


def tpu_device_files() -> list[str]:
    """The TPU device files of this machine (/dev/accel*, /dev/vfio/N); empty elsewhere."""
    return _tpu_devices()


def tpu_signals(environ: dict | None = None) -> tuple[str, ...]:
    """Evidence of an attached TPU that exists without starting the runtime."""
    env = os.environ if environ is None else environ
    signals = []
    for key in ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "COLAB_TPU_ADDR", "TPU_WORKER_HOSTNAMES"):
        if env.get(key):
            signals.append(f"{key}={env[key]}")
    devs = _tpu_devices()
    if devs:
        signals.append(f"TPU device files: {', '.join(devs[:4])}" + (" ..." if len(devs) > 4 else ""))
    pci = _google_pci_devices()
    if pci:
        signals.append(f"{len(pci)} Google PCI device(s)")
    return tuple(signals)


def inspect(environ: dict | None = None) -> Environment:
    """Collect platform, TPU evidence, PJRT_DEVICE and versions in one record."""
    env = os.environ if environ is None else environ
    return Environment(
        platform=detect_platform(env),
        tpu_signals=tpu_signals(env),
        pjrt_device=env.get("PJRT_DEVICE") or None,
        versions=versions(),
    )


def _release(version: str | None) -> tuple[int, ...] | None:
    """Numeric release of a version string: '2.9.0+cu128' -> (2, 9, 0)."""
    if not version:
        return None
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        return None
    return tuple(int(x) for x in m.groups(default="0"))


def install_command(platform: str | None = None, torch_version: str | None = None) -> str:
    """The pip command that installs a matching torch/torch_xla pair here."""
    platform = platform or detect_platform()
    rel = _release(torch_version)
    pair = ".".join(map(str, rel)) if rel else DEFAULT_PAIR
    if platform in ("colab", "kaggle"):
        # These runtimes ship torch preinstalled: add only torch_xla matching it.
        return f"pip install 'torch_xla[tpu]=={pair}'  (matching the preinstalled torch {torch_version or pair}; do not reinstall torch)"
    extra = "[tpu]" if platform == "tpu-vm" else ""
    return f"pip install torch=={pair} 'torch_xla{extra}=={pair}'"


def version_mismatch(vers: dict) -> str | None:
    """A sentence describing a torch/torch_xla mismatch, or None when they match."""
    t, x = _release(vers.get("torch")), _release(vers.get("torch_xla"))
    if t is None or x is None or t == x:
        return None
    return (
        f"torch {vers['torch']} and torch_xla {vers['torch_xla']} do not match "
        f"(torch_xla must be built for the same torch release, or import fails with an undefined symbol). "
        f"Install the matching pair: pip install torch=={'.'.join(map(str, x))} torch_xla=={'.'.join(map(str, x))}"
    )


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of host memory available to new allocations (Linux ``MemAvailable``), or None elsewhere."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists on this machine (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True
