"""Test session set-up: everything runs on XLA:CPU.

Compile tracing must be configured before torch_xla is imported, so it is done
here, at collection time, without starting the runtime. Tests that need other
runtime settings (virtual devices, SPMD, tracing off) run in subprocesses.
"""

import ast
import functools
import os
import signal
import subprocess
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("TPUKIT_DASHBOARD", "text")

# The XLA flags the session started with (the Makefile's test targets set XLA:CPU's code generation to
# LLVM's lowest optimization level: a tiny BERT's training graph compiles in 5 s instead of 18 s, and runs
# 2.3x slower, the right trade for tests that take a few steps of many graphs; the HLO, the compile events
# and the TPU compiler's answers are the same). Read before torch_xla or tpukit add theirs, and given to
# the fresh interpreters tests start, which drop the rest of this process's XLA_FLAGS (its HLO dump).
CPU_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")

# Started as a background job of a script (as CI's lanes are), this process inherits SIGINT ignored, and
# so would every process it starts: a Ctrl-C would do nothing, and the tests that press it (the launcher's,
# the slice runner's) would wait for ever. Deliver it the way a terminal or a notebook kernel does.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from tpukit import runtime  # noqa: E402  (imports no torch_xla)

runtime.configure(runtime.Request(device="cpu"))

import pytest  # noqa: E402

# The scripts tests run in subprocesses (and import helpers from) live in tests/scenarios/.
SCENARIOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenarios")
sys.path.insert(0, SCENARIOS)


def run_python(code: str, env: dict | None = None, timeout: float = 300,
               drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter of this environment (a new XLA runtime).

    ``drop``: prefixes of further environment variables the child must not inherit.
    """
    dropped = ("PT_XLA_DEBUG", "CPU_NUM_DEVICES", "XLA_USE_SPMD", "XLA_FLAGS") + tuple(drop)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    if CPU_XLA_FLAGS:
        full_env["XLA_FLAGS"] = CPU_XLA_FLAGS
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


# Lanes. Each test is marked by what it uses, read from its source (and the source of the module-level
# helpers and fixtures it calls, transitively), so that a new test lands in the right lane without anyone
# remembering to mark it. `make test-fast` deselects these; `make test` runs everything.
LANES = {
    # a fresh interpreter (a new XLA runtime: 5-10 s of imports on two busy cores), or the launcher's children
    "subprocess": ("run_python", "subprocess.run", "subprocess.Popen", "subprocess.check_output",
                   "subprocess.call", "subprocess.check_call", "launcher.launch", "tpukit.launch"),
    # libtpu's TPU compiler in its worker process (seconds to minutes per compile), a compiler's environment
    # (a download), or the dashboard's follower (it compiles each graph for the target): what starts them, not
    # every name of tpukit.tpu (its tables, caches and parsers run in microseconds)
    "compiler": ("estimate", "largest_batch", "compile_graph*", "compare", "worker.*", "follow", "follower",
                 "envs.python", "envs.newest", "tpu.check", "explain", "target=v*"),
    # a local multi-node Ray cluster
    "cluster": ("LocalSlice", "run_on_slice", "ray.init"),
    # a real Jupyter kernel (jupyter_client + ipykernel)
    "kernel": ("start_new_kernel", "KernelManager", "NotebookClient"),
    # a Hugging Face Trainer run, a transformers model, or one of the guide's training loops
    # (tests/scenarios/diag_loops.py): each compiles hundreds to thousands of ops on XLA:CPU
    "slow": ("Trainer", "from_pretrained", "Bert*", "GPT2*", "loops.*"),
}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _uses(call: ast.Call) -> set[str]:
    """What one call uses, in the terms LANES names: its dotted name and any ``target="v..."`` keyword."""
    name = _dotted(call.func)
    uses = {name} if name else set()
    for kw in call.keywords:
        if kw.arg == "target" and isinstance(kw.value, ast.Constant) and str(kw.value.value).startswith("v"):
            uses.add("target=v*")
    return uses


def _matches(name: str, pattern: str) -> bool:
    """``tpu.*``: a name under that prefix; ``Bert*``: a name whose last part starts so; else the name or
    its last part."""
    if pattern.endswith(".*"):
        return name.startswith(pattern[:-1])
    if pattern.endswith("*"):
        return name.rsplit(".", 1)[-1].startswith(pattern[:-1])
    return name == pattern or name.endswith("." + pattern)


@functools.cache
def _module_functions(path: str) -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """Each module-level function of a test file: (what its body uses, the names it calls)."""
    tree = ast.parse(open(path).read(), path)
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            uses, calls = set(), set()
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call):
                    uses |= _uses(sub)
                    if isinstance(sub.func, ast.Name):
                        calls.add(sub.func.id)
                elif isinstance(sub, ast.Name):  # a helper passed as a value (launch(_touch, ...), map(f, ...))
                    calls.add(sub.id)
            out[node.name] = (frozenset(uses), frozenset(calls))
    return out


def _lanes_of(paths: tuple[str, ...], roots: tuple[str, ...]) -> set[str]:
    """The lanes reached from ``roots`` (the test and its fixtures) through the functions of ``paths``."""
    functions = {}
    for path in paths:  # the test's module wins over conftest
        functions = {**_module_functions(path), **functions}
    seen, todo, used = set(), list(roots), set()
    while todo:
        name = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        uses, calls = functions[name]
        used |= uses
        todo.extend(calls)
    return {lane for lane, patterns in LANES.items() if any(_matches(u, p) for u in used for p in patterns)}


def pytest_collection_modifyitems(config, items):
    conftest = os.path.abspath(__file__)
    for item in items:
        if not isinstance(item, pytest.Function) or not str(item.fspath).endswith(".py"):
            continue
        if item.get_closest_marker("light"):  # names a heavy entry point but is refused before reaching it
            continue
        roots = (item.originalname, *item.fixturenames)
        for lane in sorted(_lanes_of((str(item.fspath), conftest), roots)):
            item.add_marker(lane)
