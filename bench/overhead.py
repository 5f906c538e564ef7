"""Overhead of tpukit on a training loop: bare torch_xla vs track + log + tracing + a listener.

Both loops run in the same process (compile tracing configured once, before
torch_xla starts), on the same model and data, alternating, with warm-up
excluded. Prints a table and writes bench/results/overhead.json with the
median step-time ratio under ``ratio_median`` (target <= 1.03).
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

import tpukit  # noqa: E402

rt = tpukit.setup(device="cpu")  # tracing on, before torch_xla is imported

import torch  # noqa: E402
from tpukit import _xla  # noqa: E402

STEPS = int(os.environ.get("BENCH_STEPS", 60))
REPS = int(os.environ.get("BENCH_REPS", 7))
BATCH, DIM, HIDDEN = 128, 256, 1024


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10)).to(rt.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(BATCH, DIM, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(STEPS)]
    return model, opt, data


def step(model, opt, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def bare(model, opt, data):
    times = []
    t0 = time.perf_counter()
    for x, y in data:
        x, y = x.to(rt.device), y.to(rt.device)
        step(model, opt, x, y)
        _xla.sync()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    _xla.wait_device_ops()
    return times


class CountingListener:
    """Stands in for the dashboard: receives every record."""

    def __init__(self):
        self.steps = 0

    def on_step(self, rec):
        self.steps += 1


def tracked(model, opt, data):
    times = []
    t0 = time.perf_counter()
    for x, y in tpukit.track(data, progress=False):
        loss = step(model, opt, x, y)
        tpukit.log(loss=loss)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    _xla.wait_device_ops()
    return times


def main() -> int:
    listener = tpukit.add_listener(CountingListener())
    model, opt, data = make()
    bare(model, opt, data[:5])  # warm-up: both graphs compiled, caches hot
    tracked(model, opt, data[:5])
    rows = []
    for r in range(REPS):
        b = statistics.median(bare(model, opt, data)[1:])
        t = statistics.median(tracked(model, opt, data)[1:])
        rows.append((b, t))
        print(f"rep {r + 1}: bare {b * 1e3:7.2f} ms/step   tpukit {t * 1e3:7.2f} ms/step   ratio {t / b:.3f}", flush=True)
    ratios = [t / b for b, t in rows]
    result = {
        "bare_ms_median": statistics.median(b for b, _ in rows) * 1e3,
        "tpukit_ms_median": statistics.median(t for _, t in rows) * 1e3,
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "steps_per_rep": STEPS,
        "reps": REPS,
        "model": f"MLP {DIM}-{HIDDEN}-{HIDDEN}-10, batch {BATCH}, AdamW",
        "listener_steps": listener.steps,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, XLA:CPU, torch_xla {rt.versions['torch_xla']}",
        "target": "ratio_median <= 1.03",
    }
    print(f"\nmedian step: bare {result['bare_ms_median']:.2f} ms, tpukit {result['tpukit_ms_median']:.2f} ms, "
          f"ratio {result['ratio_median']:.3f} (target <= 1.03)")
    out = Path(__file__).parent / "results" / "overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
