"""Notebook platforms without a TPU, a TPU held by another process, and XLA's GSPMD notice on stderr.

A TPU cannot exist here, so the machine facts are mocked where they must be: Colab's and
Kaggle's environment variables (with conftest.no_tpu_machine), and the TPU device files,
which are plain files in a fake /dev under tmp_path (tpukit.environment.DEV_ROOT or the
dev_root argument). The processes holding them are real child processes, found by pid in the
real /proc; one test also builds a fake /proc tree, to cover what no child here can show
(a notebook kernel's command line, /dev/vfio groups, libtpu's lockfile).
"""

import os
import signal
import subprocess
import sys
import warnings

import pytest

import tpukit
from tpukit import environment, runtime
from tpukit.environment import TpuHolder
from tpukit.errors import TpuBusyError
from conftest import MACHINE_ENV_PREFIXES, run_python

HOLD = ("import signal, sys, time\n"
        "chips = [open(path, 'rb') for path in sys.argv[1:]]\n"
        "{extra}\n"
        "print('holding', flush=True)\n"
        "time.sleep(300)\n")


@pytest.fixture
def fake_dev(tmp_path):
    """A fake /dev with a TPU host's device files (plain files: the machine fact mocked)."""
    dev = tmp_path / "dev"
    (dev / "vfio").mkdir(parents=True)
    for name in ("accel0", "accel1", "vfio/0", "vfio/vfio"):
        (dev / name).write_text("")
    return dev


@pytest.fixture
def start():
    """Start real child processes (one holding fake TPU files when given paths); end them afterwards."""
    procs = []

    def _start(*paths, extra: str = "") -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLD.format(extra=extra), *map(str, paths)],
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "holding"
        return proc

    yield _start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def _fake_proc(root, pid: int, links: dict, cmdline: bytes = b"", comm: bytes = b"") -> None:
    fd = root / str(pid) / "fd"
    fd.mkdir(parents=True)
    for n, target in links.items():
        os.symlink(target, fd / str(n))
    if cmdline:
        (root / str(pid) / "cmdline").write_bytes(cmdline)
    if comm:
        (root / str(pid) / "comm").write_bytes(comm)


@pytest.fixture
def fake_proc(tmp_path):
    """A fake /proc (the machine fact mocked): a training script holding two chips, a notebook kernel
    holding a vfio group, a process holding only libtpu's lockfile, and this process holding a chip."""
    proc = tmp_path / "proc"
    _fake_proc(proc, 101, {3: "/dev/accel10", 4: "/dev/accel2", 5: "/dev/null", 6: "/dev/accel"},
               cmdline=b"python\x00train.py\x00--steps\x00100\x00")
    _fake_proc(proc, 102, {3: "/dev/vfio/vfio", 7: "/dev/vfio/3"},
               cmdline=b"/usr/bin/python3\0-m\0ipykernel_launcher\0-f\0/root/kernel-1.json\0")
    _fake_proc(proc, 103, {3: "/tmp/libtpu_lockfile"}, comm=b"jax-worker\n")
    _fake_proc(proc, 104, {0: "/dev/pts/0", 1: "/dev/accel0.log"}, cmdline=b"tail\0-f\0")
    _fake_proc(proc, os.getpid(), {3: "/dev/accel0"}, cmdline=b"me\0")
    (proc / "105").mkdir()  # a process that ended while being read: no fd folder
    (proc / "self").mkdir()
    return proc


def test_holders_are_read_from_fd_links_by_pid(fake_proc):
    holders = environment.tpu_holders(dev_root="/dev", proc_root=str(fake_proc), lockfiles=("/tmp/libtpu_lockfile",))
    assert holders == [
        TpuHolder(101, "python train.py --steps 100", ("/dev/accel2", "/dev/accel10")),
        TpuHolder(102, "/usr/bin/python3 -m ipykernel_launcher -f /root/kernel-1.json", ("/dev/vfio/3",)),
        TpuHolder(103, "jax-worker", ("/tmp/libtpu_lockfile",)),
    ]  # not 104 (no TPU file), nor this process, nor the vanished 105
    assert [h.kernel for h in holders] == [False, True, False]
    assert holders[1].describe() == ("pid 102 (a notebook kernel): /usr/bin/python3 -m ipykernel_launcher -f "
                                     "/root/kernel-1.json, holding /dev/vfio/3")
    with pytest.raises(AttributeError):
        holders[0].pid = 1  # a frozen record
    assert environment.tpu_holders(proc_root=str(fake_proc / "missing")) == []


def test_a_busy_tpu_names_each_holder_and_how_to_free_it(fake_proc):
    roots = dict(dev_root="/dev", proc_root=str(fake_proc), lockfiles=("/tmp/libtpu_lockfile",))
    with pytest.raises(TpuBusyError) as err:
        environment.check_tpu_free({}, **roots)
    msg = str(err.value)
    assert "pid 101: python train.py --steps 100, holding /dev/accel2, /dev/accel10" in msg
    assert "pid 102 (a notebook kernel)" in msg and "Kernel > Shut Down Kernel" in msg
    assert "pid 103" not in msg  # torch_xla loads libtpu with ALLOW_MULTIPLE_LIBTPU_LOAD=1: the lock does not block
    assert "tpukit.environment.free_tpu(101)" in msg and "`kill 101 102`" in msg
    assert "tpukit.setup(device='cpu')" in msg
    with pytest.raises(TpuBusyError, match="pid 103: jax-worker, holding /tmp/libtpu_lockfile"):
        environment.check_tpu_free({"ALLOW_MULTIPLE_LIBTPU_LOAD": "0"}, **roots)
    # Chips split between processes (xmp.spawn's TPU_VISIBLE_CHIPS): only a holder of this process's chip blocks.
    with pytest.raises(TpuBusyError) as err:
        environment.check_tpu_free({"TPU_VISIBLE_CHIPS": "2"}, **roots)
    assert "pid 101: python train.py --steps 100, holding /dev/accel2\n" in str(err.value)
    assert "pid 102" not in str(err.value)
    assert environment.check_tpu_free({"TPU_VISIBLE_CHIPS": "5"}, **roots) is None


def test_a_real_process_holding_a_chip_is_found_by_its_pid(fake_dev, start):
    holder = start(fake_dev / "accel1", fake_dev / "vfio" / "0")
    bystander = start()
    found = {h.pid: h for h in environment.tpu_holders(dev_root=str(fake_dev))}
    assert bystander.pid not in found and os.getpid() not in found
    assert found[holder.pid].devices == (str(fake_dev / "accel1"), str(fake_dev / "vfio" / "0"))
    assert found[holder.pid].command.startswith(sys.executable + " -c import signal, sys, time chips = [open(path")


def test_setup_refuses_a_busy_tpu_before_torch_xla_starts(fake_dev, start):
    # The TPU is mocked (conftest.run_python's child sees the fake /dev as the machine's); the holder is real.
    holder = start(fake_dev / "accel0")
    code = ("import sys\n"
            "sys.modules.pop('google.colab', None)\n"
            "from tpukit import environment\n"
            f"environment.DEV_ROOT = {str(fake_dev)!r}\n"
            "import tpukit\n"
            "from tpukit.errors import TpuBusyError\n"
            "try:\n"
            "    tpukit.setup()\n"
            "except TpuBusyError as exc:\n"
            "    print(exc)\n"
            "from IPython.core.error import UsageError\n"
            "from IPython.core.interactiveshell import InteractiveShell\n"
            "shell = InteractiveShell.instance()\n"
            "shell.run_line_magic('load_ext', 'tpukit')\n"
            "try:\n"
            "    shell.run_line_magic('tpu', '')\n"
            "except UsageError as exc:  # %tpu shows the message alone, no traceback\n"
            "    print('%tpu says:', str(exc).splitlines()[0][:60])\n"
            "print('torch_xla imported:', 'torch_xla' in sys.modules)\n")
    out = run_python(code, drop=MACHINE_ENV_PREFIXES + ("PJRT_DEVICE",))
    assert out.returncode == 0, out.stderr
    assert f"pid {holder.pid}: {sys.executable} -c import signal" in out.stdout
    assert f"holding {fake_dev / 'accel0'}" in out.stdout
    assert f"free_tpu({holder.pid})" in out.stdout and f"`kill {holder.pid}`" in out.stdout
    assert "%tpu says: %tpu: This machine's TPU is held by another process" in out.stdout
    assert out.stdout.rstrip().endswith("torch_xla imported: False")  # refused before the runtime started
    assert holder.poll() is None  # and nothing was ended


def test_free_tpu_ends_only_a_process_that_holds_the_tpu(fake_dev, start):
    holder, bystander = start(fake_dev / "accel0"), start()
    with pytest.raises(ValueError, match=f"process {bystander.pid} does not hold this machine's TPU .*nothing was "
                                         f"ended. The processes holding it now: pid {holder.pid}: "):
        environment.free_tpu(bystander.pid, dev_root=str(fake_dev))
    assert bystander.poll() is None and holder.poll() is None
    freed = environment.free_tpu(holder.pid, dev_root=str(fake_dev))
    assert freed.pid == holder.pid and freed.devices == (str(fake_dev / "accel0"),)
    assert holder.wait(timeout=30) == -signal.SIGTERM
    assert bystander.poll() is None
    assert environment.tpu_holders(dev_root=str(fake_dev)) == []


def test_free_tpu_kills_a_holder_that_ignores_sigterm(fake_dev, start):
    stubborn = start(fake_dev / "accel0", extra="signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    environment.free_tpu(stubborn.pid, timeout=0.3, dev_root=str(fake_dev))
    assert stubborn.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.parametrize("pid,match", [
    (0, "must be a process id"), ("123", "must be a process id"), (True, "must be a process id"),
    (os.getpid(), "this process itself: restart the kernel"),
])
def test_free_tpu_refuses_bad_pids(pid, match, fake_dev):
    with pytest.raises(ValueError, match=match):
        environment.free_tpu(pid, dev_root=str(fake_dev))


def test_free_tpu_of_a_process_that_is_gone(fake_dev):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with pytest.raises(ValueError, match="no such process"):
        environment.free_tpu(int(done.stdout), dev_root=str(fake_dev))


@pytest.mark.parametrize("variable,where,how", [
    ("COLAB_RELEASE_TAG", "This Colab runtime", "Runtime > Change runtime type > TPU v5e-1, then run the notebook again"),
    ("KAGGLE_KERNEL_RUN_TYPE", "This Kaggle session", "Settings > Accelerator > TPU v5e-8, with Settings > Internet on"),
])
def test_a_notebook_runtime_without_tpu_says_how_to_switch(variable, where, how, rt, no_tpu_machine, monkeypatch):
    # Colab's or Kaggle's environment variable is mocked on a machine mocked to have no TPU
    # (conftest.no_tpu_machine); setup() runs afresh in this process's running XLA:CPU runtime.
    monkeypatch.setenv(variable, "1")
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(runtime, "_WARNED", set())
    monkeypatch.setattr(runtime, "_STATE", None)
    with pytest.warns(tpukit.TpukitWarning, match=f"{where} has no TPU"):
        auto = tpukit.setup()
    assert auto.device_type == "CPU"  # XLA:CPU still works: a problem in the report, not an error
    (problem,) = auto.problems
    assert problem.startswith(f"{where} has no TPU, so tpukit runs on XLA:CPU") and how in problem
    assert f"problem: {problem}" in auto.report() and "no problems found" not in auto.report()
    monkeypatch.setattr(runtime, "_STATE", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tpukit.setup(device="cpu").problems == ()  # the CPU on purpose: nothing to say
    monkeypatch.setattr(runtime, "_STATE", None)
    with pytest.raises(tpukit.DeviceNotFoundError, match=how.split(",")[0]):
        tpukit.setup(device="tpu")


def test_gspmd_notice_is_dropped_and_other_warnings_stay():
    # A small SPMD sharding over 4 virtual XLA:CPU devices (fixed when the runtime starts: a fresh process).
    code = ("{patch}import os, warnings\n"
            "import numpy as np, torch, tpukit\n"
            "rt = tpukit.setup(device='cpu', cpu_devices=4, spmd=True)\n"
            "import torch_xla, torch_xla.distributed.spmd as xs\n"
            "mesh = xs.Mesh(np.arange(4), (4,), ('data',))\n"
            "for n in (4, 5):\n"
            "    x = torch.ones(8, n).to(torch_xla.device())\n"
            "    xs.mark_sharding(x, mesh, ('data', None))\n"
            "    print((x * 2).sum().item())\n"
            "warnings.warn('a Python warning stays')\n"
            "os.write(2, b'W external/xla/xla/other.cc:1] a C++ warning stays\\n')\n")
    out = run_python(code.format(patch=""))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["64.0", "80.0"]
    assert runtime.GSPMD_NOTICE not in out.stderr
    assert "UserWarning: a Python warning stays" in out.stderr and "] a C++ warning stays\n" in out.stderr
    # Without the filter the same run shows XLA's notice once per SPMD compile: the line the filter drops.
    unfiltered = run_python(code.format(patch="from tpukit import _stderr\n"
                                              "_stderr.filter_stderr = lambda *markers: False\n"))
    assert unfiltered.returncode == 0, unfiltered.stderr
    from importlib.metadata import version

    if version("torch_xla").startswith("2.8"):  # 2.8 does not print the notice at all (Kaggle's stack)
        assert unfiltered.stderr.count(runtime.GSPMD_NOTICE) == 0
    else:
        assert unfiltered.stderr.count(runtime.GSPMD_NOTICE) >= 2


def test_stderr_filter_passes_everything_else_even_from_a_crash():
    code = ("import os, time\n"
            "from tpukit import _stderr\n"
            "assert _stderr.filter_stderr('NOISE') and _stderr.filter_stderr('NOISE')\n"
            "assert not _stderr.filter_stderr('OTHER')  # once per process\n"
            "os.write(2, b'keep 1\\nNOISE dropped\\n')\n"
            "os.write(2, b'x NOI'); os.write(2, b'SE split across writes, dropped\\n')\n"
            "os.write(2, b'progress 50%\\r'); time.sleep(0.2); os.write(2, b'progress 100%\\r\\n')\n"
            "os.write(2, b'last words, no newline'); os.abort()\n")
    out = run_python(code, drop=("PYTHONFAULTHANDLER",))  # the test lanes' faulthandler would add its dump
    assert out.returncode == -signal.SIGABRT
    assert out.stderr == "keep 1\nprogress 50%\nprogress 100%\nlast words, no newline"  # read as text: \r is \n


def test_stderr_filter_leaves_a_terminal_alone():
    master, slave = os.openpty()
    try:
        out = subprocess.run([sys.executable, "-c", "from tpukit import _stderr\n"
                              "print(_stderr.filter_stderr('NOISE'))"], stderr=slave,
                             stdout=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(master)
        os.close(slave)
    assert out.stdout.strip() == "False"
