"""Overhead of tpukit on a training loop, against the loops users would write instead.

Three loops train the same model on the same ``DataLoader``, in one process:

* **bare**: torch_xla with synchronous copies: ``x.to(device)``, the step,
  ``torch_xla.sync()``;
* **idiomatic**: the PyTorch/XLA guide's loop: ``MpDeviceLoader(loader, device)``
  iterated directly (background copies, it syncs before each batch) and
  ``xm.optimizer_step(opt)``, no other sync;
* **tpukit**: ``tpukit.track(loader)`` + ``tpukit.log(loss=loss)`` every step + a
  listener receiving every record, with compile tracing and the HLO dump on
  (``tpukit.setup()``); with ``TPUKIT_TARGET`` set (``TPUKIT_TARGET=v5e-1 python bench/overhead.py``),
  every graph is also compiled for that TPU in the TPU compiler's worker process, and the result goes
  to ``bench/results/overhead-<target>-torch_xla<release>.json``.

The step is the same (``zero_grad``, forward, ``backward``, ``xm.optimizer_step``),
so the three loops run the same graph. Tracing is configured once, before
torch_xla starts, so it is on for all three (it only writes when something
compiles; the timed repetitions compile nothing, which the bench checks). Each
repetition runs the three loops one after the other, and the idiomatic loop a
second time (the A/A ratio, idiomatic again / idiomatic: how far one loop differs
from itself on this machine, the noise floor of the other ratios), in an order
that rotates, after a warm-up that compiles everything.

The measure is each loop's steady time per step: from the end of its first step
until the device is idle after its last one, over the remaining steps (the loop's
throughput; per-step host intervals are bimodal here, as the host alternately runs
ahead of the device and waits for it, so their median is reported only beside it).
Ratios are taken per repetition, then the median (30 repetitions: single ratios spread
by several percent on a 2-core machine), with a bootstrap 90% interval of that median
beside it. Repetitions during which other
processes used more than 5% of the CPUs (read from /proc) are left out when enough
quiet ones remain. Prints a table and writes bench/results/overhead-torch_xla<release>.json (the
release the stack runs: 2.8 on Kaggle's, 2.9 on Colab's) with the
ratios tpukit/bare (``ratio_median``) and tpukit/idiomatic
(``ratio_idiomatic_median``); target <= 1.02 for both.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")

import tpukit

# Compile tracing and the HLO dump on, before torch_xla is imported. With TPUKIT_TARGET=v5e-1 set, every
# graph is also compiled for that TPU in the TPU compiler's worker process (tpukit.setup(target=...)):
# the result then goes to overhead-<target>-torch_xla<release>.json.
rt = tpukit.setup(device="cpu")

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
from torch.utils.data import DataLoader, TensorDataset

from tpukit._xla import versions

from _timing import CountingListener, busy_jiffies, interval, others_share, rotated

STEPS = int(os.environ.get("BENCH_STEPS", "60"))
REPS = int(os.environ.get("BENCH_REPS", "30"))  # per-repetition ratios spread by +-8% here: 30 pin the median
WARMUP = 8
BATCH, DIM, HIDDEN = 128, 256, 1024
TARGET = 1.02
QUIET = float(os.environ.get("BENCH_QUIET", "0.05"))  # max CPU share of other processes in a usable rep
MIN_QUIET = 5
# "idiomatic_again" is the idiomatic loop run a second time in each repetition: idiomatic_again/idiomatic is
# the A/A ratio, how far one loop differs from itself here, the noise floor of the ratios above.
LOOPS = ("bare", "idiomatic", "tpukit", "idiomatic_again")
DEVICE = torch_xla.device()


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10)).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    n = STEPS * BATCH
    ds = TensorDataset(torch.randn(n, DIM, generator=g), torch.randint(0, 10, (n,), generator=g))
    loader = DataLoader(ds, batch_size=BATCH, drop_last=True)
    warm = DataLoader(torch.utils.data.Subset(ds, range(WARMUP * BATCH)), batch_size=BATCH, drop_last=True)
    return model, opt, loader, warm


def step(model, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    xm.optimizer_step(opt)
    return loss


def bare(model, opt, loader):
    """Synchronous copies, one sync per step."""
    times = []
    cpu0, th0 = time.process_time(), time.thread_time()
    t0 = start = time.perf_counter()
    for x, y in loader:
        x, y = x.to(DEVICE), y.to(DEVICE)
        step(model, opt, x, y)
        torch_xla.sync()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    xm.wait_device_ops()
    return times, time.perf_counter() - start, time.process_time() - cpu0, time.thread_time() - th0


def idiomatic(model, opt, loader):
    """The guide's loop: MpDeviceLoader (background copies, syncs before each batch) + optimizer_step."""
    times = []
    cpu0, th0 = time.process_time(), time.thread_time()
    t0 = start = time.perf_counter()
    for x, y in pl.MpDeviceLoader(loader, DEVICE):
        step(model, opt, x, y)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    xm.wait_device_ops()
    return times, time.perf_counter() - start, time.process_time() - cpu0, time.thread_time() - th0


class TpuAnswers:
    """With a target set: each graph's answer from the TPU compiler's worker, and when it arrived."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []

    def on_tpu_estimate(self, event, est):
        self.lines.append((time.perf_counter(), f"{event.name}: {tpukit.tpu.line(est)}"))


TPU_ANSWERS = TpuAnswers()
if rt.target:
    tpukit.add_listener(TPU_ANSWERS)

TRACKERS: list = []
# Added around the tpukit loop only: a listener with on_step also makes records of
# syncs outside track(), which would put tpukit's sync hook into the other loops.
LISTENER = CountingListener()


def tracked(model, opt, loader):
    """tpukit: track + log every step + a listener (tracing is on for the whole process)."""
    times = []
    cpu0, th0 = time.process_time(), time.thread_time()
    t0 = start = time.perf_counter()
    tpukit.add_listener(LISTENER)
    tr = tpukit.track(loader, progress=False)
    for x, y in tr:
        loss = step(model, opt, x, y)
        tpukit.log(loss=loss)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    xm.wait_device_ops()  # track already waited for the device at the end of the loop
    tpukit.remove_listener(LISTENER)
    TRACKERS.append(tr)
    return times, time.perf_counter() - start, time.process_time() - cpu0, time.thread_time() - th0


RUN = {"bare": bare, "idiomatic": idiomatic, "tpukit": tracked, "idiomatic_again": idiomatic}


def main() -> int:
    med = statistics.median
    model, opt, loader, warm = make()
    for name in LOOPS:  # warm-up: every graph compiled, threads and caches hot
        RUN[name](model, opt, warm)
    TRACKERS.clear()
    LISTENER.steps = 0
    reps = []
    timed_from = time.perf_counter()
    print(f"{REPS} repetitions of {STEPS} steps, loops in rotating order", flush=True)
    for r in range(REPS):
        order = rotated(LOOPS, r)
        rep: dict = {}
        j0, w0 = busy_jiffies(), time.perf_counter()
        for name in order:
            times, total, cpu, loop_cpu = RUN[name](model, opt, loader)
            assert len(times) == STEPS, (name, len(times))
            rep[name] = {
                # steady: from the end of step 1 until the device is idle after the last step, per step
                # (loop start-up excluded, the device's tail included: the loop's throughput)
                "steady_ms": (total - times[0]) / (STEPS - 1) * 1e3,
                "step_median_ms": med(times[1:]) * 1e3,  # median host interval between step ends
                "whole_ms": total / STEPS * 1e3,         # the whole run incl. start-up, per step
                "cpu_ms": cpu / STEPS * 1e3,             # CPU of the whole process (XLA:CPU's threads too)
                "loop_thread_cpu_ms": loop_cpu / STEPS * 1e3,
            }
        rep["others"] = others_share(j0, busy_jiffies(), time.perf_counter() - w0)
        rep["quiet"] = rep["others"] is None or rep["others"] <= QUIET
        reps.append(rep)
        b, i, t, i2 = (rep[k]["steady_ms"] for k in LOOPS)
        load = "" if rep["others"] is None else f"   other processes {rep['others']:.0%} of the CPUs"
        print(f"rep {r + 1:2d}: bare {b:6.2f}  idiomatic {i:6.2f}  tpukit {t:6.2f} ms/step   "
              f"tpukit/bare {t / b:.3f}  tpukit/idiomatic {t / i:.3f}  A/A {i2 / i:.3f}{load}", flush=True)

    quiet = [r for r in reps if r["quiet"]]
    used = quiet if len(quiet) >= MIN_QUIET else reps

    def ratios(base: str, key: str = "steady_ms", of: str = "tpukit") -> list[float]:
        return [r[of][key] / r[base][key] for r in used]

    def per_loop(key: str) -> dict:
        return {k: med(r[k][key] for r in used) for k in LOOPS}

    summaries = [tr.summary() for tr in TRACKERS]
    compiles = sum(s["compiles"] for s in summaries)
    if compiles:
        print(f"warning: the timed tpukit loops compiled {compiles} times; the ratios include that")
    steady = per_loop("steady_ms")
    result = {
        "bare_ms_median": steady["bare"],
        "idiomatic_ms_median": steady["idiomatic"],
        "tpukit_ms_median": steady["tpukit"],
        "ratio_median": med(ratios("bare")),
        "ratio_idiomatic_median": med(ratios("idiomatic")),
        "ratio_interval_90": interval(ratios("bare")),
        "ratio_idiomatic_interval_90": interval(ratios("idiomatic")),
        "ratios": ratios("bare"),
        "ratios_idiomatic": ratios("idiomatic"),
        # A/A: the idiomatic loop against itself in the same repetition (the noise floor of the ratios)
        "aa_ratio_median": med(ratios("idiomatic", of="idiomatic_again")),
        "aa_ratio_interval_90": interval(ratios("idiomatic", of="idiomatic_again")),
        "aa_ratios": ratios("idiomatic", of="idiomatic_again"),
        "metric": ("steady time per step: from the end of step 1 until the device is idle after the last "
                   "step, over steps - 1; ratios are per repetition (the loops run back to back), "
                   "then the median"),
        "step_median_ratio_median": med(ratios("bare", "step_median_ms")),
        "step_median_ratio_idiomatic_median": med(ratios("idiomatic", "step_median_ms")),
        "whole_run_ratio_median": med(ratios("bare", "whole_ms")),
        "whole_run_ratio_idiomatic_median": med(ratios("idiomatic", "whole_ms")),
        "cpu_ratio_median": med(ratios("bare", "cpu_ms")),
        "cpu_ratio_idiomatic_median": med(ratios("idiomatic", "cpu_ms")),
        "step_median_ms": per_loop("step_median_ms"),
        "whole_run_ms_per_step": per_loop("whole_ms"),
        "cpu_ms_per_step": per_loop("cpu_ms"),
        "loop_thread_cpu_ms_per_step": per_loop("loop_thread_cpu_ms"),
        "reps_used": len(used),
        "reps_quiet": len(quiet),
        "quiet_rule": (f"a repetition counts when other processes used at most {QUIET:.0%} of the CPUs while it ran; "
                       f"all repetitions are used when fewer than {MIN_QUIET} were quiet"),
        "repetitions": reps,
        "loops": {
            "bare": "for x, y in loader: x.to(device), y.to(device); step; torch_xla.sync()",
            "idiomatic": "for x, y in MpDeviceLoader(loader, device): step (xm.optimizer_step), no other sync",
            "tpukit": "for x, y in tpukit.track(loader): step; tpukit.log(loss=loss); a listener; "
                      "compile tracing + HLO dump on (tpukit.setup())",
            "idiomatic_again": "the idiomatic loop again, in the same repetition (A/A)",
        },
        "step": "zero_grad, cross_entropy(model(x), y), backward, xm.optimizer_step(opt)",
        "steps_per_rep": STEPS,
        "reps": REPS,
        "model": f"MLP {DIM}-{HIDDEN}-{HIDDEN}-10, batch {BATCH}, AdamW, DataLoader(TensorDataset), num_workers=0",
        "listener_steps": LISTENER.steps,
        "tpukit_compiles_in_timed_reps": compiles,
        "tpukit_recompilations_in_timed_reps": sum(s["recompilations"] for s in summaries),
        "tpukit_bottleneck": summaries[-1]["bottleneck"] if summaries else None,
        "tpukit_shares": summaries[-1]["shares"] if summaries else {},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, XLA:CPU, torch_xla {rt.versions['torch_xla']}",
        "target": f"ratio_median <= {TARGET} and ratio_idiomatic_median <= {TARGET}",
        "tpu_target": rt.target,
        "tpu_estimates": [text for _, text in TPU_ANSWERS.lines] if rt.target else None,
        "tpu_answers_during_timed_reps": sum(t >= timed_from for t, _ in TPU_ANSWERS.lines) if rt.target else None,
    }
    assert LISTENER.steps == REPS * STEPS, LISTENER.steps

    which = (f"the {len(used)} quiet repetitions" if used is quiet
             else f"all {len(used)} repetitions (only {len(quiet)} were quiet: the machine was busy)")
    print(f"\nmedians over {which}")
    rows = [("bare (x.to(device), sync)", "bare"), ("idiomatic (MpDeviceLoader)", "idiomatic"),
            ("tpukit (track + log + listener)", "tpukit"), ("idiomatic again (A/A)", "idiomatic_again")]
    cols = (("steady", "steady_ms"), ("median step", "step_median_ms"), ("whole run", "whole_ms"),
            ("CPU", "cpu_ms"), ("loop thread CPU", "loop_thread_cpu_ms"))
    print(f"{'ms per step':34s} " + " ".join(f"{c:>15s}" for c, _ in cols))
    for label, k in rows:
        print(f"{label:34s} " + " ".join(f"{per_loop(key)[k]:15.2f}" for _, key in cols))
    print(f"\n{'ratio (median per repetition)':34s} " + " ".join(f"{c:>15s}" for c, _ in cols[:4])
          + f" {'steady, range':>18s} {'steady, 90% interval':>22s}")
    for label, base, of in (("tpukit / bare", "bare", "tpukit"), ("tpukit / idiomatic", "idiomatic", "tpukit"),
                            ("A/A: idiomatic again / idiomatic", "idiomatic", "idiomatic_again")):
        rs = ratios(base, of=of)
        lo, hi = interval(rs)
        print(f"{label:34s} " + " ".join(f"{med(ratios(base, key, of)):15.3f}" for _, key in cols[:4])
              + f" {min(rs):8.3f} to {max(rs):.3f} {lo:12.3f} to {hi:.3f}")
    if rt.target:
        print(f"\nthe TPU compiler's worker answered for {len(TPU_ANSWERS.lines)} graphs "
              f"({result['tpu_answers_during_timed_reps']} of them while the timed repetitions ran):")
        for _, text in TPU_ANSWERS.lines:
            print(f"  {text}")
    ok = result["ratio_median"] <= TARGET and result["ratio_idiomatic_median"] <= TARGET
    print(f"target (steady ratios <= {TARGET}): {'met' if ok else 'NOT met'}")
    release = ".".join(map(str, versions.installed()))  # the stack's torch_xla: 2.8 (Kaggle) or 2.9 (Colab)
    out = Path(__file__).parent / "results" / f"overhead{'-' + rt.target if rt.target else ''}-torch_xla{release}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
