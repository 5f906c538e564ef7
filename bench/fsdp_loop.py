"""What the kit's FSDPv2 loop costs, against the loop torch_xla's FSDPv2 examples write, on XLA:CPU.

The same decoder (transformers' Llama, tiny: the test scenario's, 2 layers of hidden 64, vocabulary 256),
each decoder layer wrapped and checkpointed, batch 16 of 32 tokens, plain SGD, on 8 virtual XLA:CPU devices
under SPMD (``tpukit.setup(cpu_devices=8, spmd=True)``: compile tracing and the HLO dump on for every loop),
in one process, three loops per repetition:

  idiomatic   torch_xla by hand: ``SpmdFullyShardedDataParallel(model, mesh=..., shard_output=...,
              auto_wrap_policy=transformer_auto_wrap_policy({LlamaDecoderLayer}),
              auto_wrapper_callable=<checkpoint_module, then the wrapper>)``, ``MpDeviceLoader(loader, device,
              input_sharding=ShardingSpec(mesh, ("fsdp", None)))``, ``optimizer.step()``, ``torch_xla.sync()``;
  tpukit      ``tpukit.fsdp(model, mesh, checkpoint=True)``, ``tpukit.track(loader, mesh=mesh)``,
              ``tpukit.log(loss=loss)`` every step, and a listener receiving every record (the dashboard's
              place);
  idiomatic_again  the first loop again: the A/A ratio, how far one loop differs from itself here.

Each loop has its own model (the same initial weights) and optimizer, wrapped once; the graphs are the same
(the kit marks the ModelOutput's logits and each layer's output as the idiomatic loop's ``shard_output`` does).
A warm-up compiles every graph first; the timed repetitions compile nothing (checked). The measure is each
loop's steady time per step, as in bench/overhead.py (whose helpers, bench/_timing.py, this uses): from the
end of its first step until the device is idle after its last one, over the remaining steps; ratios per
repetition (tpukit / idiomatic, idiomatic_again / idiomatic), loops in rotating order, then their median with a
bootstrap 90% interval, over the repetitions during which other processes used at most 5% of the CPUs (all
of them when fewer than 5 were quiet). Writes bench/results/fsdp_loop-torch_xla<release>.json; target:
tpukit / idiomatic <= 1.02.

    python bench/fsdp_loop.py          # BENCH_REPS=12 BENCH_STEPS=20: a few minutes on 2 cores
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")

import tpukit  # noqa: E402

rt = tpukit.setup(cpu_devices=8, spmd=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.distributed.parallel_loader as pl  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import transformers  # noqa: E402
from torch_xla.distributed.fsdp import checkpoint_module  # noqa: E402
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy  # noqa: E402
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

from tpukit._xla import versions  # noqa: E402

from _timing import CountingListener, busy_jiffies, interval, others_share, rotated  # noqa: E402

REPS = int(os.environ.get("BENCH_REPS", "12"))
STEPS = int(os.environ.get("BENCH_STEPS", "20"))
WARMUP = 3
BATCH, SEQ, LR = 16, 32, 1.0
TARGET = 1.02
QUIET = float(os.environ.get("BENCH_QUIET", "0.05"))
MIN_QUIET = 5
LOOPS = ("idiomatic", "tpukit", "idiomatic_again")
DEVICE = torch_xla.device()


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


class Counting(torch.utils.data.Dataset):
    """Runs of consecutive tokens from random starts (tests/scenarios/llm_fsdp.py's data)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        start = int(torch.randint(0, 256, (1,), generator=torch.Generator().manual_seed(i)))
        ids = (torch.arange(SEQ) + start) % 256
        return {"input_ids": ids, "labels": ids}


def loader(steps: int):
    return torch.utils.data.DataLoader(Counting(steps * BATCH), batch_size=BATCH, drop_last=True)


# --------------------------------------------------------------------------- torch_xla's FSDPv2, by hand

XLA_MESH = xs.Mesh(np.arange(rt.device_count), (rt.device_count,), ("fsdp",))


def shard_output(output, mesh):
    """The examples' and transformers' Trainer's: the logits (a layer's output: itself) split by batch."""
    real = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if real is None and isinstance(output, tuple):
        real = output[0]
    xs.mark_sharding(real, mesh, ("fsdp",) + (None,) * (real.dim() - 1))


def idiomatic_model():
    model = llama()
    model.config.use_cache = False  # as the Trainer does for xla_fsdp_grad_ckpt
    wrapped = SpmdFullyShardedDataParallel(
        model, mesh=XLA_MESH, shard_output=shard_output,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
        auto_wrapper_callable=lambda m, *a, **kw: SpmdFullyShardedDataParallel(checkpoint_module(m), *a, **kw))
    return wrapped, torch.optim.SGD(wrapped.parameters(), lr=LR)


def idiomatic(wrapped, opt, data):
    """MpDeviceLoader with the batch sharding, the step, optimizer.step(), torch_xla.sync()."""
    times = []
    cpu0, th0 = time.process_time(), time.thread_time()
    t0 = start = time.perf_counter()
    for batch in pl.MpDeviceLoader(data, DEVICE, input_sharding=xs.ShardingSpec(XLA_MESH, ("fsdp", None))):
        opt.zero_grad()
        loss = wrapped(**batch).loss
        loss.backward()
        opt.step()
        torch_xla.sync()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    xm.wait_device_ops()
    return times, time.perf_counter() - start, time.process_time() - cpu0, time.thread_time() - th0


# --------------------------------------------------------------------------- the kit's

MESH = tpukit.mesh()
LISTENER = CountingListener()
TRACKERS: list = []


def kit_model():
    wrapped = tpukit.fsdp(llama(), MESH, checkpoint=True)
    return wrapped, torch.optim.SGD(wrapped.parameters(), lr=LR)


def tracked(wrapped, opt, data):
    """tpukit.track(loader, mesh=mesh) + tpukit.log(loss=loss) + a listener."""
    times = []
    cpu0, th0 = time.process_time(), time.thread_time()
    t0 = start = time.perf_counter()
    tpukit.add_listener(LISTENER)
    tr = tpukit.track(data, mesh=MESH, progress=False)
    for batch in tr:
        opt.zero_grad()
        loss = wrapped(**batch).loss
        loss.backward()
        opt.step()
        tpukit.log(loss=loss)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    xm.wait_device_ops()  # track already waited for the device at the end of the loop
    tpukit.remove_listener(LISTENER)
    TRACKERS.append(tr)
    return times, time.perf_counter() - start, time.process_time() - cpu0, time.thread_time() - th0


RUN = {"idiomatic": idiomatic, "tpukit": tracked, "idiomatic_again": idiomatic}


def main() -> int:
    med = statistics.median
    models = {"idiomatic": idiomatic_model(), "tpukit": kit_model()}
    models["idiomatic_again"] = models["idiomatic"]  # the same loop, model and graph: A/A
    warm = loader(WARMUP)
    first = {}
    for name in LOOPS:  # warm-up: every graph compiled, threads and caches hot
        RUN[name](*models[name], warm)
    first["tpukit"] = [r.scalars.get("loss") for r in TRACKERS[0].history]
    TRACKERS.clear()
    LISTENER.steps = 0
    data = loader(STEPS)
    compiles0 = _xla_compiles()
    reps = []
    print(f"{REPS} repetitions of {STEPS} steps, loops in rotating order", flush=True)
    for r in range(REPS):
        rep: dict = {}
        j0, w0 = busy_jiffies(), time.perf_counter()
        for name in rotated(LOOPS, r):
            times, total, cpu, loop_cpu = RUN[name](*models[name], data)
            assert len(times) == STEPS, (name, len(times))
            rep[name] = {
                "steady_ms": (total - times[0]) / (STEPS - 1) * 1e3,
                "step_median_ms": med(times[1:]) * 1e3,
                "whole_ms": total / STEPS * 1e3,
                "cpu_ms": cpu / STEPS * 1e3,
                "loop_thread_cpu_ms": loop_cpu / STEPS * 1e3,
            }
        rep["others"] = others_share(j0, busy_jiffies(), time.perf_counter() - w0)
        rep["quiet"] = rep["others"] is None or rep["others"] <= QUIET
        reps.append(rep)
        i, t, i2 = (rep[k]["steady_ms"] for k in LOOPS)
        load = "" if rep["others"] is None else f"   other processes {rep['others']:.0%} of the CPUs"
        print(f"rep {r + 1:2d}: idiomatic {i:7.2f}  tpukit {t:7.2f} ms/step   tpukit/idiomatic {t / i:.3f}  "
              f"A/A {i2 / i:.3f}{load}", flush=True)
    compiled = _xla_compiles() - compiles0

    quiet = [r for r in reps if r["quiet"]]
    used = quiet if len(quiet) >= MIN_QUIET else reps

    def ratios(key: str = "steady_ms", of: str = "tpukit") -> list[float]:
        return [r[of][key] / r["idiomatic"][key] for r in used]

    def per_loop(key: str) -> dict:
        return {k: med(r[k][key] for r in used) for k in LOOPS}

    summaries = [tr.summary(wait=0) for tr in TRACKERS]
    steady = per_loop("steady_ms")
    result = {
        "idiomatic_ms_median": steady["idiomatic"],
        "tpukit_ms_median": steady["tpukit"],
        "ratio_median": med(ratios()),
        "ratio_interval_90": interval(ratios()),
        "ratios": ratios(),
        "aa_ratio_median": med(ratios(of="idiomatic_again")),
        "aa_ratio_interval_90": interval(ratios(of="idiomatic_again")),
        "aa_ratios": ratios(of="idiomatic_again"),
        "metric": ("steady time per step: from the end of step 1 until the device is idle after the last step, "
                   "over steps - 1; ratios are per repetition (the loops run back to back), then the median"),
        "step_median_ratio_median": med(ratios("step_median_ms")),
        "whole_run_ratio_median": med(ratios("whole_ms")),
        "cpu_ratio_median": med(ratios("cpu_ms")),
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
            "idiomatic": "SpmdFullyShardedDataParallel (per-layer auto-wrap, checkpoint_module) + MpDeviceLoader "
                         "with input_sharding + optimizer.step() + torch_xla.sync()",
            "tpukit": "tpukit.fsdp(model, mesh, checkpoint=True) + tpukit.track(loader, mesh=mesh) + "
                      "tpukit.log(loss=loss) + a listener",
            "idiomatic_again": "the idiomatic loop again, in the same repetition (A/A)",
        },
        "steps_per_rep": STEPS,
        "reps": REPS,
        "devices": rt.device_count,
        "model": (f"LlamaForCausalLM 2 layers, hidden 64, vocabulary 256, batch {BATCH} x {SEQ} tokens, SGD, "
                  "each decoder layer wrapped and checkpointed"),
        "warmup_losses_tpukit": first["tpukit"],
        "listener_steps": LISTENER.steps,
        "compiles_in_timed_reps": compiled,
        "tpukit_recompilations_in_timed_reps": sum(s["recompilations"] for s in summaries),
        "tpukit_bottleneck": summaries[-1]["bottleneck"] if summaries else None,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, XLA:CPU, torch_xla {rt.versions['torch_xla']}, "
                   f"transformers {transformers.__version__}",
        "target": f"ratio_median <= {TARGET}",
    }
    assert LISTENER.steps == REPS * STEPS, LISTENER.steps

    which = (f"the {len(used)} quiet repetitions" if used is quiet
             else f"all {len(used)} repetitions (only {len(quiet)} were quiet: the machine was busy)")
    print(f"\nmedians over {which}; {compiled} compiles in the timed repetitions")
    cols = (("steady", "steady_ms"), ("median step", "step_median_ms"), ("whole run", "whole_ms"),
            ("CPU", "cpu_ms"), ("loop thread CPU", "loop_thread_cpu_ms"))
    print(f"{'ms per step':34s} " + " ".join(f"{c:>15s}" for c, _ in cols))
    for label, k in (("idiomatic (FSDPv2 + MpDeviceLoader)", "idiomatic"), ("tpukit (fsdp + track + log)", "tpukit"),
                     ("idiomatic again (A/A)", "idiomatic_again")):
        print(f"{label:34s} " + " ".join(f"{per_loop(key)[k]:15.2f}" for _, key in cols))
    print(f"\n{'ratio (median per repetition)':34s} " + " ".join(f"{c:>15s}" for c, _ in cols[:4])
          + f" {'steady, range':>18s} {'steady, 90% interval':>22s}")
    for label, of in (("tpukit / idiomatic", "tpukit"), ("A/A: idiomatic again / idiomatic", "idiomatic_again")):
        rs = ratios(of=of)
        lo, hi = interval(rs)
        print(f"{label:34s} " + " ".join(f"{med(ratios(key, of)):15.3f}" for _, key in cols[:4])
              + f" {min(rs):8.3f} to {max(rs):.3f} {lo:12.3f} to {hi:.3f}")
    ok = result["ratio_median"] <= TARGET
    print(f"target (steady ratio <= {TARGET}): {'met' if ok else 'NOT met'}")
    release = ".".join(map(str, versions.installed()))
    out = Path(__file__).parent / "results" / f"fsdp_loop-torch_xla{release}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _xla_compiles() -> int:
    """torch_xla's count of compiles in this process (every loop's, the idiomatic ones too)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


if __name__ == "__main__":
    sys.exit(main())
