"""SPMD data-parallel scaling: steps/s of one MLP at 1, 2 and 4 virtual XLA devices.

Each device count runs in its own subprocess, because the number of devices is
fixed when the XLA runtime starts. Every run trains the same MLP on the same
data with the same global batch (strong scaling: the batch is split over the
devices with ``tpukit.shard_batch``); compilation and warm-up steps are excluded
from the timing. Prints a table and writes ``bench/results/spmd_scaling.json``.

On XLA:CPU the "devices" are virtual: they share this machine's cores, so more
of them add partitioning and all-reduce overhead rather than speed. The numbers
measure that overhead; on a TPU each device is a separate chip.

    python bench/spmd_scaling.py [--devices 1 2 4] [--steps 25]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "spmd_scaling.json")
MODEL = {"input": 256, "hidden": 1024, "layers": 2, "classes": 10, "global_batch": 256}
WARMUP = 3  # step 1 compiles the graph (and creates optimizer state), step 2 the steady graph
BLOCKS = 3  # timed blocks per device count; the table shows the best and the median


def worker(devices: int, steps: int) -> dict:
    """One measurement in this process: start the runtime with ``devices`` virtual devices."""
    import tpukit
    from tpukit import _xla
    from tpukit import parallel as par

    rt = tpukit.setup(device="cpu", cpu_devices=devices, spmd=True, trace_compiles=False)
    import torch

    torch.manual_seed(0)
    layers, width = [], MODEL["input"]
    for _ in range(MODEL["layers"]):
        layers += [torch.nn.Linear(width, MODEL["hidden"]), torch.nn.ReLU()]
        width = MODEL["hidden"]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, MODEL["classes"])).to(_xla.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mesh = par.mesh()
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(MODEL["global_batch"], MODEL["input"], generator=gen),
             torch.randint(0, MODEL["classes"], (MODEL["global_batch"],), generator=gen)) for _ in range(4)]

    def step(i: int):
        x, y = par.shard_batch(data[i % len(data)], mesh)  # host-to-device copy is part of a step
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        _xla.sync()
        return loss

    t0 = time.perf_counter()
    for i in range(WARMUP):
        loss = step(i)
    _xla.wait_device_ops()
    warmup = time.perf_counter() - t0
    blocks, i = [], WARMUP
    for _ in range(BLOCKS):  # best block = least disturbed by other load on a shared machine
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step(i)
            i += 1
        _xla.wait_device_ops()
        blocks.append(time.perf_counter() - t0)
    best, median = min(blocks), sorted(blocks)[len(blocks) // 2]
    return {"devices": rt.device_count, "steps_per_block": steps, "block_seconds": [round(b, 4) for b in blocks],
            "steps_per_s": round(steps / best, 3), "median_steps_per_s": round(steps / median, 3),
            "ms_per_step": round(1000 * best / steps, 2),
            "warmup_s": round(warmup, 2), "final_loss": round(float(loss.item()), 6),
            "batch_spec": par.sharding_spec(par.shard_batch(data[0][0], mesh))}


def run(devices: list[int], steps: int) -> dict:
    rows, load_before = [], round(os.getloadavg()[0], 2)
    for n in devices:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_XLA_DEBUG", "XLA_USE_SPMD"))}
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(n))
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(n), "--steps", str(steps)],
                              capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"the {n}-device run failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    base = rows[0]["steps_per_s"]
    for row in rows:
        row["speedup_vs_first"] = round(row["steps_per_s"] / base, 3)
    from importlib.metadata import version

    return {
        "benchmark": "spmd_scaling",
        "model": MODEL, "warmup_steps_excluded": WARMUP,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": version("torch"), "torch_xla": version("torch_xla")},
        "note": (f"XLA:CPU virtual devices share this machine's {os.cpu_count()} cores: more devices add "
                 "partitioning and all-reduce overhead, not speed. On a TPU each device is a separate chip."),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_before_after": [load_before, round(os.getloadavg()[0], 2)],
        "results": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=25, help="steps per timed block (3 blocks, after warm-up)")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps)))
        return
    t0 = time.time()
    report = run(args.devices, args.steps)
    print(f"SPMD data parallel, MLP {MODEL['input']}-{'-'.join([str(MODEL['hidden'])] * MODEL['layers'])}-"
          f"{MODEL['classes']}, global batch {MODEL['global_batch']}, best of {BLOCKS} blocks of {args.steps} steps "
          f"({WARMUP} warm-up steps excluded)")
    print(f"{'devices':>7}  {'steps/s':>8}  {'median':>8}  {'ms/step':>8}  {'vs 1st':>6}  {'warm-up s':>9}  "
          f"{'final loss':>10}  batch sharding")
    for r in report["results"]:
        print(f"{r['devices']:>7}  {r['steps_per_s']:>8.2f}  {r['median_steps_per_s']:>8.2f}  {r['ms_per_step']:>8.1f}  "
              f"{r['speedup_vs_first']:>6.2f}  {r['warmup_s']:>9.1f}  {r['final_loss']:>10.5f}  {r['batch_spec']}")
    print(f"note: {report['note']}")
    before, after = report["load_average_before_after"]
    if max(before, after) > (os.cpu_count() or 1):
        print(f"note: the machine was busy (load average {before} before, {after} after, on {os.cpu_count()} cores); "
              "other processes disturbed the timing.")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.relpath(RESULTS)} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
