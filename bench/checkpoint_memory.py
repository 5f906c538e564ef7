"""Host memory and write throughput of saving a ~1 GiB XLA state: tpukit vs xm.save vs torch.save.

A state shaped like a model's (float32: 8 matrices of 64 MiB, 56 of 8 MiB, 56 of
1 MiB and 256 vectors of 16 KiB, 1020 MiB in all; the largest tensor is 64 MiB)
is built on the XLA device (PJRT_DEVICE=CPU): each tensor is the output of a graph
(``cpu.to(device) * 0.02``), synced and waited for, so the state lives in the
XLA:CPU client's host buffers before anything is measured. Then it is saved one of
three ways, each in a fresh process (one subprocess per way and per repetition,
ways interleaved in rotating order):

* **tpukit**: ``tpukit.checkpoint.save(state, path)`` (streams tensor by tensor:
  skeleton archive, each tensor copied to the host and pwritten at its offset,
  then fsync + manifest; the sha256 is computed while writing);
* **xm.save**: ``torch_xla.core.xla_model.save(state, path)`` (copies the whole
  state to the CPU in one batch, then ``torch.save``);
* **torch.save**: ``torch.save({k: v.cpu() for k, v in state.items()}, path)``,
  the CPU copy users make by hand.

Measured around the save call only (the CPU copies each way makes are inside it):

* **peak extra RSS**: the process's peak resident memory during the call minus
  its resident memory just before it. The baseline already holds the state (the
  XLA:CPU device's buffers are host memory); free heap memory is returned to the
  OS first (``malloc_trim``) so a save cannot hide allocations in it. The peak
  is the larger of a sampling thread reading ``/proc/self/statm`` every ~1 ms and
  the kernel's own high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs`` just before the call), which also catches peaks
  inside C calls that hold the GIL. Page cache is not RSS; file pages a process
  maps are, so the anonymous part is reported too.
* **throughput**: state GiB / wall seconds of the call. tpukit's call includes an
  fsync and the sha256 and CRC-32 of the file (computed while writing); the others do
  no fsync or sha256, so the time an
  fsync would add after them is measured outside the call and reported beside.

A tiny save of the same way runs first in each process (imports and first-call
setup are not part of the measure). Files go to build/bench-checkpoint/ in the
repository (refused if that is tmpfs) and are deleted, then ``sync``ed, between
runs. Separate runs (``tpukit-phases``) time where tpukit's save spends its time
by wrapping its internal functions from the outside (tpukit is not modified),
and check that the file reads back equal to the state.

Three held-out states are measured the same way (no phase runs): ``8x64MiB``
(8 float32 tensors of 64 MiB, 0.5 GiB: the largest tensor is an eighth of the
state), ``1x1GiB`` (one float32 tensor of 1 GiB: the largest tensor is the
state) and ``1x1GiB-moved``: the same tensor moved to the device as it is
(``cpu.to(device)``, no computation: a model placed on the device, a loaded
checkpoint). torch_xla returns from such a move, and from ``torch_xla.sync()`` and
``xm.wait_device_ops()``, with the data in a host staging copy that the PJRT
client copies into the device buffer in the background, freeing the staging copy
when done (on XLA:CPU the device buffer is host memory too). A save started
then overlaps that copy, whose resident memory is not the save's: for moved
states each child first measures what the copy still adds with no save running
(``in_flight_extra_rss_gb``, from right after ``wait_device_ops()`` until a
one-element read of every tensor returns), and the save is measured after it.
tpukit copies device tensors larger than its chunk size (4 MiB by
default) to the host a chunk at a time, so its peak stays near a few chunks for
all of them. ``--states`` picks which states to run (default: all four).

Prints a table per state and writes bench/results/checkpoint_memory.json under the
key of the stack it ran on (``torch_xla<version>-py<major.minor>``), keeping the
other stacks' results: run it once with each environment. Targets, for every
state: tpukit's peak extra RSS <= 0.25 x state size; tpukit GiB/s /
torch.save GiB/s >= 0.9 (the save includes tpukit's one-time compile of the
chunk-selecting graph: the warm-up save is tiny). Sizes are GiB (2**30 bytes)
throughout.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

GIB = 2**30
MIB = 2**20
REPS = int(os.environ.get("BENCH_REPS", "3"))
PHASE_REPS = int(os.environ.get("BENCH_PHASE_REPS", "3"))
WAYS = ("tpukit", "xm.save", "torch.save")
MEM_TARGET = 0.25  # tpukit peak extra RSS <= MEM_TARGET x state size
SPEED_TARGET = 0.9  # tpukit GiB/s / torch.save GiB/s >= SPEED_TARGET
ROOT = Path(__file__).resolve().parent.parent
WORKDIR = ROOT / "build" / "bench-checkpoint"
OUT = Path(__file__).resolve().parent / "results" / "checkpoint_memory.json"

# (count, shape) of float32 tensors: a model-like mix, 1020 MiB in all, largest 64 MiB.
LAYOUT = (
    (8, (4096, 4096)),  # 64 MiB each (embeddings / big projections)
    (56, (2048, 1024)),  # 8 MiB each
    (56, (512, 512)),  # 1 MiB each
    (256, (4096,)),  # 16 KiB each (biases, norms)
)
# name -> (layout, how its tensors reach the device: "computed" = a graph's output, "moved" = cpu.to(device))
STATES = {
    "model": (LAYOUT, "computed"),
    "8x64MiB": (((8, (4096, 4096)),), "computed"),  # held out: 0.5 GiB, eight tensors of 64 MiB
    "1x1GiB": (((1, (16384, 16384)),), "computed"),  # held out: one tensor of 1 GiB
    "1x1GiB-moved": (((1, (16384, 16384)),), "moved"),  # held out: the same, moved to the device as it is
}


# --------------------------------------------------------------------------- child process

def _statm_reader():
    fd = os.open("/proc/self/statm", os.O_RDONLY)
    page = os.sysconf("SC_PAGE_SIZE")

    def read() -> tuple[int, int]:
        """(resident bytes, resident anonymous bytes) of this process."""
        fields = os.pread(fd, 128, 0).split()
        resident, shared = int(fields[1]) * page, int(fields[2]) * page
        return resident, resident - shared

    return read


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class Sampler:
    """Samples this process's RSS every ~1 ms in a thread; also resets and reads the kernel's VmHWM."""

    def __init__(self, period: float = 0.001):
        self.period, self.read = period, _statm_reader()
        self.peak = self.peak_anon = 0
        self.samples = 0
        self._stop = threading.Event()

    def __enter__(self):
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # free heap memory back to the OS: the baseline is what is live
        except (OSError, AttributeError):
            pass
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self.before, self.before_anon = self.read()
        self.peak, self.peak_anon = self.before, self.before_anon
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            rss, anon = self.read()
            self.peak = max(self.peak, rss)
            self.peak_anon = max(self.peak_anon, anon)
            self.samples += 1
            time.sleep(self.period)

    def __exit__(self, *exc):
        rss, anon = self.read()
        self.hwm = _status_kb("VmHWM")
        self._stop.set()
        self._thread.join()
        self.peak, self.peak_anon = max(self.peak, rss), max(self.peak_anon, anon)
        return False


def make_state(device, layout=LAYOUT, how="computed"):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    g = torch.Generator().manual_seed(0)
    state = {}
    for group, (count, shape) in enumerate(layout):
        for i in range(count):
            cpu = torch.randn(shape, generator=g)
            if how == "moved":
                state[f"g{group}.t{i}"] = cpu.to(device)  # device data, still being copied in the background
            else:
                state[f"g{group}.t{i}"] = cpu.to(device) * 0.02  # a graph output, like trained weights
            del cpu
            torch_xla.sync()  # one tensor at a time: the build never holds much more than the state
    xm.wait_device_ops()  # waits for executions, not for the background copies of moved tensors
    return state


def landed(state) -> None:
    """Wait until every tensor of ``state`` holds its data on the device and the host staging copies are freed.

    A one-element read of each tensor (one small graph) runs after the tensor's copy to the device; the
    staging copy is freed as that copy completes, so resident memory is then watched until it stops falling.
    """
    import torch

    torch.stack([t.reshape(-1)[0] for t in state.values()]).cpu()
    read = _statm_reader()
    rss, deadline = read()[0], time.monotonic() + 3
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = read()[0]
        if now > rss - MIB:
            return
        rss = now


def _save(way: str, state, path: Path):
    import torch

    if way == "tpukit":
        import tpukit.checkpoint

        tpukit.checkpoint.save(state, path)
    elif way == "xm.save":
        import torch_xla.core.xla_model as xm

        xm.save(state, str(path))
    else:
        cpu = {k: v.cpu() for k, v in state.items()}
        torch.save(cpu, path)
        del cpu


def _fsync_seconds(path: Path) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


class Phases:
    """Times tpukit's save by phase, wrapping its internal functions from the outside."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self._undo = []

    def wrap(self, owner, name: str, label: str, nbytes=None):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0
                self.calls[label] = self.calls.get(label, 0) + 1
                if nbytes is not None:
                    self.bytes[label] = self.bytes.get(label, 0) + nbytes(*args, **kwargs)

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def install(self):
        import stat

        from tpukit import _xla
        from tpukit.checkpoint import files, saveload, stream

        self.wrap(saveload, "sync_state", "sync_state (no pending work)")
        self.wrap(saveload, "preflight", "preflight (disk + memory check)")
        self.wrap(stream, "skeleton", "skeleton (torch.empty stand-ins)")
        self.wrap(stream, "_save_torch", "skeleton archive (torch.save, skip_data)")
        self.wrap(stream, "_locate", "locate offsets (torch.load mmap)")
        self.wrap(_xla, "to_cpu", "device->host copy (_xla_get_cpu_tensors)",
                  lambda ts, **k: sum(t.numel() * t.element_size() for t in ts))
        self.wrap(stream, "_pwrite_all", "pwrite tensor data", lambda fd, data, off: len(data))
        self.wrap(stream, "_hash_range", "sha256 of the archive headers (read back)")
        self.wrap(stream.zlib, "crc32", "CRC-32 of each record (zip data descriptors)")
        self.wrap(stream, "_crc_fields", "locate CRC fields (zip central directory)")
        self.wrap(files, "hash_file", "sha256 read-back (hash_file)")
        real_fsync = os.fsync

        def fsync(fd):
            label = ("fsync directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
            t0 = time.perf_counter()
            try:
                return real_fsync(fd)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0
                self.calls[label] = self.calls.get(label, 0) + 1

        os.fsync = fsync
        self._undo.append((os, "fsync", real_fsync))

    def uninstall(self):
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def _sha256_memory_gib_s() -> float:
    """sha256 speed on bytes already in memory (the read-back's CPU floor)."""
    import hashlib

    buf = os.urandom(64 * MIB)
    t0 = time.perf_counter()
    for _ in range(4):
        hashlib.sha256(buf).digest()
    return 4 * 64 * MIB / GIB / (time.perf_counter() - t0)


def _check_file(path: Path, state) -> bool:
    """The saved file reads back (torch.load) equal to the state on the device, tensor by tensor."""
    import torch

    loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if list(loaded) != list(state):
        return False
    return all(torch.equal(loaded[k], v.cpu()) for k, v in state.items())


def child(way: str, workdir: Path, state_name: str = "model") -> dict:
    import torch
    import torch_xla

    device = torch_xla.device()
    layout, how = STATES[state_name]
    t0 = time.perf_counter()
    state = make_state(device, layout, how)
    build_s = time.perf_counter() - t0
    in_flight = None
    if how == "moved":  # what the background copy to the device still adds, no save running; then it is done
        with Sampler() as f:
            landed(state)
        in_flight = (max(f.peak, f.hwm) - f.before) / GIB
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    largest = max(t.numel() * t.element_size() for t in state.values())
    save_way = "tpukit" if way == "tpukit-phases" else way
    tag = f"{way.replace('.', '_')}-{os.getpid()}"

    # Warm-up: a tiny save of the same way (imports, first-call setup), then deleted.
    warm = workdir / f"warm-{tag}.pt"
    small = {"a": torch.ones(4096, device=device), "b": torch.ones(4096, device=device) * 2}
    torch_xla.sync()
    _save(save_way, small, warm)  # tiny: no chunked copy, so its one-time compile is measured below
    del small
    for p in workdir.glob(f"*warm-{tag}*"):
        p.unlink()

    path = workdir / f"state-{tag}.pt"
    phases = Phases() if way == "tpukit-phases" else None
    if phases:
        phases.install()
    with Sampler() as s:
        t0 = time.perf_counter()
        _save(save_way, state, path)
        seconds = time.perf_counter() - t0
    if phases:
        phases.uninstall()
    result = {
        "way": way, "pid": os.getpid(), "seconds": seconds, "gb_per_s": nbytes / GIB / seconds,
        "state_bytes": nbytes, "largest_tensor_bytes": largest, "tensors": len(state),
        "file_bytes": path.stat().st_size,
        "rss_before_gb": s.before / GIB, "peak_rss_gb": max(s.peak, s.hwm) / GIB,
        "peak_extra_rss_gb": (max(s.peak, s.hwm) - s.before) / GIB,
        "peak_extra_rss_sampled_gb": (s.peak - s.before) / GIB,
        "peak_extra_rss_hwm_gb": (s.hwm - s.before) / GIB,
        "peak_extra_anon_rss_sampled_gb": (s.peak_anon - s.before_anon) / GIB,
        "samples": s.samples, "state_build_s": build_s,
    }
    if in_flight is not None:
        result["in_flight_extra_rss_gb"] = in_flight
    if save_way != "tpukit":
        result["fsync_after_s"] = _fsync_seconds(path)  # outside the measured call
    if phases:
        result["phases_s"] = phases.seconds
        result["phase_calls"] = phases.calls
        result["phase_bytes"] = phases.bytes
        result["sha256_memory_gib_s"] = _sha256_memory_gib_s()
        result["file_equals_state"] = _check_file(path, state)
    return result


# --------------------------------------------------------------------------- parent

def _fstype(path: Path) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype, *_ = line.split()
            mount = mount.replace("\\040", " ")
            if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def _clean(workdir: Path) -> None:
    for p in workdir.iterdir():
        if p.is_file():
            p.unlink()
    os.sync()


def run(way: str, state_name: str = "model") -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("CPU_NUM_DEVICES", None)  # one XLA:CPU device
    proc = subprocess.run([sys.executable, __file__, "--child", way, "--state", state_name], env=env,
                          capture_output=True, text=True, check=False)
    _clean(WORKDIR)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"the {way} run failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _busy() -> int:
    """CPU jiffies the whole machine has been busy (from /proc/stat)."""
    with open("/proc/stat") as f:
        cpu = [int(v) for v in f.readline().split()[1:]]
    return sum(cpu[:8]) - cpu[3] - cpu[4]


def _machine_busy_share(j0: int, t0: float) -> float:
    """Share of the machine's CPUs busy since (jiffies, time), this bench's own run included."""
    return (_busy() - j0) / os.sysconf("SC_CLK_TCK") / ((time.perf_counter() - t0) * (os.cpu_count() or 1))


def measure(state_name: str, phase_reps: int) -> dict:
    """REPS fresh-process runs of every way on state ``state_name`` (+ ``phase_reps`` phase runs): medians, targets."""
    med = statistics.median
    layout, how = STATES[state_name]
    print(f"\n== state {state_name}: {REPS} repetitions of {len(WAYS)} ways, each in a fresh process"
          + (f", then {phase_reps} tpukit runs timed by phase" if phase_reps else ""), flush=True)
    raw: dict[str, list[dict]] = {w: [] for w in WAYS}
    loads = []
    for r in range(REPS):
        order = WAYS[r % 3:] + WAYS[:r % 3]
        for way in order:
            j0, t0 = _busy(), time.perf_counter()
            res = run(way, state_name)
            res["machine_busy_share"] = _machine_busy_share(j0, t0)  # incl. this run: 0.5 is one core
            loads.append(res["machine_busy_share"])
            raw[way].append(res)
            extra = "" if "fsync_after_s" not in res else f"  (+fsync after: {res['fsync_after_s']:.2f} s)"
            print(f"rep {r + 1} {way:10s} peak extra RSS {res['peak_extra_rss_gb']:.3f} GiB "
                  f"(sampled {res['peak_extra_rss_sampled_gb']:.3f}, VmHWM {res['peak_extra_rss_hwm_gb']:.3f})  "
                  f"{res['seconds']:6.2f} s  {res['gb_per_s']:.3f} GiB/s{extra}  "
                  f"machine busy {res['machine_busy_share']:.0%}", flush=True)
    phase_runs = [run("tpukit-phases", state_name) for _ in range(phase_reps)]
    for p in phase_runs:
        print(f"phases run: {p['seconds']:.2f} s, file equals state: {p['file_equals_state']}", flush=True)

    first = raw["tpukit"][0]
    state_gb, largest_gb = first["state_bytes"] / GIB, first["largest_tensor_bytes"] / GIB
    ways = {}
    for way in WAYS:
        rs = raw[way]
        ways[way] = {
            "peak_extra_rss_gb": med(r["peak_extra_rss_gb"] for r in rs),
            "peak_extra_rss_x_state": med(r["peak_extra_rss_gb"] for r in rs) / state_gb,
            "gb_per_s": med(r["gb_per_s"] for r in rs),
            "seconds": med(r["seconds"] for r in rs),
            "peak_extra_anon_rss_sampled_gb": med(r["peak_extra_anon_rss_sampled_gb"] for r in rs),
            "rss_before_gb": med(r["rss_before_gb"] for r in rs),
            "file_bytes": rs[0]["file_bytes"],
            "repeats": rs,
        }
        if "fsync_after_s" in rs[0]:
            ways[way]["fsync_after_s"] = med(r["fsync_after_s"] for r in rs)
            ways[way]["gb_per_s_with_fsync_after"] = med(
                r["state_bytes"] / GIB / (r["seconds"] + r["fsync_after_s"]) for r in rs)
    tk, ts = ways["tpukit"], ways["torch.save"]
    ratio = tk["gb_per_s"] / ts["gb_per_s"]
    rep_ratios = [a["gb_per_s"] / b["gb_per_s"] for a, b in zip(raw["tpukit"], raw["torch.save"])]
    worst_mem = max(r["peak_extra_rss_gb"] for r in raw["tpukit"])
    mem_ok = tk["peak_extra_rss_gb"] <= MEM_TARGET * state_gb
    speed_ok = ratio >= SPEED_TARGET

    result = {
        "state": state_name,
        "built": how,
        "state_gb": state_gb,
        "largest_tensor_gb": largest_gb,
        "tensors": first["tensors"],
        "layout": [{"count": c, "shape": list(s), "mib_each": math.prod(s) * 4 / MIB} for c, s in layout],
        "ways": {w: {k: v for k, v in d.items() if k != "repeats"} for w, d in ways.items()},
        "raw_repeats": {w: d["repeats"] for w, d in ways.items()},
        "targets": {
            "tpukit_peak_extra_rss_le_0.25_state": {
                "value_gb": tk["peak_extra_rss_gb"], "x_state": tk["peak_extra_rss_gb"] / state_gb,
                "limit_gb": MEM_TARGET * state_gb, "met": mem_ok,
                "worst_repetition_gb": worst_mem, "worst_repetition_x_state": worst_mem / state_gb},
            "tpukit_over_torch_save_throughput_ge_0.9": {
                "ratio": ratio, "limit": SPEED_TARGET, "met": speed_ok,
                "ratio_of": "median tpukit GiB/s / median torch.save GiB/s",
                "per_repetition_ratios": rep_ratios},
        },
        "machine_busy_share_median": med(loads),
    }
    if how == "moved":  # every way's child measured it before its save
        flights = [r["in_flight_extra_rss_gb"] for w in WAYS for r in raw[w]]
        result["in_flight_extra_rss_gb"] = {"median": med(flights), "x_state_median": med(flights) / state_gb,
                                            "min": min(flights), "max": max(flights), "runs": len(flights)}
    if phase_runs:
        labels = sorted({k for p in phase_runs for k in p["phases_s"]}, key=lambda k: -med(
            p["phases_s"].get(k, 0.0) for p in phase_runs))
        phase_med = {k: med(p["phases_s"].get(k, 0.0) for p in phase_runs) for k in labels}
        total_med = med(p["seconds"] for p in phase_runs)
        other = med(p["seconds"] - sum(p["phases_s"].values()) for p in phase_runs)
        breakdown = {k: {"seconds": v, "share": v / total_med} for k, v in phase_med.items()}
        breakdown["other (manifest, rename, Python)"] = {"seconds": other, "share": other / total_med}
        # Work tpukit's save does that torch.save does not: the sha256 read-back and the fsyncs.
        extra_keys = [k for k in labels if k.startswith(("sha256", "fsync"))]
        extra_share = med(sum(p["phases_s"].get(k, 0.0) for k in extra_keys) / p["seconds"] for p in phase_runs)
        result["tpukit_time_breakdown"] = {
            "save_seconds_median": total_med,
            "phases_median": breakdown,
            "sha256_in_memory_gib_s": med(p["sha256_memory_gib_s"] for p in phase_runs),
            "file_equals_state": all(p["file_equals_state"] for p in phase_runs),
            "hash_and_fsync_share": extra_share,
            "runs": phase_runs,
            "how": "separate tpukit runs with tpukit's internal functions wrapped by timers from outside",
        }

    print(f"\nstate {state_name}: {state_gb:.3f} GiB in {first['tensors']} float32 tensors on the XLA:CPU device, "
          f"largest {largest_gb * 1024:.0f} MiB; medians of {REPS} fresh-process runs")
    print(f"{'way':12s} {'peak extra RSS GiB':>19s} {'x state':>8s} {'seconds':>8s} {'GiB/s':>7s} "
          f"{'+fsync after s':>15s} {'GiB/s w/ fsync':>15s}")
    for way in WAYS:
        d = ways[way]
        fs = (f"{d['fsync_after_s']:15.2f} {d['gb_per_s_with_fsync_after']:15.3f}" if "fsync_after_s" in d
              else f"{'(inside)':>15s} {d['gb_per_s']:15.3f}")
        print(f"{way:12s} {d['peak_extra_rss_gb']:19.3f} {d['peak_extra_rss_gb'] / state_gb:8.2f} "
              f"{d['seconds']:8.2f} {d['gb_per_s']:7.3f} {fs}")
    if how == "moved":
        fl = result["in_flight_extra_rss_gb"]
        print(f"before each save, the background copy to the device still added {fl['median']:.3f} GiB "
              f"({fl['x_state_median']:.2f}x, {fl['min']:.3f}-{fl['max']:.3f}) with no save running")
    print(f"target tpukit peak extra RSS <= {MEM_TARGET} x state ({MEM_TARGET * state_gb:.3f} GiB): "
          f"{tk['peak_extra_rss_gb']:.3f} GiB = {tk['peak_extra_rss_gb'] / state_gb:.2f}x, "
          f"{'met' if mem_ok else 'NOT met'} (worst repetition {worst_mem / state_gb:.2f}x)")
    print(f"target tpukit / torch.save throughput >= {SPEED_TARGET}: {ratio:.2f}, {'met' if speed_ok else 'NOT met'} "
          f"(per repetition: {', '.join(f'{r:.2f}' for r in rep_ratios)}; machine busy "
          f"{result['machine_busy_share_median']:.0%} of its CPUs, median over runs)")
    if phase_runs:
        bd = result["tpukit_time_breakdown"]
        print(f"tpukit save by phase (median of {len(phase_runs)} runs, {bd['save_seconds_median']:.2f} s):")
        for k, v in bd["phases_median"].items():
            print(f"  {k:45s} {v['seconds']:6.2f} s  {v['share']:5.0%}")
        print(f"  (sha256 of in-memory bytes: {bd['sha256_in_memory_gib_s']:.2f} GiB/s; sha256 read-back + "
              f"fsyncs: {bd['hash_and_fsync_share']:.0%} of the save)")
    return result


def main(state_names: list[str]) -> int:
    WORKDIR.mkdir(parents=True, exist_ok=True)
    fstype = _fstype(WORKDIR)
    if fstype in ("tmpfs", "ramfs"):
        raise SystemExit(f"{WORKDIR} is on {fstype} (memory): the bench must write to a real disk")
    if shutil.disk_usage(WORKDIR).free < 4 * GIB:
        raise SystemExit(f"{WORKDIR} needs about 4 GiB free")
    _clean(WORKDIR)
    print(f"writing to {WORKDIR} ({fstype})", flush=True)
    from tpukit.checkpoint.chunks import COPY_CHUNK

    key, versions = stack()
    print(f"stack {key}: Python {versions['python']}, torch {versions['torch']}, torch_xla {versions['torch_xla']}",
          flush=True)
    states = {name: measure(name, PHASE_REPS if name == "model" else 0) for name in state_names}
    results = _read_results()
    entry = results["stacks"].get(key, {})
    entry = {**versions, "date": time.strftime("%Y-%m-%d"), "copy_chunk_bytes": COPY_CHUNK,
             "machine": f"{platform.machine()}, {os.cpu_count()} cores, XLA:CPU, shared with other work",
             "reps": REPS, "states": {**entry.get("states", {}), **states}}  # a --states run keeps the others
    entry["all_targets_met"] = all(t["met"] for st in entry["states"].values() for t in st["targets"].values())
    results["stacks"][key] = entry
    result = {
        "unit": "GiB (2**30 bytes); gb_per_s is GiB/s",
        "stacks": results["stacks"],
        "method": {
            "peak_extra_rss": ("max(sampled /proc/self/statm every ~1 ms, kernel VmHWM reset via "
                               "/proc/self/clear_refs) during the save call - RSS just before it (after "
                               "gc + malloc_trim; the state's XLA:CPU buffers are already resident)"),
            "gb_per_s": "state GiB / wall seconds of the save call (device->host copies included)",
            "process": "one fresh process per way, state and repetition, ways interleaved in rotating order; "
                       "a tiny save of the same way first (warm-up; tpukit's chunk graph compiles in the measured save)",
            "torch.save": "torch.save({k: v.cpu() for k, v in state.items()}, path)",
            "xm.save": "torch_xla.core.xla_model.save(state, path)",
            "tpukit": "tpukit.checkpoint.save(state, path) (includes fsync, sha256 and CRC-32 computed while "
                      "writing, manifest; device tensors over copy_chunk_bytes copied a chunk at a time)",
            "fsync_after_s": "for xm.save and torch.save: an fsync of the file after the call, not in gb_per_s",
            "disk": f"{WORKDIR.relative_to(ROOT)} on {fstype}; files deleted and sync'ed between runs",
            "states": "computed: each tensor a graph's output (cpu.to(device) * 0.02); moved: cpu.to(device) as it "
                      "is, and each run waits until the background copy to the device is done (one-element "
                      "reads) before its save, reporting what that copy added meanwhile as in_flight_extra_rss_gb",
            "stacks": "one entry per stack (torch_xla<version>-py<major.minor>), written by a run on that stack",
        },
    }
    print("\nsummary (median peak extra RSS x state, tpukit / torch.save throughput):")
    for name, st in states.items():
        mem, speed = (st["targets"][k] for k in ("tpukit_peak_extra_rss_le_0.25_state",
                                                 "tpukit_over_torch_save_throughput_ge_0.9"))
        print(f"  {name:12s} {mem['x_state']:.2f}x (<= {MEM_TARGET}: {'met' if mem['met'] else 'NOT met'})  "
              f"tpukit {st['ways']['tpukit']['gb_per_s']:.3f} GiB/s, torch.save "
              f"{st['ways']['torch.save']['gb_per_s']:.3f} GiB/s, ratio {speed['ratio']:.2f} "
              f"(>= {SPEED_TARGET}: {'met' if speed['met'] else 'NOT met'})")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT} (stack {key})")
    return 0


def stack() -> tuple[str, dict]:
    """The results key of this interpreter's stack (``torch_xla2.8.0-py3.12``) and its versions."""
    from importlib.metadata import version

    versions = {"python": platform.python_version(), "torch": version("torch"), "torch_xla": version("torch_xla")}
    major_minor = ".".join(platform.python_version_tuple()[:2])
    return f"torch_xla{versions['torch_xla']}-py{major_minor}", versions


def _read_results() -> dict:
    """The results file as ``{"stacks": {key: entry}}``; a file from before stacks were kept becomes one entry."""
    if not OUT.exists():
        return {"stacks": {}}
    old = json.loads(OUT.read_text())
    if "stacks" in old:
        return old
    return {"stacks": {"torch_xla2.9.0-py3.11": {
        "python": "3.11.7", "torch": "2.9.0", "torch_xla": "2.9.0", "date": "2026-11-25",
        "note": "before results were kept per stack (versions from bench/README.md); its states were all graph "
                "outputs, none moved to the device",
        **{k: old[k] for k in ("copy_chunk_bytes", "machine", "reps", "states", "all_targets_met") if k in old}}}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", choices=WAYS + ("tpukit-phases",))
    parser.add_argument("--state", choices=tuple(STATES), default="model", help="(with --child) the state to save")
    parser.add_argument("--states", nargs="+", choices=tuple(STATES), default=list(STATES),
                        help="the states to measure")
    args = parser.parse_args()
    if args.child:
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        print(json.dumps(child(args.child, WORKDIR, args.state)))
        sys.exit(0)
    sys.exit(main(args.states))
