"""Long TPU work shows what it does and ends on time (tpukit.tpu.progress): the records a real estimate pushes
while the TPU compiler compiles, a time budget that ends a batch search with its best answer so far, and a
compile still running at its deadline stopped (its worker killed) without harming the next answer.

Everything here runs the real TPU compiler ahead of time on this CPU; nothing is mocked.
"""

from __future__ import annotations

import io
import time

import pytest

tpu = pytest.importorskip("tpukit.tpu")

import torch  # noqa: E402

import tpukit  # noqa: E402
from tpukit import _xla, events  # noqa: E402
from tpukit.tpu import progress  # noqa: E402
from tpukit.tpu.ask import ask, resolve  # noqa: E402
from tpukit.tpu.compiler import worker  # noqa: E402
from tpukit.tpu.trace import trace  # noqa: E402


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """An empty answer cache for each test: its compiles really run."""
    monkeypatch.setenv("TPUKIT_TPU_CACHE", str(tmp_path / "tpu-cache"))


def mlp_step(dim: int, hidden: int, layers: int = 1):
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, dim)]
    model = torch.nn.Sequential(*blocks).to(_xla.device())
    opt = torch.optim.AdamW(model.parameters())

    def step(x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    return step


class Records:
    """A listener that keeps every progress record."""

    def __init__(self):
        self.seen: list[progress.TpuProgress] = []

    def on_tpu_progress(self, p):
        self.seen.append(p)


@pytest.mark.compiler
def test_an_estimate_says_what_it_compiles_while_it_compiles(rt, monkeypatch, capsys):
    monkeypatch.setattr(progress, "TICK_S", 0.05)  # the clock's record every 50 ms (1 s in use)
    step = mlp_step(1024, 4096)
    x = torch.randn(64, 1024).to(_xla.device())
    got = events.add_listener(Records())
    try:
        est = tpukit.estimate(step, x, target="v5e-1", suggest=False)
    finally:
        events.remove_listener(got)
    assert est.fits
    phases = [p.phase for p in got.seen]
    assert phases[0] == progress.STARTED and phases[-1] == progress.ENDED, phases
    ticking = [p for p in got.seen if p.phase == progress.COMPILING]
    # The compile was announced, then its clock pushed while it ran (the same compile, its time growing).
    assert len(ticking) >= 2 and all(p.what == "the step" for p in ticking), ticking
    assert ticking[-1].phase_s > ticking[0].phase_s
    (answer,) = [p for p in got.seen if p.phase == progress.ANSWERED]
    assert answer.compiles == 1 and answer.last.startswith("fits, ") and " of 16.91 GB" in answer.last, answer
    assert answer.phase_s >= ticking[-1].phase_s  # at its answer: the compile's whole time
    assert got.seen[-1].compiles == 1 and got.seen[-1].job == "tpukit.estimate(mlp_step.<locals>.step) for v5e-1"
    # The job's own view (text here: no notebook, no terminal) printed the answer and the end.
    err = capsys.readouterr().err
    assert "tpukit.estimate(mlp_step.<locals>.step) for v5e-1: the step: fits, " in err, err
    assert "tpukit.estimate(mlp_step.<locals>.step) for v5e-1: done: 1 compile" in err, err


@pytest.mark.compiler
def test_a_time_budget_ends_a_search_with_its_best_answer_so_far(rt):
    step = mlp_step(256, 1024)
    made: list[int] = []

    def make(b):
        made.append(b)
        if len(made) == 2:  # the second size: hold its trace until the budget has run out
            job = progress.current()
            while not job.over():
                time.sleep(0.05)
        return torch.randn(b, 256).to(_xla.device())

    first = tpukit.largest_batch(step, lambda b: torch.randn(b, 256).to(_xla.device()), "v5e-1", start=8,
                                 bisect=0, progress=False)
    assert first.batch > 8 and not first.stopped  # without a budget the search goes on past 8 rows
    got = events.add_listener(Records())
    try:
        fit = tpukit.largest_batch(step, make, "v5e-1", start=8, budget=10, progress=False)
    finally:
        events.remove_listener(got)
    # Size 8 answered (from the cache the first search filled); the budget ran out before the next compile.
    assert fit.batch == 8 and fit.tried == ((8, True),), fit
    assert fit.stopped == "stopped by the time budget (10 s)", fit
    assert "stopped by the time budget (10 s): the best answer so far" in str(fit), str(fit)
    end = got.seen[-1]
    assert end.phase == progress.ENDED and end.best.startswith("batch 8 fits (") and \
        end.note == "stopped by the time budget (10 s) after 1 compiles: the best answer so far", end
    with pytest.raises(ValueError, match="give the seconds the work may take"):
        tpukit.largest_batch(step, make, "v5e-1", budget=0)


@pytest.mark.compiler
def test_a_compile_running_at_its_deadline_is_stopped_and_the_next_is_answered(rt):
    tgt, comp = resolve("v5e-1")
    big = trace(mlp_step(1024, 4096, layers=8), (torch.randn(256, 1024).to(_xla.device()),), {})
    small = trace(mlp_step(64, 64), (torch.randn(8, 64).to(_xla.device()),), {})
    assert ask(small, tgt, comp).fits  # the worker is up, jax and libtpu loaded
    before = worker.worker_pid(comp)
    view = tpukit.widgets.ProgressView(mode="text", file=io.StringIO())
    events.add_listener(view)
    try:
        with progress.job("a test's job", budget=0.5, progress=False), pytest.raises(worker.BudgetSpent):
            ask(big, tgt, comp, what="the 8-layer step")
    finally:
        events.remove_listener(view)
    assert worker.worker_pid(comp) is None and before is not None  # killed, not left compiling for nobody
    assert view.lines[-1].startswith("a test's job: done: 0 compiles · ") and view.lines[-1].endswith(" of 0.5 s"), \
        view.lines
    other = trace(mlp_step(64, 128), (torch.randn(8, 64).to(_xla.device()),), {})
    again = ask(other, tgt, comp)  # a new worker compiles the next request and gives its own answer
    assert again.fits and again.hbm_bytes < 10e6, again
    assert worker.worker_pid(comp) not in (None, before)
