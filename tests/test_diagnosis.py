"""Compile diagnosis on loops users really write (issue 15), all on XLA:CPU.

1. The corpus: loops copied from the PyTorch/XLA guide and Hugging Face examples
   (tests/scenarios/diag_loops.py), each with the classification it must get: new graphs
   (not alarms), expected compiles (declared buckets), recompilations (alarms)
   with their evidence, hint and code place; cells in a real IPython shell; the
   guard on the same loops.
2. The bottleneck verdict on four loops each bound by one thing.
3. Units: tpukit.graphs.parse_hlo / diff on real HLO text, tpukit.classify on plain values.

A pattern whose diagnosis is wrong fails here: the tests state the truth.
"""

import json
import os
import re
import time

import diag_loops as loops
import pytest
import torch
from conftest import run_python

import tpukit
from tpukit.compiles import classify, graphs
from tpukit import steps

SCENARIOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenarios")
LOOPS_FILE = "diag_loops.py"


def compiles_by_step(tracker):
    """{step: [kind, ...]} for the steps that compiled (every compile must have been classified)."""
    out = {}
    for r in tracker.history:
        assert r.compiles == len(r.compile_events), f"step {r.step}: {r.compiles} compiles, events {r.compile_events}"
        if r.compile_events:
            out[r.step] = [e.kind for e in r.compile_events]
    return out


def all_events(tracker):
    return [e for r in tracker.history for e in r.compile_events]


def step_events(tracker, step):
    return tracker.history[step - 1].compile_events


def described(tracker):
    """What the kit said, for assertion messages."""
    return "\n".join(f"step {r.step}: {e.describe()}" for r in tracker.history for e in r.compile_events)


def at(marker, function):
    """``where`` of a compile cut at the ``# MARK: marker`` line of tests/scenarios/diag_loops.py."""
    return f"{LOOPS_FILE}:{loops.marker_line(marker)} in {function}"


# ================================================================== 1. the corpus

def test_guide_single_device_loop_compiles_two_new_graphs_and_settles(rt):
    tracker = loops.guide_single_device()
    said = described(tracker)
    assert compiles_by_step(tracker) == {1: ["new graph"], 2: ["new graph"]}, said
    first, second = all_events(tracker)
    for e in (first, second):
        assert e.where == at("guide mark_step", "guide_single_device"), said  # cut by xm.mark_step()
        assert e.cut == "step" and e.hint is None and not e.recompilation
        assert re.fullmatch(rf"step graph at {re.escape(e.where)} \(\d+ ops, \d+ -> \d+\)", e.name), e.name
    assert first.evidence[0].startswith("first graph here")
    # Step 2: SGD's momentum buffers exist now and are read: more inputs, same place.
    assert any(re.search(r"\+\d+ inputs", p) for p in second.evidence), said
    s = tracker.summary()
    assert (s["steps"], s["compiles"], s["recompilations"], s["new_graphs"], s["expected_compiles"]) == (8, 2, 0, 2, 0)
    assert s["settled_after"] == 2


def test_guide_multi_device_idiom_mpdeviceloader_and_optimizer_step(rt):
    tracker = loops.guide_multi_device()
    said = described(tracker)
    assert compiles_by_step(tracker) == {1: ["new graph"], 2: ["new graph"]}, said
    assert all(e.where == at("multi-device for", "guide_multi_device") for e in all_events(tracker)), said
    s = tracker.summary()
    assert s["recompilations"] == 0 and s["settled_after"] == 2 and s["steps"] == 8


def test_dataloader_straight_to_track_with_adam(rt):
    tracker = loops.dataloader_adam()
    said = described(tracker)
    assert compiles_by_step(tracker) == {1: ["new graph"], 2: ["new graph"]}, said
    (second,) = step_events(tracker, 2)
    # Adam's state (exp_avg, exp_avg_sq, step) becomes inputs of the steady graph.
    assert any(re.search(r"\+\d+ inputs", p) for p in second.evidence), said
    s = tracker.summary()
    assert s["recompilations"] == 0 and s["settled_after"] == 2
    assert set(s["last_scalars"]) == {"loss"}


def test_gradient_accumulation_over_two_micro_batches(rt):
    tracker = loops.gradient_accumulation()
    said = described(tracker)
    # 1: first micro-batch (grads created); 2: accumulate + first optimizer step (momentum
    # created); 3: like 1 (cached); 4: accumulate + steady optimizer step; then all cached.
    assert compiles_by_step(tracker) == {1: ["new graph"], 2: ["new graph"], 4: ["new graph"]}, said
    s = tracker.summary()
    assert s["recompilations"] == 0 and s["new_graphs"] == 3 and s["settled_after"] == 4


def test_train_and_eval_alternating_in_one_loop(rt):
    tracker = loops.train_eval_alternating()
    said = described(tracker)
    assert compiles_by_step(tracker) == {1: ["new graph"], 2: ["new graph"], 3: ["new graph"]}, said
    (evaluation,) = step_events(tracker, 2)
    assert any(re.search(r"-\d+ outputs", p) for p in evaluation.evidence), said  # eval updates no weights
    s = tracker.summary()
    assert s["recompilations"] == 0 and s["settled_after"] == 3
    assert set(s["last_scalars"]) == {"accuracy"}


def test_stateful_optimizer_first_steps_then_quiet(rt):
    tracker = loops.adamw_first_steps()
    said = described(tracker)
    assert compiles_by_step(tracker) == {1: ["new graph"], 2: ["new graph"]}, said
    assert all(r.compiles == 0 for r in tracker.history[2:])
    s = tracker.summary()
    assert s["recompilations"] == 0 and s["settled_after"] == 2 and s["steps"] == 7


def test_dynamic_padding_alarms_name_the_input_and_lengths(rt):
    tracker = loops.dynamic_padding()  # batch lengths 16, 16, 16, 24, 24, 32
    said = described(tracker)
    assert compiles_by_step(tracker) == {1: ["new graph"], 2: ["new graph"], 4: ["recompilation"],
                                         6: ["recompilation"]}, said
    (to24,) = step_events(tracker, 4)
    (to32,) = step_events(tracker, 6)
    assert "input_ids: (8, 16) -> (8, 24)" in to24.evidence, said
    assert "input_ids: (8, 24) -> (8, 32)" in to32.evidence, said
    for e in (to24, to32):
        assert e.recompilation and e.label == "recompilation"
        assert "bucket" in e.hint and "pad" in e.hint
        assert e.where == at("dynamic padding for", "dynamic_padding")
        assert e.describe().startswith("recompilation: step graph at ")
    s = tracker.summary()
    assert s["recompilations"] == 2 and s["new_graphs"] == 2 and s["settled_after"] is None


def _check_bucketed(tracker):
    said = described(tracker)
    kinds = [k for ks in compiles_by_step(tracker).values() for k in ks]
    # The optimizer's two graphs are new; the steady graph at the two other lengths is expected.
    assert sorted(kinds) == ["expected", "expected", "new graph", "new graph"], said
    for e in all_events(tracker):
        if e.kind == "expected":
            assert e.label == "expected compile" and not e.recompilation and e.hint is None
            assert "a declared shape" in e.evidence
            assert any(p.startswith("input_ids: (8, ") for p in e.evidence), said
    s = tracker.summary()
    assert s["recompilations"] == 0 and s["expected_compiles"] == 2 and s["new_graphs"] == 2
    assert s["settled_after"] is not None


def test_bucket_batcher_shuffled_gives_expected_compiles_only(rt):
    tracker = loops.bucket_batcher()
    assert [r.batch_size for r in tracker.history] == [8] * 9
    _check_bucketed(tracker)


def test_declared_shapes_on_a_plain_list_are_expected(rt):
    _check_bucketed(loops.declared_shapes())


def test_the_same_shapes_undeclared_are_alarms(rt):
    tracker = loops.undeclared_shapes()
    said = described(tracker)
    s = tracker.summary()
    assert s["recompilations"] == 2 and s["expected_compiles"] == 0, said
    for e in all_events(tracker):
        if e.recompilation:
            assert any(re.fullmatch(r"input_ids: \(8, \d\d\) -> \(8, \d\d\)", p) for p in e.evidence), said


def test_python_float_baked_in_names_both_values(rt):
    tracker = loops.focal_gamma_schedule()  # gamma 2.5, then 3.5 from step 4
    said = described(tracker)
    assert compiles_by_step(tracker) == {1: ["new graph"], 2: ["new graph"], 4: ["recompilation"]}, said
    (e,) = step_events(tracker, 4)
    assert any("2.5 -> 3.5" in p for p in e.evidence), said
    assert "tensor" in e.hint and "bucket" not in e.hint, e.hint
    assert tracker.summary()["recompilations"] == 1


def test_item_mid_step_is_a_forced_read_at_its_line(rt):
    tracker = loops.item_mid_step()
    said = described(tracker)
    forced = [e for e in all_events(tracker) if e.cut == "forced read"]
    assert len(forced) == 1, said  # the forward graph is cached after step 1
    (e,) = forced
    assert e.where == at("item", "item_mid_step"), said
    assert e.forced and e.kind == "new graph" and ".item()" in e.hint
    assert e.name.startswith(f"forced read graph at {e.where} (")
    assert step_events(tracker, 1)[0] is e
    assert compiles_by_step(tracker) == {1: ["new graph", "new graph"], 2: ["new graph"]}, said
    assert all(r.item_reads >= 1 for r in tracker.history)
    s = tracker.summary()
    assert s["recompilations"] == 0 and s["settled_after"] == 2


def test_special_scalar_one_becomes_an_input_in_eval(rt):
    tracker = loops.logit_scale_eval()  # logit scale 1.0 (baked in), then 0.5 (an input)
    said = described(tracker)
    assert compiles_by_step(tracker) == {1: ["new graph"], 4: ["recompilation"]}, said
    (e,) = step_events(tracker, 4)
    assert any(re.search(r"the constant 1 in \w+ became an input", p) for p in e.evidence), said
    assert "0 and 1" in e.hint or "XLA_NO_SPECIAL_SCALARS" in e.hint, e.hint


def test_special_scalar_one_becomes_an_input_in_training(rt):
    # The same cause in a training step: a loss weight of exactly 1.0, then 0.5. The
    # step graph is the same computation (the 1.0 multiply became a scalar input).
    tracker = loops.loss_scale_from_one()
    said = described(tracker)
    assert compiles_by_step(tracker) == {1: ["new graph"], 4: ["recompilation"]}, said
    (e,) = step_events(tracker, 4)
    assert any(re.search(r"the constant 1 in \w+ became an input", p) for p in e.evidence), said


def test_a_loop_that_never_settles(rt):
    tracker = loops.never_settles()  # 4, 5, ..., 9 rows
    said = described(tracker)
    expected = {1: ["new graph"], 2: ["new graph"]} | {k: ["recompilation"] for k in range(3, 7)}
    assert compiles_by_step(tracker) == expected, said
    for r in tracker.history[2:]:
        (e,) = r.compile_events
        n = r.step + 3
        assert f"batch[0]: ({n - 1}, 3) -> ({n}, 3)" in e.evidence, said
    s = tracker.summary()
    assert s["settled_after"] is None and tracker.settled_after() is None
    assert s["recompilations"] == 4
    assert "never settled" in s["verdict"]


def test_last_partial_batch_of_a_dataloader_is_an_alarm(rt):
    tracker = loops.last_partial_batch()  # 8 batches of 8, then 4
    said = described(tracker)
    assert compiles_by_step(tracker) == {1: ["new graph"], 9: ["recompilation"]}, said
    (e,) = step_events(tracker, 9)
    assert "batch[0]: (8, 10) -> (4, 10)" in e.evidence and "batch[1]: (8,) -> (4,)" in e.evidence, said
    assert "bucket or pad" in e.hint and e.where == at("partial batch for", "last_partial_batch")
    assert tracker.summary()["recompilations"] == 1


def _run_helper(script, *args):
    """Run tests/<script> in a fresh interpreter; return the JSON it prints after ``RESULT``."""
    path = os.path.join(SCENARIOS, script)
    proc = run_python(f"import runpy, sys; sys.argv = [{path!r}, *{list(args)!r}]; "
                      f"runpy.run_path({path!r}, run_name='__main__')", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(line[len("RESULT "):])


def test_cells_in_a_real_ipython_shell_name_cell_and_line():
    cells = _run_helper("diag_cells.py")  # the cells are in that file
    assert [c["count"] for c in cells] == [1, 2, 3, 4]
    tracked, guide = cells[2]["events"], cells[3]["events"]
    # Cell [4]: the guide's loop, cut by xm.mark_step() at its line 8; no batch to compare,
    # so the evidence comes from the two graphs.
    assert [k for k, _, _ in guide] == ["new graph", "recompilation"], guide
    assert all(w == "cell [4] line 8" for _, w, _ in guide), guide
    assert len(guide[1][2]) == 1 and re.fullmatch(r"input \d+: f32\[3,6\] -> f32\[5,6\]", guide[1][2][0]), guide
    # Cell [3]: a tracked loop (cut at its for line, line 2); the batch grows from 4 to 6 rows.
    assert all(w == "cell [3] line 2" for _, w, _ in tracked), tracked
    assert [k for k, _, _ in tracked] == ["new graph", "recompilation"], tracked
    assert tracked[1][2] == ["batch: (4, 6) -> (6, 6)"], tracked


def test_guard_quiet_on_idiomatic_loops_and_raises_on_recompilations():
    out = _run_helper("diag_guard.py")
    assert out["guide_single_device"] == {"raised": None, "steps": 8, "late_compiles": 0}, out
    # These two compile after warm-up, but new graphs and declared buckets are not alarms.
    assert out["gradient_accumulation"] == {"raised": None, "steps": 10, "late_compiles": 1}, out
    assert out["bucket_batcher"] == {"raised": None, "steps": 9, "late_compiles": 2}, out
    message = out["dynamic_padding"]["raised"]
    assert message is not None, out
    assert message.startswith("step 4 recompiled after 2 warm-up step(s)")
    assert "input_ids: (8, 16) -> (8, 24)" in message and "bucket or pad" in message.lower()
    assert f"{LOOPS_FILE}:{loops.marker_line('dynamic padding for')}" in message
    # The last, smaller batch of a DataLoader is the same step graph compiled for a new shape.
    message = out["last_partial_batch"]["raised"]
    assert message is not None, out
    assert message.startswith("step 9 recompiled after 2 warm-up step(s)") and "batch[0]: (8, 10) -> (4, 10)" in message


# ================================================================== 2. where the time goes

def _verdict(tracker, kind):
    s = tracker.summary()
    shares = s["shares"]
    assert s["bottleneck"] == kind, (s["verdict"], shares)
    assert s["verdict"].startswith(f"{kind}-bound")
    host = {k: shares[k] for k in ("compile", "input", "tracing")}
    if kind == "device":
        assert shares["device"] >= max(host.values()), shares
    else:
        assert shares[kind] == max(host.values()), shares
    return s


def test_bottleneck_compile_when_every_step_has_a_new_shape(rt):
    w = torch.randn(24, 24, device=rt.device) / 5
    batches = [torch.randn(3 + i, 24) for i in range(8)]
    tracker = tpukit.track(batches, progress=False)
    for x in tracker:
        for _ in range(6):
            x = torch.tanh(x @ w)
        tpukit.log(norm=x.norm())
    s = _verdict(tracker, "compile")
    assert s["settled_after"] is None and s["recompilations"] >= 5


def test_bottleneck_input_when_the_data_source_sleeps(rt):
    w = torch.randn(16, 16, device=rt.device)

    def slow_reader():
        for _ in range(10):
            time.sleep(0.06)  # e.g. reading and decoding files on the host
            yield torch.randn(8, 16)

    tracker = tpukit.track(slow_reader(), progress=False)
    for x in tracker:
        tpukit.log(total=(x @ w).sum())
    _verdict(tracker, "input")


def test_bottleneck_tracing_with_thousands_of_tiny_ops(rt):
    tracker = tpukit.track([torch.randn(4) for _ in range(8)], progress=False)
    for x in tracker:
        for _ in range(600):
            x = x * 0.999 + 0.01
        tpukit.log(mean=x.mean())
    _verdict(tracker, "tracing")


def test_bottleneck_device_with_a_heavy_matmul_chain(rt):
    a = torch.randn(384, 384, device=rt.device)
    w = torch.randn(384, 384, device=rt.device) / 20
    tracker = tpukit.track(range(8), progress=False)
    for _ in tracker:
        x = a
        for _ in range(24):
            x = torch.tanh(x @ w)
        out = x.sum()
    del out
    _verdict(tracker, "device")


def test_a_training_step_waiting_in_its_sync_for_the_device_is_not_called_tracing(rt):
    # A step that updates the parameters in place makes the next sync wait for the previous
    # execution (its buffers are donated): that wait is the device's, so the records count it as
    # waiting, not tracing. Heavy matmuls, few ops: the host has little to trace. Counted as
    # tracing, the wait made this loop's tracing share 0.83 and its waits 0.07 s of 1.1 s.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024)).to(rt.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [torch.randn(1024, 1024) for _ in range(14)]
    tracker = tpukit.track(batches, progress=False)
    for x in tracker:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        tpukit.log(loss=loss)
    s = _verdict(tracker, "device")
    steady = [r for r in tracker.history if r.step > s["settled_after"]]
    wait, tracing = sum(r.wait_time for r in steady), sum(r.tracing_time for r in steady)
    # Loose bounds: on a loaded machine the host traces slower (measured 0.45 s of waits, 0.59 s of tracing).
    assert wait > 0.5 * tracing and wait > 0.2 * sum(r.wall for r in steady), (wait, tracing, s["shares"])
    assert s["shares"]["tracing"] < 0.6, s["shares"]


def test_sync_wait_is_the_part_of_the_sync_while_an_execution_ran():
    began, seconds = 100.0, 0.5
    samples = [(99.0, 0.2),    # ended before the sync
               (100.3, 0.4),   # the previous step's, running when the sync began: 0.3 s of it
               (100.4, 0.15),  # overlaps the previous one: counted once (0.1 s more)
               (100.7, 0.3)]   # ran past the sync's end: 0.1 s of it
    assert steps.sync_wait(samples, began, seconds) == pytest.approx(0.5)
    assert steps.sync_wait(samples[:2], began, seconds) == pytest.approx(0.3)
    assert steps.sync_wait(samples[:2], began, seconds, compile_time=0.4) == pytest.approx(0.1)  # capped
    assert steps.sync_wait([(99.0, 0.2)], began, seconds) == 0.0


# ================================================================== 3. units

# Real HLO text, as XLA dumped it on XLA:CPU for ``(w @ w).pow(2.5).sum()`` (w: 4x4).
POW_HLO = """\
HloModule SyncTensorsGraph.14, entry_computation_layout={(f32[4,4]{1,0})->(f32[])}

%AddComputation.8 (x.9: f32[], y.10: f32[]) -> f32[] {
  %x.9 = f32[] parameter(0)
  %y.10 = f32[] parameter(1)
  ROOT %add.11 = f32[] add(%x.9, %y.10)
}

ENTRY %SyncTensorsGraph.14 (p0.2: f32[4,4]) -> (f32[]) {
  %constant.7 = s32[] constant(16)
  %p0.2 = f32[4,4]{1,0} parameter(0)
  %dot.3 = f32[4,4]{1,0} dot(%p0.2, %p0.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %constant.1 = f32[] constant(2.5)
  %broadcast.4 = f32[4,4]{1,0} broadcast(%constant.1), dimensions={}
  %power.5 = f32[4,4]{1,0} power(%dot.3, %broadcast.4)
  %constant.6 = f32[] constant(0)
  %reduce.12 = f32[] reduce(%power.5, %constant.6), dimensions={0,1}, to_apply=%AddComputation.8
  ROOT %tuple.13 = (f32[]) tuple(%reduce.12)
}
"""

# ``((w + 2) * scale).sum()`` with scale 1.0 (baked in), then 0.5 (a scalar input).
SCALE_ONE_HLO = """\
HloModule SyncTensorsGraph.18, entry_computation_layout={(f32[], f32[4,4]{1,0})->(f32[])}

%AddComputation.12 (x.13: f32[], y.14: f32[]) -> f32[] {
  %x.13 = f32[] parameter(0)
  %y.14 = f32[] parameter(1)
  ROOT %add.15 = f32[] add(%x.13, %y.14)
}

ENTRY %SyncTensorsGraph.18 (p0.3: f32[], p1.4: f32[4,4]) -> (f32[]) {
  %constant.11 = s32[] constant(16)
  %p1.4 = f32[4,4]{1,0} parameter(1)
  %p0.3 = f32[] parameter(0)
  %constant.2 = f32[] constant(1)
  %multiply.5 = f32[] multiply(%p0.3, %constant.2)
  %broadcast.6 = f32[4,4]{1,0} broadcast(%multiply.5), dimensions={}
  %add.7 = f32[4,4]{1,0} add(%p1.4, %broadcast.6)
  %constant.1 = f32[] constant(1)
  %broadcast.8 = f32[4,4]{1,0} broadcast(%constant.1), dimensions={}
  %multiply.9 = f32[4,4]{1,0} multiply(%add.7, %broadcast.8)
  %constant.10 = f32[] constant(0)
  %reduce.16 = f32[] reduce(%multiply.9, %constant.10), dimensions={0,1}, to_apply=%AddComputation.12
  ROOT %tuple.17 = (f32[]) tuple(%reduce.16)
}
"""

SCALE_INPUT_HLO = """\
HloModule SyncTensorsGraph.18, entry_computation_layout={(f32[], f32[], f32[4,4]{1,0})->(f32[])}

%AddComputation.12 (x.13: f32[], y.14: f32[]) -> f32[] {
  %x.13 = f32[] parameter(0)
  %y.14 = f32[] parameter(1)
  ROOT %add.15 = f32[] add(%x.13, %y.14)
}

ENTRY %SyncTensorsGraph.18 (p0.1: f32[], p1.3: f32[], p2.4: f32[4,4]) -> (f32[]) {
  %constant.11 = s32[] constant(16)
  %p2.4 = f32[4,4]{1,0} parameter(2)
  %p1.3 = f32[] parameter(1)
  %constant.2 = f32[] constant(1)
  %multiply.5 = f32[] multiply(%p1.3, %constant.2)
  %broadcast.6 = f32[4,4]{1,0} broadcast(%multiply.5), dimensions={}
  %add.7 = f32[4,4]{1,0} add(%p2.4, %broadcast.6)
  %p0.1 = f32[] parameter(0)
  %broadcast.8 = f32[4,4]{1,0} broadcast(%p0.1), dimensions={}
  %multiply.9 = f32[4,4]{1,0} multiply(%add.7, %broadcast.8)
  %constant.10 = f32[] constant(0)
  %reduce.16 = f32[] reduce(%multiply.9, %constant.10), dimensions={0,1}, to_apply=%AddComputation.12
  ROOT %tuple.17 = (f32[]) tuple(%reduce.16)
}
"""

# ``torch.tanh(x).sum(1)`` for x of shape (2, 8); the (2, 16) graph differs only in shapes.
TANH_HLO = """\
HloModule SyncTensorsGraph.11, entry_computation_layout={(f32[2,8]{1,0})->(f32[2]{0})}

%AddComputation.5 (x.6: f32[], y.7: f32[]) -> f32[] {
  %x.6 = f32[] parameter(0)
  %y.7 = f32[] parameter(1)
  ROOT %add.8 = f32[] add(%x.6, %y.7)
}

ENTRY %SyncTensorsGraph.11 (p0.1: f32[2,8]) -> (f32[2]) {
  %constant.4 = s32[] constant(8)
  %p0.1 = f32[2,8]{1,0} parameter(0)
  %tanh.2 = f32[2,8]{1,0} tanh(%p0.1)
  %constant.3 = f32[] constant(0)
  %reduce.9 = f32[2]{0} reduce(%tanh.2, %constant.3), dimensions={1}, to_apply=%AddComputation.5
  ROOT %tuple.10 = (f32[2]{0}) tuple(%reduce.9)
}
"""
TANH16_HLO = TANH_HLO.replace("[2,8]", "[2,16]").replace("constant(8)", "constant(16)")
TANH_EXP_HLO = TANH_HLO.replace(
    "  %constant.3", "  %exponential.12 = f32[2,8]{1,0} exponential(%tanh.2)\n  %constant.3").replace(
    "reduce(%tanh.2", "reduce(%exponential.12")

# The first line of a training step's module: XLA numbers every fifth entry with a comment.
MANY_INPUTS_LINE = ("HloModule SyncTensorsGraph.178, buffer_donor={ (1, {}), (2, {}), (3, {}), (4, {}) }, "
                    "entry_computation_layout={(s64[8]{0}, f32[3]{0}, f32[3,43]{1,0}, f32[43]{0}, f32[43,4]{1,0}, "
                    "/*index=5*/f32[8,4]{1,0}, f32[])->(f32[], f32[43,4]{1,0}, f32[43]{0}, f32[3,43]{1,0}, "
                    "f32[3]{0})}\n")


def test_parse_hlo_reduces_a_real_module():
    g = graphs.parse_hlo(POW_HLO, module=3)
    assert g.module == 3
    assert g.name == "SyncTensorsGraph.14"
    assert g.inputs == ("f32[4,4]",) and g.outputs == ("f32[]",)
    assert g.size == f"{g.ops} ops, 1 -> 1"
    ops = dict(g.op_counts)
    assert ops["dot"] == ops["power"] == ops["reduce"] == 1 and "parameter" not in ops and "constant" not in ops
    values = {(c.dtype, c.value): c.used_by for c in g.constants}
    assert values[("f32", "2.5")] == "power"  # seen through the broadcast
    assert values[("f32", "0")] == "reduce"


def test_parse_hlo_reads_inputs_past_xla_index_comments():
    g = graphs.parse_hlo(MANY_INPUTS_LINE)
    assert g.inputs == ("s64[8]", "f32[3]", "f32[3,43]", "f32[43]", "f32[43,4]", "f32[8,4]", "f32[]")
    assert g.outputs == ("f32[]", "f32[43,4]", "f32[43]", "f32[3,43]", "f32[3]")
    wider = graphs.parse_hlo(MANY_INPUTS_LINE.replace("f32[8,4]", "f32[16,4]").replace("s64[8]", "s64[16]"))
    assert graphs.diff(g, wider) == ["input 0: s64[8] -> s64[16]", "input 5: f32[8,4] -> f32[16,4]"]


def test_diff_names_a_changed_input_shape():
    a, b = graphs.parse_hlo(TANH_HLO), graphs.parse_hlo(TANH16_HLO)
    assert a.structure == b.structure
    assert graphs.diff(a, b) == ["input 0: f32[2,8] -> f32[2,16]"]
    assert graphs.diff(a, a) == []


def test_diff_names_both_values_of_a_baked_in_float():
    a = graphs.parse_hlo(POW_HLO)
    b = graphs.parse_hlo(POW_HLO.replace("constant(2.5)", "constant(3.5)"))
    assert a.structure == b.structure
    assert graphs.diff(a, b) == ["2.5 -> 3.5 in power"]


def test_diff_names_the_special_scalar_that_became_an_input():
    a, b = graphs.parse_hlo(SCALE_ONE_HLO), graphs.parse_hlo(SCALE_INPUT_HLO)
    assert a.structure == b.structure and len(b.inputs) == len(a.inputs) + 1
    (phrase,) = graphs.diff(a, b)
    # Two constants 1 feed a multiply before; one of them (the scale) is a parameter after.
    assert phrase.startswith("the constant 1 in multiply became an input (2 -> 3 inputs)"), phrase


def test_diff_of_a_new_structure_counts_what_was_added():
    a, b = graphs.parse_hlo(TANH_HLO), graphs.parse_hlo(TANH_EXP_HLO)
    assert a.structure != b.structure
    assert graphs.diff(a, b) == [f"+1 ops ({a.ops} -> {a.ops + 1})", "+1 exponential"]


def test_hlo_dump_reads_each_file_once_and_deletes_it(tmp_path):
    (tmp_path / "module_0007.SyncTensorsGraph.14.before_optimizations.txt").write_text(POW_HLO)
    (tmp_path / "module_0007.SyncTensorsGraph.14.ir-no-opt.ll").write_text("; llvm")
    half = TANH_HLO[:TANH_HLO.index("ROOT %tuple.10")]  # XLA is still writing it
    (tmp_path / "module_0008.SyncTensorsGraph.11.before_optimizations.txt").write_text(half)
    dump = graphs.HloDump(str(tmp_path))
    (g,) = dump.poll()
    assert g.module == 7 and g.inputs == ("f32[4,4]",)
    # The parsed file and other dumps are gone; a half-written module waits for the next poll.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["module_0008.SyncTensorsGraph.11.before_optimizations.txt"]
    (tmp_path / "module_0008.SyncTensorsGraph.11.before_optimizations.txt").write_text(TANH_HLO)
    assert [g.module for g in dump.poll()] == [8] and dump.poll() == []
    assert [g.module for g in dump.graphs] == [7, 8] and list(tmp_path.iterdir()) == []
    assert graphs.HloDump(None).poll() == []


def sig(**tensors):
    """A batch signature as track() computes it, from {key: (shape, dtype)}."""
    return tuple((f"[{k!r}]", shape, f"torch.{dtype}") for k, (shape, dtype) in tensors.items())


def test_batch_changes_names_keys_positions_and_dtypes():
    old = sig(input_ids=((8, 16), "int64"), labels=((8,), "int64"))
    assert classify.batch_changes(old, sig(input_ids=((8, 24), "int64"), labels=((8,), "int64"))) == [
        "input_ids: (8, 16) -> (8, 24)"]
    assert classify.batch_changes(old, sig(input_ids=((8, 16), "int64"), labels=((8,), "int32"))) == [
        "labels: int64 -> int32"]
    assert classify.batch_changes(old, old) == []
    assert classify.batch_changes(None, old) == [] and classify.batch_changes(old, None) == []
    pos_old = (("[0]", (5, 3), "torch.float32"), ("[1]", (5,), "torch.int64"))
    pos_new = (("[0]", (6, 3), "torch.float32"), ("[1]", (6,), "torch.int64"))
    assert classify.batch_changes(pos_old, pos_new) == ["batch[0]: (5, 3) -> (6, 3)", "batch[1]: (5,) -> (6,)"]
    assert classify.batch_changes(((("", (4, 6), "torch.float32")),), ((("", (6, 6), "torch.float32")),)) == [
        "batch: (4, 6) -> (6, 6)"]


def test_classifier_follows_the_alarm_contract():
    c = classify.Classifier()
    step = graphs.parse_hlo(TANH_HLO)
    step16 = graphs.parse_hlo(TANH16_HLO)
    other = graphs.parse_hlo(TANH_EXP_HLO)
    b8 = sig(input_ids=((2, 8), "float32"))
    b16 = sig(input_ids=((2, 16), "float32"))

    first = c.classify("cell [3] line 2", step, b8, (1, 1))
    assert first.kind == classify.NEW and first.evidence[0].startswith("first graph here (") and first.hint is None
    new = c.classify("cell [3] line 2", other, b8, (1, 1))
    assert new.kind == classify.NEW and "+1 exponential" in new.evidence
    alarm = c.classify("cell [3] line 2", step16, b16, (1, 1))
    assert alarm.kind == classify.RECOMPILATION
    assert alarm.evidence == ("input_ids: (2, 8) -> (2, 16)",) and "bucket" in alarm.hint
    # Another place has its own history: its first graph is new, whatever was seen elsewhere.
    assert c.classify("cell [4] line 1", step16, b16, (1, 1)).kind == classify.NEW


def test_classifier_expected_for_declared_lengths_and_shapes():
    step, step16 = graphs.parse_hlo(TANH_HLO), graphs.parse_hlo(TANH16_HLO)
    b8, b16 = sig(input_ids=((2, 8), "float32")), sig(input_ids=((2, 16), "float32"))
    for declared in (frozenset({8, 16}), frozenset({(2, 16)})):
        c = classify.Classifier()
        c.classify("p", step, b8, (1, 1), declared)
        f = c.classify("p", step16, b16, (1, 1), declared)
        assert f.kind == classify.EXPECTED and "a declared shape" in f.evidence and f.hint is None
    c = classify.Classifier()
    c.classify("p", step, b8, (1, 1), frozenset({8, 24}))
    assert c.classify("p", step16, b16, (1, 1), frozenset({8, 24})).kind == classify.RECOMPILATION


def test_classifier_hints_follow_the_cause():
    c = classify.Classifier()
    b = sig(x=((4, 4), "float32"))
    c.classify("pow", graphs.parse_hlo(POW_HLO), b, (1, 1))
    f = c.classify("pow", graphs.parse_hlo(POW_HLO.replace("constant(2.5)", "constant(3.5)")), b, (1, 1))
    assert f.kind == classify.RECOMPILATION and f.evidence == ("2.5 -> 3.5 in power",)
    assert "torch.tensor(value" in f.hint
    c.classify("scale", graphs.parse_hlo(SCALE_ONE_HLO), b, (2, 1))
    f = c.classify("scale", graphs.parse_hlo(SCALE_INPUT_HLO), b, (3, 1))
    assert f.kind == classify.RECOMPILATION and "became an input" in f.evidence[0]
    assert "XLA_NO_SPECIAL_SCALARS" in f.hint
    # Without a batch to compare (a loop outside track), the graphs' inputs say what changed.
    c.classify("manual", graphs.parse_hlo(TANH_HLO), None, (1, 1))
    f = c.classify("manual", graphs.parse_hlo(TANH16_HLO), None, (1, 1))
    assert f.kind == classify.RECOMPILATION and f.evidence == ("input 0: f32[2,8] -> f32[2,16]",)
    assert "pad" in f.hint and "bucket" not in f.hint


def test_classifier_without_hlo_judges_by_the_batch_and_counts():
    c = classify.Classifier()
    b8, b16 = sig(input_ids=((2, 8), "int64")), sig(input_ids=((2, 16), "int64"))
    assert c.classify("p", None, b8, (12, 9)).kind == classify.NEW
    assert c.classify("p", None, b8, (17, 9)).kind == classify.NEW  # more inputs: new structure
    f = c.classify("p", None, b16, (17, 9))
    assert f.kind == classify.RECOMPILATION and f.evidence == ("input_ids: (2, 8) -> (2, 16)",)
    # Same counts and the same batch: nothing says it is the same computation again.
    assert c.classify("p", None, b16, (17, 9)).kind == classify.NEW


COMPILE_MODES = '''\
import json, tpukit
rt = tpukit.setup(device="cpu")
import torch, torch_xla
device = rt.device
w = torch.randn(8, 8, device=device)
step = torch_xla.compile(lambda x: torch.tanh(x @ w).sum())
for n in (4, 4, 6):
    y = step(torch.randn(n, 8, device=device))  # LINE compiled-fn
torch_xla.sync()
model = torch.compile(torch.nn.Linear(8, 8).to(device), backend="openxla")
for n in (4, 4, 6):
    y = model(torch.randn(n, 8, device=device))  # LINE dynamo
torch_xla.sync()
import time; time.sleep(2.5)  # let the last HLO files land
from tpukit import compiles
print("EVENTS " + json.dumps([[e.cut, e.kind, e.where, list(e.evidence)] for e in compiles.events_since(0)]))
'''


def test_torch_xla_compile_and_dynamo_compiles_name_the_users_line(tmp_path):
    """torch_xla.compile(fn) and torch.compile(backend="openxla"): each compile at the user's call line,
    classified by the same contract (a batch of 6 after 4 is a recompilation, not a new graph)."""
    script = tmp_path / "modes.py"
    script.write_text(COMPILE_MODES)
    lines = {m: i + 1 for i, l in enumerate(COMPILE_MODES.splitlines()) for m in ("compiled-fn", "dynamo")
             if l.endswith(f"# LINE {m}")}
    proc = run_python(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = json.loads(proc.stdout.split("EVENTS ", 1)[1])
    fn = [e for e in events if e[0] == "torch_xla.compile"]
    dyn = [e for e in events if e[0] == "dynamo"]
    assert fn and all(e[2] == f"modes.py:{lines['compiled-fn']} in <module>" for e in fn), fn
    assert dyn and all(e[2] == f"modes.py:{lines['dynamo']} in <module>" for e in dyn), dyn
    assert [e[1] for e in fn] == ["new graph", "recompilation"], fn
    assert [e[1] for e in dyn] == ["new graph", "recompilation"], dyn
    assert all(any("f32[4,8] -> f32[6,8]" in ev for ev in e[3]) for e in fn + dyn if e[1] == "recompilation")


def test_parse_hlo_reads_an_spmd_module_header():
    """SPMD modules go on after the layout (allow_spmd_sharding_propagation_to_output, num_partitions)."""
    text = ("HloModule SyncTensorsGraph.9, entry_computation_layout={(f32[8,4]{1,0}, f32[])->(f32[8,4]{1,0})}, "
            "allow_spmd_sharding_propagation_to_output={true}, num_partitions=4\n\n"
            "ENTRY %SyncTensorsGraph.9 (p0.1: f32[8,4], p1.2: f32[]) -> (f32[8,4]) {\n"
            "  %p0.1 = f32[8,4]{1,0} parameter(0), sharding={devices=[4,1]0,1,2,3}\n"
            "  %p1.2 = f32[] parameter(1)\n"
            "  %broadcast.3 = f32[8,4]{1,0} broadcast(%p1.2), dimensions={}\n"
            "  %multiply.4 = f32[8,4]{1,0} multiply(%p0.1, %broadcast.3)\n"
            "  ROOT %tuple.5 = (f32[8,4]{1,0}) tuple(%multiply.4)\n}\n")
    g = graphs.parse_hlo(text)
    assert g.name == "SyncTensorsGraph.9" and g.inputs == ("f32[8,4]", "f32[]") and g.outputs == ("f32[8,4]",)
