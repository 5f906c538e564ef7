"""What the live dashboard costs the training loop, with a 1000-step history.

- per_step: one listener call (``on_step``), which runs on the training thread.
- refresh: one full refresh (state -> HTML parts -> PNG timeline -> widget values)
  run on the calling thread. In a live dashboard it runs on the dashboard's own
  thread at most twice a second, so this is an upper bound of the main-thread
  time it can take (through the GIL).
- tick: one iteration of the front end's thread (counter snapshot + HTML refresh;
  the PNG is drawn by the dashboard's plot thread and shown by a tick). It reads
  no compiles: those reach the dashboard as events.
- slowdown: a pure-Python stand-in for a training loop (100 steps/s) timed with
  and without a live dashboard; the difference is what the loop pays overall.

Prints a table and writes bench/results/dashboard_cost.json.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import tpukit  # noqa: E402
from tpukit.compiles import CompileEvent, Frame  # noqa: E402
from tpukit.steps import StepRecord  # noqa: E402
from tpukit.widgets import Dashboard  # noqa: E402

HISTORY = 1000
REPS = 30
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "dashboard_cost.json")


def record(step: int, t0: float) -> StepRecord:
    compiles = 1 if step in (1, 2) else 0
    events = ()
    if step == 500:  # one recompilation in the history, so the alert list is not empty
        events = (CompileEvent(index=step, start=t0, end=t0 + 1, cause="user code", graph_hash="5ca807d1",
                               inputs=3, outputs=2, frames=(Frame("step", "train.py", 12),), recompilation=True, kind="recompilation",
                               hint="a tensor shape changed"),)
    start = t0 + step * 0.05
    return StepRecord(step=step, start=start, end=start + 0.05 + (2.0 if compiles else 0.0), compiles=compiles,
                      compile_time=2.0 * compiles, executions=1, execute_time=0.03, to_host=1,
                      scalars={"loss": 1.0 / step, "acc": step / (step + 10)}, batch_size=32,
                      compile_events=events, fallbacks={"aten::nonzero": 1} if step % 100 == 0 else {})


def ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 3)


def busy(n: int) -> float:
    x = 0.0
    for i in range(n):
        x += i * 0.5
    return x


def loop_seconds(dash: Dashboard | None, start: int, steps: int = 300, work: int = 100_000) -> float:
    """A stand-in training loop: Python work per step, one record per step."""
    t0 = time.perf_counter()
    base = time.time()
    for s in range(start, start + steps):
        busy(work)
        if dash is not None:
            dash.on_step(record(s, base))
    return time.perf_counter() - t0


def main() -> dict:
    tpukit.setup(device="cpu")  # as in a notebook: counters are sampled, compiles arrive as events
    t0 = time.time()
    # refresh_hz tiny: the thread stays out of the way while the calling thread is measured.
    dash = Dashboard(mode="widgets", show=False, refresh_hz=0.01)
    per_step = []
    for s in range(1, HISTORY + 1):
        rec = record(s, t0)
        a = time.perf_counter()
        dash.on_step(rec)
        per_step.append(time.perf_counter() - a)
    dash.refresh()  # warm-up: matplotlib import and the first frame
    refresh, html_only, tick = [], [], []
    step = HISTORY
    for _ in range(REPS):
        step += 1
        dash.on_step(record(step, t0))  # a new step: the timeline is re-rendered
        a = time.perf_counter()
        dash.refresh()
        refresh.append(time.perf_counter() - a)
        a = time.perf_counter()
        dash.refresh()  # nothing new for the plot: HTML parts only
        html_only.append(time.perf_counter() - a)
        step += 1
        dash.on_step(record(step, t0))
        a = time.perf_counter()
        dash.tick(force=True)  # hands the plot to the plot thread, which is not timed here
        tick.append(time.perf_counter() - a)
        while dash.plot_version != dash.state.version:  # let the plot thread finish first
            time.sleep(0.001)
    dash.close()

    text = Dashboard(mode="text", show=False, text_every=1e9, refresh_hz=0.01)
    per_step_text = []
    for s in range(1, HISTORY + 1):
        rec = record(s, t0)
        a = time.perf_counter()
        text.on_step(rec)
        per_step_text.append(time.perf_counter() - a)
    with contextlib.redirect_stdout(io.StringIO()):  # its closing summary line
        text.close()

    # Overall: a loop of ~10 ms Python steps with a live 2 Hz dashboard (history
    # already 1000 steps) vs without, and the CPU time of the front end's refresh
    # and plot threads (with the GIL, about what they can take from the training thread).
    without, with_dash, thread_cpu, renders = [], [], [], 0
    for _ in range(3):
        without.append(loop_seconds(None, 1))
        live = Dashboard(mode="widgets", show=False, refresh_hz=2)
        for s in range(1, HISTORY + 1):
            live.on_step(record(s, t0))
        live.refresh()
        spent: list[float] = []

        def timed(fn, spent=spent):
            def run():
                a = time.thread_time()
                try:
                    return fn()
                finally:
                    spent.append(time.thread_time() - a)
            return run

        ui = live.ui  # what its threads call: the controller's poll, the refresh, the plot
        ui._poll, ui.tick, ui.draw_plot = timed(ui._poll), timed(ui.tick), timed(ui.draw_plot)
        before = live.renders
        with_dash.append(loop_seconds(live, HISTORY + 1))
        renders += live.renders - before
        thread_cpu.append(sum(spent) / with_dash[-1])
        live.close()
    slowdown = (statistics.median(with_dash) / statistics.median(without) - 1) * 100

    res = {
        "history_steps": HISTORY,
        "refresh_ms_median": ms(refresh),
        "refresh_ms_min": round(min(refresh) * 1000, 3),
        "refresh_html_only_ms_median": ms(html_only),
        "tick_ms_median": ms(tick),
        "per_step_ms_median": ms(per_step),
        "per_step_ms_p99": round(sorted(per_step)[int(0.99 * len(per_step))] * 1000, 3),
        "per_step_text_mode_ms_median": ms(per_step_text),
        "loop_slowdown_pct_live_2hz": round(slowdown, 1),
        "loop_seconds_without": round(statistics.median(without), 3),
        "loop_seconds_with": round(statistics.median(with_dash), 3),
        "dashboard_thread_cpu_ms_per_s": round(statistics.median(thread_cpu) * 1000, 1),
        "refreshes_per_second_during_loop": round(renders / sum(with_dash), 2),
        "python": sys.version.split()[0],
    }
    return res


if __name__ == "__main__":
    res = main()
    width = max(len(k) for k in res)
    for k, v in res.items():
        print(f"{k:<{width}}  {v}")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {OUT}")
