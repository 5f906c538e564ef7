"""tpukit.parallel.remote: what tpukit.launch and tpukit.run_on_slice share (the message type, the fd-level
capture, the ``[rank N]`` / ``[host N]`` prefixing, traceback trimming, record forwarding).

Where a process boundary is the point, the test crosses a real one: messages are pickled in a child
interpreter and read here, output is captured in a child whose fds 1 and 2 are redirected (its own
subprocess writes too), and prefixed output is read from a real child's pipe in whatever chunks the
kernel hands over. No torch_xla here: the launcher and the slice runner that use these pieces are
tested end to end in test_parallel.py and test_pod.py.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tpukit import events
from tpukit.compiles import CompileEvent
from tpukit.parallel import remote
from tpukit.steps import StepRecord

MESSAGES = (  # one of each kind, built the same way here and in the child below
    "[remote.Message.hello(2, 'host-b', 4242, 'node-9'),"
    " remote.Message.output(1, 'stderr', 'half a line', sent=11),"
    " remote.Message(remote.STEP, 0, record=StepRecord(step=3, start=1.0, end=1.5, scalars={'loss': 0.25})),"
    " remote.Message.result(0, {'weights': [1.0, 2.0]}, primary=True),"
    " remote.Message.error(3, 'ValueError: no', 'Traceback (most recent call last):\\n  ...\\nValueError: no\\n')]"
)


def _messages() -> list:
    return eval(MESSAGES, {"remote": remote, "StepRecord": StepRecord})


def test_messages_cross_a_process_boundary_by_pickle_unchanged():
    code = ("import pickle, sys\nfrom tpukit.parallel import remote\nfrom tpukit.steps import StepRecord\n"
            f"sys.stdout.buffer.write(pickle.dumps({MESSAGES}))\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    received = pickle.loads(child.stdout)
    assert received == _messages()  # frozen dataclasses: equal field by field, records included
    hello, output, step, result, error = received
    assert (hello.kind, hello.source, hello.hostname, hello.pid, hello.node) == ("hello", 2, "host-b", 4242, "node-9")
    assert (output.stream, output.text, output.sent) == ("stderr", "half a line", 11)
    assert step.record.step == 3 and step.record.scalars == {"loss": 0.25}
    assert result.primary and result.value == {"weights": [1.0, 2.0]}
    assert error.summary == "ValueError: no" and error.traceback.endswith("ValueError: no\n")
    with pytest.raises(AttributeError):
        output.text = "changed"  # frozen


def test_a_message_of_no_known_kind_is_refused():
    with pytest.raises(ValueError, match=r"Message kind 'out' is not one of hello, output, step"):
        remote.Message("out", 0)
    with pytest.raises(ValueError, match=r"output Message needs stream='stdout' or 'stderr', got 'stdin'"):
        remote.Message.output(0, "stdin", "x")


# ------------------------------------------------------------------------------ prefixing

def test_partial_lines_wait_for_their_end_per_source_and_stream(capsys):
    lines = remote.Prefixer("rank")
    lines.write(0, "stdout", "epoch 1 ")
    lines.write(1, "stdout", "other rank\n")
    lines.write(0, "stderr", "warn")
    assert capsys.readouterr().out == "[rank 1] other rank\n"  # rank 0's half line waits
    lines.write(0, "stdout", "done\r\nstep 1\rstep 2\r")
    lines.write(0, "stdout", "tail")
    captured = capsys.readouterr()
    assert captured.out == "[rank 0] epoch 1 done\n[rank 0] step 1\r[rank 0] step 2\r"  # \r\n -> \n; \r stays
    assert captured.err == ""
    lines.write(0, "stderr", "ing\n")
    lines.write(0, "stdout", " end", final=True)  # the stream ended: its last partial line is written
    captured = capsys.readouterr()
    assert captured.out == "[rank 0] tail end\n" and captured.err == "[rank 0] warning\n"
    lines.flush()
    assert capsys.readouterr() == ("", "")  # nothing was left waiting


def test_a_character_split_across_reads_is_not_garbled(capsys):
    lines = remote.Prefixer("host")
    data = "naïve → 東京\nlast ü".encode()
    for i in range(len(data)):  # one byte at a time: every multi-byte character is split
        lines.write(2, "stdout", data[i:i + 1])
    lines.flush()
    assert capsys.readouterr().out == "[host 2] naïve → 東京\n[host 2] last ü\n"


def test_a_real_childs_output_is_prefixed_line_by_line_whatever_the_chunks(capsys):
    code = ("import os, sys, time\n"
            "for i in range(3):\n"
            "    sys.stdout.write(f'step {i} '); sys.stdout.flush(); time.sleep(0.05)\n"
            "    os.write(1, f'loss {i}\\n'.encode()); time.sleep(0.05)\n"
            "os.write(1, 'é'.encode()[:1]); time.sleep(0.05); os.write(1, 'é'.encode()[1:] + b'\\r\\nno newline')\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    lines, chunks = remote.Prefixer("rank"), 0
    fd = child.stdout.fileno()
    while data := os.read(fd, 65536):
        chunks += 1
        lines.write(5, "stdout", data)
    lines.write(5, "stdout", b"", final=True)
    child.wait(30)
    assert chunks >= 4, "the child's writes should arrive in several reads"
    assert capsys.readouterr().out == ("[rank 5] step 0 loss 0\n[rank 5] step 1 loss 1\n[rank 5] step 2 loss 2\n"
                                       "[rank 5] é\n[rank 5] no newline\n")


# ------------------------------------------------------------------------------ capture

def test_the_capture_takes_print_logging_fd_writes_and_child_processes_then_puts_all_back():
    code = r"""
import json, logging, os, subprocess, sys
from tpukit.parallel import remote

logging.basicConfig(format="%(levelname)s:%(message)s")  # a handler bound to this sys.stderr
handler = logging.getLogger().handlers[0]
before = (sys.stdout, sys.stderr, handler.stream)
out_r, out_w = os.pipe()
err_r, err_w = os.pipe()
print("before the capture", flush=True)
sys.stdout.write("buffered before ")  # flushed out before redirecting, not captured
with remote.Redirect(out_w, err_w):
    print("print line")
    os.write(1, b"fd 1 line\n")
    subprocess.run([sys.executable, "-c", "import os; os.write(1, b'grandchild line\\n'); os.write(2, b'grandchild err\\n')"])
    logging.getLogger("user").warning("logged")
    print("to stderr", file=sys.stderr)
    sys.stdout.write("no newline")
after = (sys.stdout, sys.stderr, handler.stream)
os.close(out_w)
os.close(err_w)
captured = {"out": os.read(out_r, 65536).decode(), "err": os.read(err_r, 65536).decode()}
print("after the capture")
print(json.dumps({**captured, "restored": after == before}))
"""
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    shown = child.stdout.splitlines()
    report = json.loads(shown[-1])
    assert report["out"] == "print line\nfd 1 line\ngrandchild line\nno newline"
    assert report["err"] == "grandchild err\nWARNING:logged\nto stderr\n"
    assert report["restored"], "sys.stdout, sys.stderr and the logging handler's stream were not put back"
    assert shown[:-1] == ["before the capture", "buffered before after the capture"]
    assert child.stderr == ""  # nothing escaped the capture


# ------------------------------------------------------------------------------ tracebacks and outcomes

def _users_function(x):
    return _users_helper(x)


def _users_helper(x):
    raise ValueError(f"bad value {x}")


def test_a_traceback_starts_at_the_users_code_past_tpukit_and_thread_pools():
    with ThreadPoolExecutor(1) as pool:  # the user's function ran in a pool's thread, like torch_xla's replicas
        future = pool.submit(_users_function, 7)
        msg = remote.run(3, future.result)
    assert (msg.kind, msg.source, msg.summary) == (remote.ERROR, 3, "ValueError: bad value 7")
    frames = [line for line in msg.traceback.splitlines() if line.startswith("  File ")]
    assert frames[0].endswith("in _users_function") and frames[1].endswith("in _users_helper"), msg.traceback
    assert len(frames) == 2, msg.traceback  # tpukit's and concurrent.futures' frames trimmed
    assert msg.traceback.startswith("Traceback (most recent call last):")
    assert msg.traceback.rstrip().endswith("ValueError: bad value 7")


def test_a_traceback_of_plumbing_alone_is_kept_whole():
    msg = remote.run(0, int, ("seven",))  # raised inside a builtin called straight from tpukit
    assert msg.summary.startswith("ValueError: invalid literal for int()")
    assert os.path.join("tpukit", "parallel", "remote.py") in msg.traceback  # nothing of the user's to start at


def test_run_says_how_the_function_ended():
    assert remote.run(1, lambda a, b=0: a + b, (2,), {"b": 3}) == remote.Message.result(1, 5, primary=False)

    def exits(code):
        sys.exit(code)

    assert remote.run(0, exits, (0,)) == remote.Message.result(0, None, primary=False)  # a clean exit
    failed = remote.run(0, exits, (4,))
    assert failed.kind == remote.ERROR and failed.summary == "SystemExit(4)" and "in exits" in failed.traceback

    def interrupted():
        raise KeyboardInterrupt("stop")

    assert remote.run(2, interrupted).summary == "KeyboardInterrupt: stop"  # reported, not swallowed silently


def test_a_value_that_cannot_travel_is_an_error_that_says_what_to_return():
    value = (lambda: 1)
    try:
        pickle.dumps(value)
    except Exception as exc:
        msg = remote.unsendable(0, value, exc, "the notebook")
    assert msg.kind == remote.ERROR and msg.traceback == ""
    assert msg.summary.startswith("it returned a function that cannot be sent back to the notebook (")
    assert msg.summary.endswith("return plain Python data or CPU tensors (t.cpu())")


# ------------------------------------------------------------------------------ record forwarding

class Collect:
    def __init__(self):
        self.got = []

    def on_step(self, record):
        self.got.append(("step", record))

    def on_compile(self, event):
        self.got.append(("compile", event))


def test_records_are_forwarded_as_messages_and_published_on_the_other_side():
    sent, rank0 = [], [True]
    forwarder = events.add_listener(remote.Forwarder(
        sent.append, 1, tag=lambda record, source: (source, record), when=lambda: rank0[0]))
    step = StepRecord(step=1, start=10.0, end=10.5, scalars={"loss": 2.0})
    compiled = CompileEvent(index=1, start=10.0, end=10.2, cause="user mark_step", graph_hash="0000abcd", inputs=2,
                            outputs=1, frames=(), kind="new graph")
    events.call("on_step", step)
    events.call("on_compile", compiled)
    rank0[0] = False  # another device's thread of the same replica: not forwarded
    events.call("on_step", StepRecord(step=1, start=10.0, end=10.6))
    events.remove_listener(forwarder)
    assert sent == [remote.Message(remote.STEP, 1, record=(1, step)), remote.Message(remote.COMPILE, 1, record=(1, compiled))]

    seen = events.add_listener(Collect())  # the notebook's side: its listeners get what was sent
    for msg in pickle.loads(pickle.dumps(sent)):
        remote.publish(msg)
    assert seen.got == [("step", (1, step)), ("compile", (1, compiled))]
    with pytest.raises(ValueError, match="only step and compile Messages carry records"):
        remote.publish(remote.Message.output(0, "stdout", "x"))


def test_a_forwarder_serialises_senders_from_several_threads():
    received, active, overlaps = [], [0], []

    def slow_send(msg):  # a pipe must never see two writers at once
        active[0] += 1
        overlaps.append(active[0])
        time.sleep(0.001)
        received.append(msg)
        active[0] -= 1

    forwarder = remote.Forwarder(slow_send, 0)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: forwarder.on_step(StepRecord(step=i, start=0.0, end=1.0)), range(40)))
    assert sorted(m.record.step for m in received) == list(range(40))
    assert max(overlaps) == 1
