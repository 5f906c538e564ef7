"""Helper for tests/test_magics.py: an IPython session in a fresh process, as JSON.

Usage: python magics_session.py EXTENSION fresh|late

fresh: load the extension before torch_xla is imported (compile tracing on).
late:  import torch_xla first, then load the extension (tracing off).
Prints one JSON object: per cell its number, captured output and error type.
"""

import contextlib
import io
import json
import os
import sys
import tempfile
import types

EXT, MODE = sys.argv[1], sys.argv[2]
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ["IPYTHONDIR"] = tempfile.mkdtemp(prefix="tpukit-ipython-")

report = {}
import tpukit.magics  # noqa: E402,F401

report["imported_ipython"] = "IPython" in sys.modules
report["imported_torch_xla"] = "torch_xla" in sys.modules
if MODE == "late":
    import torch_xla  # noqa: F401

from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from traitlets.config import Config  # noqa: E402

config = Config()
config.HistoryManager.hist_file = ":memory:"
shell = InteractiveShell.instance(config=config, user_module=types.ModuleType("notebook"))
cells = []


def run(source):
    out = io.StringIO()
    number = shell.execution_count
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        result = shell.run_cell(source, store_history=True)
    err = result.error_in_exec or result.error_before_exec
    cells.append({"n": number, "source": source, "out": out.getvalue(),
                  "error": type(err).__name__ if err else None})


run(f"%load_ext {EXT}")
run("import torch, torch_xla\ndev = torch_xla.device()")
if MODE == "fresh":
    run("%%xla\nx = torch.ones(5, 3, device=dev)\ny = (x * 2).sum()")
    run("%%xla\nfor n in (3, 4, 5):\n    v = torch.ones(n, device=dev).sum().item()")
    run("%xla_watch on")
    run("z = torch.ones(11, device=dev).sum().item()")
    run("z = torch.ones(11, device=dev).sum().item()")
    run("%%xla --max-compiles 0\nfor n in (3, 4, 5):\n    v = torch.ones(n, device=dev).sum().item()")
else:
    run("%%xla\ny = torch.ones(4, device=dev) * 2")
    run("%xla_watch on")
    run("v = torch.ones(12, device=dev).sum().item()")

from tpukit import compiles  # noqa: E402

report["tracing"] = compiles.tracing_enabled()
report["cells"] = cells
print("\n" + json.dumps(report))
