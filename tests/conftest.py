"""Test session set-up: everything runs on XLA:CPU.

Compile tracing must be configured before torch_xla is imported, so it is done
here, at collection time, without starting the runtime. Tests that need other
runtime settings (virtual devices, SPMD, tracing off) run in subprocesses.
"""

import os
import signal
import subprocess
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("TPUKIT_DASHBOARD", "text")

# Started as a background job of a script (as CI's lanes are), this process inherits SIGINT ignored, and
# so would every process it starts: a Ctrl-C would do nothing, and the tests that press it (the launcher's,
# the slice runner's) would wait for ever. Deliver it the way a terminal or a notebook kernel does.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from tpukit import runtime  # noqa: E402  (imports no torch_xla)

runtime.configure(runtime.Request(device="cpu"))

import pytest  # noqa: E402


def run_python(code: str, env: dict | None = None, timeout: float = 300,
               drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this environment (a new XLA runtime).

    ``drop``: prefixes of further environment variables the child must not inherit.
    """
    dropped = ("PT_XLA_DEBUG", "CPU_NUM_DEVICES", "XLA_USE_SPMD", "XLA_FLAGS") + tuple(drop)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout)


@pytest.fixture(scope="session")
def rt():
    """The in-process runtime (single XLA:CPU device, compile tracing on)."""
    import tpukit

    return tpukit.setup(device="cpu")


# The machine facts tpukit.environment reads: platform variables, /dev/accel* and /dev/vfio
# device files, Google PCI devices under /sys, and the google.colab module. Tests about a
# machine *without* a TPU mock them (a TPU cannot exist here, but the product's target is a
# TPU VM), so they assert the same things on any machine.
MACHINE_ENV_PREFIXES = ("TPU_", "COLAB_", "KAGGLE_")
NO_TPU_MACHINE = (  # the same mock as no_tpu_machine, as the first lines of a child process's code
    "import sys\n"
    "sys.modules.pop('google.colab', None)\n"
    "from tpukit import environment as _environment\n"
    "_environment._tpu_devices = lambda: []\n"
    "_environment._google_pci_devices = lambda: []\n"
)


@pytest.fixture
def no_tpu_machine(monkeypatch):
    """Make tpukit.environment see a local machine without a TPU, whatever machine runs the test."""
    from tpukit import environment

    for key in list(os.environ):
        if key.startswith(MACHINE_ENV_PREFIXES):
            monkeypatch.delenv(key)
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.setattr(environment, "_tpu_devices", lambda: [])
    monkeypatch.setattr(environment, "_google_pci_devices", lambda: [])
    # If environment.py starts reading another machine fact, this says so on a TPU VM.
    assert environment.detect_platform() == "local" and environment.tpu_signals() == (), \
        "no_tpu_machine misses a machine fact tpukit/environment.py reads: mock it here too"
    return environment


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Each test starts and ends with no listeners and no logged values left by another test."""
    from tpukit import events, steps

    yield
    events._reset()
    steps._reset()
