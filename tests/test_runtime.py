"""Device setup, diagnostics and the doctor CLI (issue: foundation)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest

import tpukit
from tpukit import environment, runtime
from conftest import MACHINE_ENV_PREFIXES, NO_TPU_MACHINE, run_python

ROOT = Path(__file__).resolve().parents[1]


def test_setup_report_fields(rt):
    assert rt.platform == environment.detect_platform()  # a TPU VM says "tpu-vm" here; see the next test
    assert rt.tpu_signals == environment.tpu_signals()
    assert rt.device_type == "CPU"
    assert rt.device.startswith("xla")
    assert rt.device_count >= 1
    assert rt.process_count == 1 and rt.world_size == 1
    assert rt.spmd is False
    assert rt.versions["torch"] == metadata.version("torch")
    assert rt.versions["torch_xla"] == metadata.version("torch_xla")
    assert rt.versions["tpukit"] == tpukit.__version__
    assert rt.trace_file and os.path.exists(rt.trace_file)
    assert rt.compile_cache is None
    text = rt.report()
    assert "platform" in text and "CPU" in text and "compile tracing" in text
    html = rt._repr_html_()
    assert html.startswith("<table") and "torch_xla" in html
    assert repr(rt).startswith(f"Runtime({rt.platform}: {rt.device_count} x CPU")
    assert json.loads(json.dumps(rt.to_dict(), default=str))["device_type"] == "CPU"


def test_setup_on_a_machine_without_tpu_reports_local_cpu(rt, no_tpu_machine, monkeypatch):
    # The machine is mocked (conftest.no_tpu_machine): a TPU cannot exist here, and on a TPU VM
    # this still checks what setup() says on a local machine. A fresh setup() in the running runtime:
    monkeypatch.setattr(runtime, "_STATE", None)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    local = tpukit.setup()
    assert (local.platform, local.tpu_signals, local.device_type, local.problems) == ("local", (), "CPU", ())
    assert local.accelerator_type is None and local.bf16 is False


def test_setup_is_idempotent(rt):
    assert tpukit.setup(device="cpu") is rt
    assert tpukit.setup() is rt
    assert runtime.current() is rt


def test_settings_after_start_are_reported_not_dropped(rt):
    later = tpukit.setup(device="cpu", cpu_devices=4, spmd=True)
    assert later is not rt
    joined = " ".join(later.problems)
    assert "cpu_devices=4" in joined and "spmd=True" in joined
    assert "Restart the kernel" in joined
    assert runtime.current() is rt  # the running runtime itself did not change


def test_compile_cache_on_cpu_is_refused_with_reason(tmp_path):
    out = run_python(
        "import tpukit; rt = tpukit.setup(device='cpu', compile_cache=%r); print('|'.join(rt.problems)); print(rt.compile_cache)"
        % str(tmp_path / "cache"), env={"PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stderr
    problems, cache = out.stdout.strip().splitlines()[-2:]
    assert "cannot read them back" in problems
    assert cache == "None"


def test_cpu_devices_gives_that_many_devices():
    out = run_python("import tpukit; rt = tpukit.setup(device='cpu', cpu_devices=4); print(rt.device_count, rt.problems)",
                     env={"PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "4 ()"


def test_setup_after_runtime_started_elsewhere_reports_what_was_lost():
    code = ("import torch, torch_xla\n"
            "x = torch.ones(2, device=torch_xla.device()) + 1\n"
            "import tpukit\n"
            "rt = tpukit.setup(device='cpu', cpu_devices=4, spmd=True)\n"
            "print(rt.trace_file)\n"
            "print('\\n'.join(rt.problems))\n")
    out = run_python(code, env={"PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "Compile causes are unavailable" in text
    assert "spmd=True could not be applied" in text
    assert "cpu_devices=4 was requested" in text


def test_version_mismatch_is_caught_before_import(monkeypatch):
    # Simulated: the installed pair matches, so the version lookup is patched.
    monkeypatch.setattr(environment, "versions",
                        lambda: {"python": "3.11", "torch": "2.9.0+cu128", "torch_xla": "2.8.1", "libtpu": None})
    with pytest.raises(tpukit.VersionMismatchError) as err:
        runtime.check_installation()
    msg = str(err.value)
    assert "torch 2.9.0+cu128" in msg and "torch_xla 2.8.1" in msg
    assert "pip install torch==2.8.1 torch_xla==2.8.1" in msg


def test_missing_torch_xla_gives_install_command(monkeypatch, no_tpu_machine):
    # Simulated: torch_xla is installed here, so the version lookup is patched; the machine is
    # mocked as local (the command differs on Colab, Kaggle and TPU VMs).
    monkeypatch.setattr(environment, "versions",
                        lambda: {"python": "3.11", "torch": "2.9.0", "torch_xla": None, "libtpu": None})
    monkeypatch.setattr(runtime, "_STATE", None)
    with pytest.raises(tpukit.TorchXlaMissingError) as err:
        tpukit.setup()
    assert "pip install torch==2.9.0 'torch_xla==2.9.0'" in str(err.value)


def test_tpu_requested_without_tpu(monkeypatch, no_tpu_machine):
    # The machine is mocked (conftest.no_tpu_machine): a TPU cannot exist here, and on a TPU VM
    # the test must not find the real one.
    monkeypatch.setattr(runtime, "_STATE", None)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    with pytest.raises(tpukit.DeviceNotFoundError) as err:
        tpukit.setup(device="tpu")
    assert "no TPU is attached" in str(err.value) and "device='cpu'" in str(err.value)


def test_bad_arguments():
    with pytest.raises(ValueError, match="not one of"):
        tpukit.setup(device="gpu")
    with pytest.raises(ValueError, match="positive int"):
        tpukit.setup(cpu_devices=0)


@pytest.mark.parametrize("env,expected", [
    ({"COLAB_RELEASE_TAG": "release-colab_20261101"}, "colab"),   # Colab's variables, simulated
    ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, "kaggle"),         # Kaggle's variables, simulated
    ({"TPU_ACCELERATOR_TYPE": "v5litepod-8"}, "tpu-vm"),           # a TPU VM's variables, simulated
    ({}, "local"),
])
def test_platform_detection(env, expected, no_tpu_machine):  # the machine itself mocked as local
    assert environment.detect_platform(env) == expected


def test_tpu_signals_and_install_commands(no_tpu_machine, monkeypatch):
    # The machine is mocked (conftest.no_tpu_machine): tpu_signals() reads /dev and /sys whatever
    # its argument, so without the mock this would fail on a TPU VM, the product's target.
    assert environment.tpu_signals({"TPU_ACCELERATOR_TYPE": "v4-8"})[0] == "TPU_ACCELERATOR_TYPE=v4-8"
    assert environment.tpu_signals({}) == ()
    monkeypatch.setattr(environment, "_tpu_devices", lambda: [f"/dev/accel{i}" for i in range(8)])  # a v4-8 host, mocked
    assert environment.tpu_signals({}) == ("TPU device files: /dev/accel0, /dev/accel1, /dev/accel2, /dev/accel3 ...",)
    assert environment.detect_platform({}) == "tpu-vm"
    assert "do not reinstall torch" in environment.install_command("colab", "2.8.0+cu126")
    assert environment.install_command("tpu-vm") == "pip install torch==2.9.0 'torch_xla[tpu]==2.9.0'"


def test_doctor_text_and_json():
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    text = subprocess.run([sys.executable, "-m", "tpukit", "doctor"], capture_output=True, text=True, env=env)
    assert text.returncode == 0, text.stderr
    assert "tpukit runtime" in text.stdout and "torch_xla" in text.stdout
    js = subprocess.run([sys.executable, "-m", "tpukit", "doctor", "--json"], capture_output=True, text=True, env=env)
    assert js.returncode == 0, js.stderr
    data = json.loads(js.stdout)
    assert data["ok"] is True and data["device_type"] == "CPU" and data["device_count"] >= 1


def test_doctor_exits_nonzero_on_blocking_problem():
    # `python -m tpukit doctor --device tpu` on a machine mocked to have no TPU (a TPU cannot
    # exist here; on a TPU VM the real one must not be found): the child runs the same
    # module as -m does, after conftest.NO_TPU_MACHINE, without PJRT_DEVICE or platform variables.
    code = NO_TPU_MACHINE + ("import runpy\n"
                             "sys.argv = ['tpukit', 'doctor', '--json', '--device', 'tpu']\n"
                             "runpy.run_module('tpukit', run_name='__main__', alter_sys=True)\n")
    js = run_python(code, drop=MACHINE_ENV_PREFIXES + ("PJRT_DEVICE",))
    assert js.returncode == 1, js.stderr
    data = json.loads(js.stdout)
    assert data["ok"] is False and data["error_type"] == "DeviceNotFoundError"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_lab_starts_jupyterlab():
    port = _free_port()
    proc = subprocess.Popen(["make", "-s", "lab", f"PORT={port}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        status = None
        while time.time() < deadline and status is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api", timeout=2) as r:
                    status = r.status
                    body = json.loads(r.read())
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(1)
        assert status == 200 and "version" in body
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
    out = proc.stdout.read()
    assert f"http://127.0.0.1:{port}/lab" in out


def test_badges_are_rewritten_from_the_one_repository_url(tmp_path):
    from tpukit.__main__ import badges, repository_url

    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": [
        "# Demo\n", "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        "(https://colab.research.google.com/github/old/place/blob/main/notebooks/demo.ipynb)\n"]}],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "demo.ipynb"
    path.write_text(json.dumps(nb))
    assert badges(tmp_path, "https://github.com/someone/tpukit") == [path]
    text = path.read_text()
    assert "https://colab.research.google.com/github/someone/tpukit/blob/main/notebooks/demo.ipynb" in text
    assert badges(tmp_path, "https://github.com/someone/tpukit") == []  # idempotent
    assert repository_url().startswith("https://github.com/")


def test_a_child_process_does_not_write_into_its_parents_trace_file(rt):
    # The notebook kernel's tracing variables are inherited by processes it starts.
    parent = rt.trace_file
    out = run_python("import tpukit; print(tpukit.setup(device='cpu').trace_file)",
                     env={"PJRT_DEVICE": "CPU", "PT_XLA_DEBUG_LEVEL": "1", "PT_XLA_DEBUG_FILE": parent})
    assert out.returncode == 0, out.stderr
    child = out.stdout.strip().splitlines()[-1]
    assert child != parent and child.endswith(".log")


def test_scale_note_says_what_one_or_many_devices_can_do():
    """%tpu's multi-core row: a single chip (Colab v5e-1) vs several devices (records built by hand)."""
    import dataclasses

    from tpukit.runtime import Runtime

    base = Runtime(platform="colab", device_type="TPU", accelerator_type="v5litepod-1", device="xla:0",
                   device_count=1, process_count=1, world_size=1, spmd=False, versions={},
                   compile_cache=None, trace_file=None)
    assert "one device" in base.scale_note() and "v5e-8 (Kaggle's TPU)" in base.scale_note()
    assert "v3-8" not in base.scale_note()  # Kaggle's TPU is a v5e-8 now
    cpu = dataclasses.replace(base, device_type="CPU")
    assert "cpu_devices=4" in cpu.scale_note()
    eight = dataclasses.replace(base, device_count=8, spmd=True)
    assert eight.scale_note().startswith("8 devices") and "multiple of 8" in eight.scale_note()
    assert "turn SPMD on" in dataclasses.replace(eight, spmd=False).scale_note()
    assert ("multi-core", base.scale_note()) in base.rows()


def test_compile_cache_plan_is_keyed_and_on_only_for_a_tpu(monkeypatch, tmp_path):
    """The cache plan (the TPU is mocked: kind='TPU' and its environment; a TPU cannot exist here)."""
    from tpukit import cache
    from tpukit.environment import Environment

    env = Environment(platform="colab", tpu_signals=("TPU_ACCELERATOR_TYPE=v5litepod-1",), pjrt_device=None,
                      versions={"torch_xla": "2.9.0", "libtpu": "0.0.21.1"})
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    on = cache.plan("TPU", None, env, started=False)
    assert on.path == str(tmp_path / "torch_xla-2.9.0_libtpu-0.0.21.1_v5litepod-1") and on.note.startswith("on: ")
    newer = Environment(env.platform, env.tpu_signals, None, {"torch_xla": "2.10.0", "libtpu": "0.0.22"})
    assert cache.plan("TPU", None, newer, started=False).path != on.path  # another version never reads it
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    assert cache.plan("TPU", None, env, started=False).path != on.path  # nor another topology
    assert cache.plan("TPU", str(tmp_path / "drive"), env, started=False).path.startswith(str(tmp_path / "drive"))
    assert cache.plan("TPU", False, env, started=False).path is None
    late = cache.plan("TPU", None, env, started=True)
    assert late.path is None and "restart the kernel" in late.note
    cpu = cache.plan("CPU", None, env, started=False)
    assert cpu.path is None and "cannot read them back" in cpu.note


def test_cpu_runtime_reports_why_the_cache_is_off(rt):
    rows = dict(rt.rows())
    assert rt.compile_cache is None and "off on XLA:CPU" in rows["compile cache"]
    from tpukit import cache

    assert str(cache.stats()) == "0 hit(s), 0 miss(es)"
