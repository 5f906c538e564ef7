"""Cell attribution through a real Jupyter kernel (jupyter_client + ipykernel), not only
``InteractiveShell``: ipykernel >= 6 compiles cells from files named
``/tmp/ipykernel_<pid>/<hash>.py``, which IPython >= 8 maps to cell numbers and IPython
7.34 (Colab's pairing with ipykernel 6) does not. Run in both environments: ``make test``
(IPython 9 + ipykernel 7) and ``make test-colab`` (IPython 7.34 + ipykernel 6.17).
"""

import json
import os
import re
import time

import pytest
from jupyter_client import manager
from conftest import CPU_XLA_FLAGS

SETUP = "import tpukit\nrt = tpukit.setup(device='cpu')\nimport torch\ndevice = rt.device"
LOOP = """\
w = torch.randn(16, 4, device=device)
batches = [{"input_ids": torch.randint(0, 16, (8, n)).float()} for n in (16, 16, 16, 24)]
tr = tpukit.track(batches, progress=False)
for b in tr:
    out = (b["input_ids"] @ torch.ones(b["input_ids"].shape[1], 16, device=device) @ w).sum()
"""
REPORT = """\
import json
alarms = [e for r in tr.history for e in r.recompilations]
print("REPORT " + json.dumps({"where": [e.where for e in alarms], "evidence": [list(e.evidence) for e in alarms]}))
"""
GUARDED = """\
tr2 = tpukit.track([{"input_ids": torch.randint(0, 16, (8, n)).float()} for n in (8, 8, 8, 40)], progress=False, guard=tpukit.no_recompile_after(2))
for b in tr2:
    out = (b["input_ids"] @ torch.ones(b["input_ids"].shape[1], 16, device=device) @ w).sum()
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_XLA_DEBUG", "XLA_FLAGS", "CPU_NUM_DEVICES"))}
    env.update(PJRT_DEVICE="CPU", TPUKIT_DASHBOARD="text")
    if CPU_XLA_FLAGS:
        env["XLA_FLAGS"] = CPU_XLA_FLAGS
    return env


@pytest.fixture(scope="module")
def kernel():
    km, kc = manager.start_new_kernel(kernel_name="python3", env=_env())
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def run(kc, code: str) -> tuple[dict, str]:
    msgs: list = []
    reply = kc.execute_interactive(code, timeout=240, output_hook=msgs.append)
    for _ in range(3):  # a request that reached ipykernel within its abort window after a cell's error was
        if reply["content"]["status"] != "aborted":  # dropped unrun (stop_on_error): send it again
            break
        time.sleep(0.5)
        msgs.clear()
        reply = kc.execute_interactive(code, timeout=240, output_hook=msgs.append)
    out = "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream" and m["content"]["name"] == "stdout")
    return reply["content"], out


def test_recompilation_in_a_real_kernel_names_cell_and_line(kernel):
    reply, _ = run(kernel, SETUP)
    assert reply["status"] == "ok", reply
    reply, _ = run(kernel, LOOP)
    assert reply["status"] == "ok", reply
    loop_cell = reply["execution_count"]
    reply, out = run(kernel, REPORT)
    assert reply["status"] == "ok", reply
    report = json.loads(out.split("REPORT ", 1)[1])
    # The loop's 4th line (`for b in tr:`) is where track syncs each step.
    assert report["where"] == [f"cell [{loop_cell}] line 4"], (report, loop_cell)
    assert "input_ids: (8, 16) -> (8, 24)" in report["evidence"][0]

    reply, _ = run(kernel, GUARDED)
    guarded_cell = reply["execution_count"]
    assert reply["status"] == "error" and reply["ename"] == "RecompilationError", reply
    assert f"cell [{guarded_cell}] line 2" in reply["evalue"], reply["evalue"]
    assert "input_ids: (8, 8) -> (8, 40)" in reply["evalue"], reply["evalue"]


def test_kernel_versions_are_reported(kernel):
    """Says which IPython/ipykernel pairing the test above ran on (both environments run it)."""
    reply, out = run(kernel, "import IPython, ipykernel; print('VERSIONS', IPython.__version__, ipykernel.__version__)")
    assert reply["status"] == "ok"
    ipython, ipykernel = out.split("VERSIONS ", 1)[1].split()
    assert int(ipython.split(".")[0]) >= 7 and int(ipykernel.split(".")[0]) >= 6


MAGICS = "%load_ext tpukit\nimport torch_xla"


def test_explain_shows_the_users_frames_and_counts_the_kernels(kernel):
    """Issue 44: %%xla --explain printed torch_xla's frames as they are, about 30 of ipykernel, asyncio and
    tornado under the cell's two; now the cell's frames, then how many library frames were left out and whose."""
    for code in (SETUP, MAGICS):
        assert run(kernel, code)[0]["status"] == "ok"
    reply, out = run(kernel, "%%xla --explain\nex44 = (torch.ones(7, 3, device=device) * 3).sum().item()")
    assert reply["status"] == "ok", reply
    cell = reply["execution_count"]
    explained = out.split("%%xla --explain: ", 1)[1].splitlines()
    frames = explained[explained.index("   Python Frame Triggered Execution:") + 1:]
    # The cell's code is '<module>' (IPython 8+) or '<cell line: 0>' (IPython 7, Colab's, on Python 3.11+).
    cells = [re.fullmatch(rf"     <(?:module|cell line: \d+)> \(cell \[{cell}\] line (\d)\)", f) for f in frames[:2]]
    assert all(cells) and [m[1] for m in cells] == ["2", "1"], explained
    hidden = re.fullmatch(r"     \((\d+) library frames left out: (.*)\)", frames[2])
    assert hidden and int(hidden[1]) >= 10 and {"IPython", "ipykernel", "tpukit"} <= set(hidden[2].split(", ")), frames
    assert len(frames) == 3 and "site-packages" not in out, explained


def test_a_training_cell_rerun_after_its_batch_changed_names_the_shape(kernel):
    """Issue 44: a %%xla training step (Adam) re-run after its batch was made again, with more rows, in another
    cell: a new graph (Adam's state is an input now) whose evidence said only "+4 inputs", not the batch's shape."""
    for code in (SETUP, MAGICS, "model44 = torch.nn.Linear(13, 3).to(device)\n"
                                "opt44 = torch.optim.Adam(model44.parameters())\n"
                                "x44 = torch.randn(7, 13, device=device)"):
        assert run(kernel, code)[0]["status"] == "ok"
    step = "%%xla\nloss44 = model44(x44).sum()\nloss44.backward()\nopt44.step()\nopt44.zero_grad()"
    first = run(kernel, step)
    assert run(kernel, "x44 = torch.randn(11, 13, device=device)")[0]["status"] == "ok"
    second = run(kernel, step)
    assert first[0]["status"] == second[0]["status"] == "ok", (first, second)
    line = next(ln for ln in second[1].splitlines() if "(the sync %%xla adds)" in ln)
    assert line.startswith("  new graph: ") and "is an input now: expected once" in line, line
    assert re.search(r"input \d+ \(x44, from another cell\): f32\[7,13\] -> f32\[11,13\]", line), line
