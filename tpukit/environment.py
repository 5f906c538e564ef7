"""Platform detection, version checks and the processes holding the TPU, without importing torch or torch_xla.

Everything here reads environment variables, files under /dev, /sys and /proc, and the
installed distributions' metadata, so it is safe to call before the runtime
starts (and on a machine where torch_xla is broken or missing).
"""

from __future__ import annotations

import glob
import os
import platform as _platform
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata

from .errors import TpuBusyError

# Google's PCI vendor id; TPU chips enumerate under it on TPU VMs and hosts.
GOOGLE_PCI_VENDOR = "0x1ae0"
# The pair tpukit is developed against; used to suggest an install command.
DEFAULT_PAIR = "2.9.0"
# Where the machine facts are read (module attributes, so a test can point them at a fake tree).
DEV_ROOT, PROC_ROOT = "/dev", "/proc"
# libtpu's multi-process lock: held by a process that loaded libtpu without ALLOW_MULTIPLE_LIBTPU_LOAD.
LIBTPU_LOCKFILES = ("/tmp/libtpu_lockfile", f"/tmp/libtpu_lock_{getattr(os, 'getuid', lambda: 0)()}/libtpu_lockfile")
# How to get a TPU on the notebook platforms that offer one (their menus).
SWITCH_TO_TPU = {
    "colab": "Runtime > Change runtime type > TPU v5e-1, then run the notebook again from the top",
    "kaggle": ("Settings > Accelerator > TPU v5e-8, with Settings > Internet on (the first cell installs tpukit), "
               "then run the notebook again from the top"),
}


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
    return sorted(glob.glob(os.path.join(DEV_ROOT, "accel*")) + glob.glob(os.path.join(DEV_ROOT, "vfio", "[0-9]*")))


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
    """The TPU device files of this machine (/dev/accel* on v4/v5e/v6e TPU VMs, /dev/vfio/N on v5p/v6e and
    Kaggle); empty elsewhere."""
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


def no_tpu_problem(env: Environment) -> str | None:
    """What the report says on a Colab or Kaggle runtime without a TPU: that tpukit runs on XLA:CPU
    and how to switch the runtime to a TPU. None elsewhere, and when a TPU is attached."""
    how = SWITCH_TO_TPU.get(env.platform)
    if how is None or env.has_tpu:
        return None
    where = "Colab runtime" if env.platform == "colab" else "Kaggle session"
    return (f"This {where} has no TPU, so tpukit runs on XLA:CPU: the code works, slowly, and nothing is measured "
            f"on a TPU. To get one: {how}. To run on the CPU on purpose, call tpukit.setup(device='cpu') "
            "(%tpu --device cpu) first instead.")


# ----------------------------------------------------------------- processes holding the TPU

@dataclass(frozen=True)
class TpuHolder:
    """A process that holds this machine's TPU: it has a chip's device file (or libtpu's lockfile) open."""

    pid: int
    command: str  # its command line ("" when it cannot be read)
    devices: tuple[str, ...]  # the TPU device files (and libtpu lockfile) it has open

    @property
    def kernel(self) -> bool:
        """True when the process is a notebook kernel (Jupyter, Colab or Kaggle)."""
        return any(k in self.command for k in ("ipykernel", "colab_kernel_launcher"))

    def describe(self) -> str:
        """One line: pid, command and what it holds."""
        what = " (a notebook kernel)" if self.kernel else ""
        return f"pid {self.pid}{what}: {self.command or '(command line unreadable)'}, holding {', '.join(self.devices)}"


def _roots(dev_root: str | None, proc_root: str | None, lockfiles: tuple[str, ...] | None) -> tuple:
    return dev_root or DEV_ROOT, proc_root or PROC_ROOT, tuple(LIBTPU_LOCKFILES if lockfiles is None else lockfiles)


def _held_by(pid: int, dev_root: str, proc_root: str, lockfiles: tuple[str, ...]) -> tuple[str, ...]:
    """The TPU files process ``pid`` has open, read from its fd links like ``fuser`` does."""
    fd_dir, held = os.path.join(proc_root, str(pid), "fd"), set()
    try:
        links = [os.path.join(fd_dir, fd) for fd in os.listdir(fd_dir)]
    except OSError:  # gone, or another user's process
        return ()
    chip = re.compile(re.escape(os.path.join(dev_root, "")) + r"(accel|vfio/)\d+")
    for link in links:
        try:
            target = os.readlink(link)
        except OSError:
            continue
        if target in lockfiles or chip.fullmatch(target):
            held.add(target)
    return tuple(sorted(held, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)]))


def _command(pid: int, proc_root: str) -> str:
    for name, sep in (("cmdline", b"\0"), ("comm", b"\n")):
        try:
            with open(os.path.join(proc_root, str(pid), name), "rb") as f:
                text = " ".join(f.read().replace(sep, b" ").decode(errors="replace").split())  # one line
        except OSError:
            continue
        if text:
            return text if len(text) <= 300 else text[:297] + "..."
    return ""


def tpu_holders(dev_root: str | None = None, proc_root: str | None = None,
                lockfiles: tuple[str, ...] | None = None) -> list[TpuHolder]:
    """The processes other than this one that hold a TPU chip's device file (``/dev/accel*``,
    ``/dev/vfio/N``) or libtpu's lockfile, by pid. Processes of other users are not seen (their
    fd links cannot be read). The roots default to the machine's (DEV_ROOT, PROC_ROOT, LIBTPU_LOCKFILES)."""
    dev_root, proc_root, lockfiles = _roots(dev_root, proc_root, lockfiles)
    try:
        pids = sorted(int(n) for n in os.listdir(proc_root) if n.isdigit() and int(n) != os.getpid())
    except OSError:
        return []
    return [TpuHolder(pid, _command(pid, proc_root), held) for pid in pids
            if (held := _held_by(pid, dev_root, proc_root, lockfiles))]


def check_tpu_free(environ: dict | None = None, **roots) -> None:
    """Raise :class:`~tpukit.TpuBusyError` naming each process that keeps torch_xla from starting on this
    process's TPU chips (pid, command, what it holds) and how to free them; return when none does.

    What blocks: any chip's device file, or only those of ``TPU_VISIBLE_CHIPS`` when the chips are split
    between processes (there the sibling processes hold the others); libtpu's lockfile only when
    ALLOW_MULTIPLE_LIBTPU_LOAD is set off (torch_xla sets it on, and libtpu then ignores the lock).
    ``roots``: ``dev_root``, ``proc_root``, ``lockfiles`` as for ``tpu_holders``."""
    env = os.environ if environ is None else environ
    visible = env.get("TPU_VISIBLE_CHIPS") or env.get("TPU_VISIBLE_DEVICES")
    chips = {c.strip() for c in visible.split(",")} if visible else None
    lock_counts = chips is None and env.get("ALLOW_MULTIPLE_LIBTPU_LOAD", "1").strip().lower() in ("", "0", "false")
    lockfiles = _roots(None, None, roots.get("lockfiles"))[2]

    def blocks(path: str) -> bool:
        m = re.search(r"accel(\d+)$", path)
        return lock_counts if path in lockfiles else chips is None or bool(m and m.group(1) in chips)

    holders = [TpuHolder(h.pid, h.command, tuple(d for d in h.devices if blocks(d)))
               for h in tpu_holders(**roots) if any(blocks(d) for d in h.devices)]
    if not holders:
        return
    shut = (" (a notebook kernel: shut it down from its notebook, Kernel > Shut Down Kernel, or in JupyterLab's "
            "Running tab)") if any(h.kernel for h in holders) else ""
    raise TpuBusyError(
        "This machine's TPU is held by another process, so torch_xla cannot start on it here (it would fail "
        "with 'Device or resource busy' or 'The TPU is already in use'):\n"
        + "\n".join(f"  {h.describe()}" for h in holders)
        + f"\nFree it, then run tpukit.setup() (or %tpu) again: stop that program{shut}, or end it from here with "
        f"tpukit.environment.free_tpu({holders[0].pid}) (it ends that process only, and only while it holds the "
        f"TPU), or run `kill {' '.join(str(h.pid) for h in holders)}` in a terminal. Or run on the CPU meanwhile: "
        "tpukit.setup(device='cpu').")


def free_tpu(pid: int, timeout: float = 10.0, *, dev_root: str | None = None, proc_root: str | None = None,
             lockfiles: tuple[str, ...] | None = None) -> TpuHolder:
    """End process ``pid``, which holds this machine's TPU (see ``tpu_holders``), and wait until it lets
    go; returns what it held. Only that process, and only if it holds a TPU device file or libtpu's
    lockfile: tpukit never ends a process unless you call this. SIGTERM first (the process may clean up),
    SIGKILL if it still holds the TPU after ``timeout`` seconds.

    Raises ValueError when ``pid`` does not hold the TPU (nothing is ended) or is this process, and
    :class:`~tpukit.TpuBusyError` when it may not be ended (another user's: ``sudo kill``) or keeps the TPU.
    """
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 1:
        raise ValueError(f"free_tpu(pid={pid!r}): pid must be a process id (a positive int), as the TpuBusyError "
                         "or tpukit.environment.tpu_holders() lists it.")
    if pid == os.getpid():
        raise ValueError(f"free_tpu({pid}) is this process itself: restart the kernel (or Python) to release its TPU.")
    roots = _roots(dev_root, proc_root, lockfiles)
    holders = tpu_holders(*roots)
    holder = next((h for h in holders if h.pid == pid), None)
    if holder is None:
        it = f"it is {_command(pid, roots[1]) or 'a process'}" if pid_alive(pid) else "no such process"
        raise ValueError(f"free_tpu({pid}): process {pid} does not hold this machine's TPU ({it}), so nothing was "
                         f"ended. The processes holding it now: {'; '.join(h.describe() for h in holders) or 'none'}.")
    for sig, wait in ((signal.SIGTERM, float(timeout)), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return holder
        except PermissionError:
            raise TpuBusyError(f"free_tpu({pid}): process {pid} ({holder.command}) belongs to another user and may "
                               f"not be ended from here; run `sudo kill {pid}` in a terminal.") from None
        deadline = time.monotonic() + wait
        while _held_by(pid, *roots) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _held_by(pid, *roots):
            return holder
    raise TpuBusyError(f"free_tpu({pid}): process {pid} still holds {', '.join(holder.devices)} after SIGTERM and "
                       "SIGKILL (it may be stuck in the TPU driver); restart the machine (or the notebook runtime).")
