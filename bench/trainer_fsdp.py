"""What ``tpukit.hf.Callback()`` costs a Hugging Face ``Trainer`` running torch_xla's FSDPv2, on XLA:CPU.

The Trainer as the Hugging Face docs give it for a decoder on TPU (``fsdp="full_shard"``,
``fsdp_config={"xla": True, "xla_fsdp_v2": True, "xla_fsdp_grad_ckpt": True,
"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}``), a tiny Llama (the test scenario's:
2 layers, hidden 64, vocabulary 256), batch 8 of 32 tokens, on 8 virtual XLA:CPU devices under SPMD
(``tpukit.setup(cpu_devices=8, spmd=True)``), in one process, three ways per repetition:

  without    the Trainer and ``tpukit.hf.checks.fix_fsdp_xla_optimizer(trainer)``: transformers 5.x's
             FSDP-XLA Trainer makes no optimizer and fails before the first step without it (see
             tpukit/hf/checks.py, FSDP_XLA_OPTIMIZER), so no run without the kit at all can start;
  callback   the Trainer with ``callbacks=[tpukit.hf.Callback(dashboard=False)]`` (which applies that fix
             itself), its checks, a step record per optimizer step and compile tracing (on for all three:
             ``tpukit.setup()`` configures it before torch_xla starts);
  without_again  the first way again: the A/A ratio, how far one way differs from itself here.

Each way is a fresh model and Trainer of ``STEPS`` optimizer steps (logging every 10); a warm-up repetition
compiles every graph first, so the timed ones compile nothing (checked: the count of compiles is reported).
The measure is the steady time per step: from the end of step ``WARM`` until the end of the last step
(a TrainerCallback's ``on_step_end``, the device waited for at the end), over those steps; beside it the
process's CPU time per step over the same steps (the host's work and XLA:CPU's device threads: less
moved by other jobs on a shared machine than the wall time). Ratios are
taken per repetition (callback / without, without_again / without), then their median with a bootstrap 90%
interval (as bench/overhead.py does), order rotating between repetitions. Writes
bench/results/trainer_fsdp.json; target: callback / without <= 1.02.

    python bench/trainer_fsdp.py          # BENCH_REPS=7 BENCH_STEPS=24: a few minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")

import tpukit  # noqa: E402

rt = tpukit.setup(cpu_devices=8, spmd=True)

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import tpukit.hf  # noqa: E402
from tpukit import _xla  # noqa: E402

from _timing import interval  # noqa: E402  (the bootstrap interval bench/overhead.py and fsdp_loop.py use)

REPS = int(os.environ.get("BENCH_REPS", "7"))
STEPS = int(os.environ.get("BENCH_STEPS", "24"))
WARM = 4
TARGET = 1.02
WAYS = ("without", "callback", "without_again")
OUT = Path(__file__).resolve().parent / "results" / "trainer_fsdp.json"


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 8 * STEPS

    def __getitem__(self, i):
        ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Clock(TrainerCallback):
    """The time at the end of each optimizer step."""

    def __init__(self):
        self.ends: list[float] = []
        self.cpu: list[float] = []  # this process's CPU time (its host work and XLA:CPU's device threads)

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def on_train_end(self, args, state, control, **kwargs):
        _xla.sync()
        _xla.wait_device_ops()
        self.ends[-1] = time.perf_counter()  # the last step's end: the device idle after it
        self.cpu[-1] = time.process_time()


def run(way: str) -> dict:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, max_steps=STEPS, logging_steps=10, report_to=[],
        save_strategy="no", dataloader_drop_last=True, optim="adamw_torch", learning_rate=1e-3, disable_tqdm=True,
        fsdp="full_shard", fsdp_config={"xla": True, "xla_fsdp_v2": True, "xla_fsdp_grad_ckpt": True,
                                        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    clock = Clock()
    callbacks = [clock] + ([tpukit.hf.Callback(dashboard=False)] if way == "callback" else [])
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    if way != "callback":
        tpukit.hf.checks.fix_fsdp_xla_optimizer(trainer)  # without it this Trainer does not start
    before = tpukit.snapshot()
    trainer.train()
    compiles = (tpukit.snapshot() - before).compiles
    n = len(clock.ends) - WARM
    steady = (clock.ends[-1] - clock.ends[WARM - 1]) / n
    cpu = (clock.cpu[-1] - clock.cpu[WARM - 1]) / n
    print(f"{way}: {1000 * steady:.1f} ms/step, {1000 * cpu:.1f} ms CPU/step", file=sys.stderr, flush=True)
    return {"steady_ms": 1000 * steady, "cpu_ms": 1000 * cpu, "compiles": compiles, "steps": len(clock.ends)}


def main() -> int:
    began = time.perf_counter()
    warm = {w: run(w) for w in WAYS}  # compiles every graph
    reps = []
    for r in range(REPS):
        order = WAYS[r % 3:] + WAYS[:r % 3]
        reps.append({w: run(w) for w in order})
    ratio = [x["callback"]["steady_ms"] / x["without"]["steady_ms"] for x in reps]
    aa = [x["without_again"]["steady_ms"] / x["without"]["steady_ms"] for x in reps]
    cpu_ratio = [x["callback"]["cpu_ms"] / x["without"]["cpu_ms"] for x in reps]
    cpu_aa = [x["without_again"]["cpu_ms"] / x["without"]["cpu_ms"] for x in reps]
    result = {
        "bench": "trainer_fsdp", "python": platform.python_version(), "torch_xla": rt.versions["torch_xla"],
        "transformers": transformers.__version__, "devices": _xla.device_count(), "reps": REPS, "steps": STEPS,
        "warm_steps": WARM, "per_way_steady_ms_median": {w: round(statistics.median(x[w]["steady_ms"] for x in reps), 2)
                                                          for w in WAYS},
        "compiles_in_timed_reps": sum(x[w]["compiles"] for x in reps for w in WAYS),
        "compiles_in_warmup": {w: warm[w]["compiles"] for w in WAYS},
        "ratio_callback_over_without_median": round(statistics.median(ratio), 4),
        "ratio_callback_over_without_90": [round(v, 4) for v in interval(ratio)],
        "ratio_aa_median": round(statistics.median(aa), 4), "ratio_aa_90": [round(v, 4) for v in interval(aa)],
        "per_way_cpu_ms_median": {w: round(statistics.median(x[w]["cpu_ms"] for x in reps), 2) for w in WAYS},
        "ratio_cpu_callback_over_without_median": round(statistics.median(cpu_ratio), 4),
        "ratio_cpu_callback_over_without_90": [round(v, 4) for v in interval(cpu_ratio)],
        "ratio_cpu_aa_median": round(statistics.median(cpu_aa), 4),
        "ratio_cpu_aa_90": [round(v, 4) for v in interval(cpu_aa)],
        "ratios": [round(v, 4) for v in ratio], "aa_ratios": [round(v, 4) for v in aa], "target": TARGET,
        "load_average": os.getloadavg(), "seconds": round(time.perf_counter() - began, 1),
        "note": "without the callback the FSDP-XLA Trainer needs tpukit.hf.checks.fix_fsdp_xla_optimizer(trainer) "
                "to start at all (transformers 5.x makes it no optimizer)",
    }
    print(f"{'way':16} steady ms/step, CPU ms/step (medians of {REPS})")
    for w in WAYS:
        print(f"{w:16} {result['per_way_steady_ms_median'][w]:.1f}  {result['per_way_cpu_ms_median'][w]:.1f}")
    print(f"callback / without: {result['ratio_callback_over_without_median']} "
          f"(90% {result['ratio_callback_over_without_90']}); A/A: {result['ratio_aa_median']} "
          f"(90% {result['ratio_aa_90']}); CPU time: {result['ratio_cpu_callback_over_without_median']} "
          f"(90% {result['ratio_cpu_callback_over_without_90']}), A/A {result['ratio_cpu_aa_median']}; "
          f"target <= {TARGET}; compiles in timed reps: "
          f"{result['compiles_in_timed_reps']}; {result['seconds']} s")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
