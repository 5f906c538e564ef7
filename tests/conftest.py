"""Test session set-up: everything runs on XLA:CPU.

Compile tracing must be configured before torch_xla is imported, so it is done
here, at collection time, without starting the runtime. Tests that need other
runtime settings (virtual devices, SPMD, tracing off) run in subprocesses.
"""

import os
import subprocess
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("TPUKIT_DASHBOARD", "text")

from tpukit import runtime  # noqa: E402  (imports no torch_xla)

runtime.configure(runtime.Request(device="cpu"))

import pytest  # noqa: E402


def run_python(code: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this environment (a new XLA runtime)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_XLA_DEBUG", "CPU_NUM_DEVICES", "XLA_USE_SPMD"))}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout)


@pytest.fixture(scope="session")
def rt():
    """The in-process runtime (single XLA:CPU device, compile tracing on)."""
    import tpukit

    return tpukit.setup(device="cpu")
