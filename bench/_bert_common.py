"""Shared helpers of the BERT benchmarks (bench/buckets.py, bench/vs_trainer.py).

Each measured way runs in its own subprocess, because torch_xla's graph cache
lives as long as the process: a way run after another would find the other's
graphs already compiled. The parent re-invokes the bench script with
``--child WAY --out FILE``; the child calls :func:`start` (``tpukit.setup`` before
torch_xla or transformers are imported, so compile tracing is on), trains, and
writes its measurements as JSON to FILE.

Not a test helper: nothing here is imported by tests.

The BERT recipe at the compile floor (:func:`bert_mask`, i.e. ``tpukit.data.bert_mask``, and :func:`bert_inputs`):
transformers 5.x BERT turns the 2-D 0/1 ``attention_mask`` into the attention
bias in ``masking_utils.create_bidirectional_mask``. For ``sdpa`` *and* for
``eager`` attention that goes through ``sdpa_mask`` with
``allow_is_bidirectional_skip=True``, whose ``_ignore_bidirectional_mask_sdpa``
evaluates ``padding_mask.all()`` in Python (to drop the mask when nothing is
padded). On an XLA tensor that is a device-to-host read in the middle of the
forward: torch_xla compiles and runs a small graph for it (once per input
shape) and the host waits for it on every step. The attention implementation
alone does not avoid it (``eager_mask`` calls ``sdpa_mask`` with the same
skip). What does: passing a ready 4-D mask, which
``_preprocess_mask_arguments`` returns as-is ("If the mask is already 4D,
simply return as-is"), so no value is read and the mask is three elementwise
ops inside the step graph. The additive form (0 where attended, the dtype's
minimum on padding, shape ``(batch, 1, 1, length)``) is what both ``eager``
(``attn_weights + attention_mask``) and ``sdpa`` (float ``attn_mask``) expect;
the logits are identical to the 2-D mask's (checked on CPU, both
implementations).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "notebooks" / "data" / "sentiment_sample.tsv"
RESULTS = Path(__file__).resolve().parent / "results"

ENV = {"PJRT_DEVICE": "CPU", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
for _k, _v in ENV.items():
    os.environ.setdefault(_k, _v)

SEED = 0
LR = 5e-5
BATCH = 16
MAX_LENGTH = 64


# ------------------------------------------------------------------ parent side

def run_child(script: str, way: str, extra_env: dict | None = None, timeout: float = 900) -> dict:
    """Run ``script --child way`` in a fresh Python process; return its JSON (plus its process wall time)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = {**os.environ, **ENV, **(extra_env or {})}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, script, "--child", way, "--out", out], env=env,
                          capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    try:
        result = json.loads(Path(out).read_text()) if Path(out).stat().st_size else None
    finally:
        Path(out).unlink(missing_ok=True)
    if proc.returncode != 0 or result is None:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-25:])
        return {"way": way, "ok": False, "error": f"child exited with {proc.returncode}:\n{tail}",
                "process_s": wall}
    result["process_s"] = wall
    result["warnings"] = _interesting_lines(proc.stderr)
    return result


def load_raw() -> dict | None:
    """With BENCH_RAW=path naming an existing file: the children's results saved there by an
    earlier run (to redo the report without rerunning the ways); else None."""
    path = os.environ.get("BENCH_RAW")
    return json.loads(Path(path).read_text()) if path and Path(path).exists() else None


def keep_raw(results: dict) -> dict:
    """The children's results, saved to BENCH_RAW=path first when it is set."""
    path = os.environ.get("BENCH_RAW")
    if path:
        Path(path).write_text(json.dumps(results))
    return results


def _interesting_lines(stderr: str) -> list[str]:
    """Distinct warning lines a child printed (progress bars and load reports left out)."""
    seen: list[str] = []
    for line in stderr.splitlines():
        s = line.strip()
        if not s or s.startswith("warnings.warn(") or "it/s]" in s or "Loading weights" in s or s.startswith(("Key ", "---", "classifier.", "Notes:", "- MISSING")):
            continue
        if any(w in s.lower() for w in ("warn", "deprecat", "error", "not supported", "fallback")) and s not in seen:
            seen.append(s)
    return seen[:20]


def machine() -> dict:
    """The machine description every result file carries."""
    try:
        from importlib.metadata import version

        xla = version("torch_xla")
        torch_v = version("torch")
        tf = version("transformers")
    except Exception:  # pragma: no cover
        xla = torch_v = tf = "unknown"
    return {
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": "XLA:CPU (PJRT_DEVICE=CPU)",
        "python": platform.python_version(),
        "torch": torch_v,
        "torch_xla": xla,
        "transformers": tf,
        "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "note": ("shared 2-core machine with other jobs running: absolute times are noisy, ratios within one run "
                 "are what is reported. cpu_s is the process's CPU time over the same span (all threads, "
                 "including XLA's thread pools, so it can exceed the wall time when the cores are free): "
                 "a second view, not a cleaner one"),
    }


def fmt_s(x) -> str:
    return "n/a" if x is None else f"{x:.1f} s"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def write_json(name: str, result: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


# ------------------------------------------------------------------ data (no torch_xla needed)

def load_sample(n: int | None = None) -> tuple[list[str], list[int]]:
    """The first ``n`` examples of the shipped sentiment sample (the file is already shuffled)."""
    from tpukit import samples

    sample = samples.sentiment_sample(SAMPLE)
    return (sample.texts[:n], sample.labels[:n]) if n else (sample.texts, sample.labels)


def model_path() -> str:
    from tpukit import samples

    return samples.minilm_path()


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path())


def token_ids(tok, texts: list[str], max_length: int = MAX_LENGTH) -> list[list[int]]:
    """Unpadded word-piece ids, truncated to ``max_length``."""
    return tok(texts, truncation=True, max_length=max_length)["input_ids"]


# ------------------------------------------------------------------ the BERT recipe

def bert_mask(attention_mask, dtype=None):
    """The 2-D 0/1 padding mask as the 4-D additive mask transformers uses as-is: the library's
    ``tpukit.data.bert_mask`` (default float32; pass ``model.dtype`` for a model cast to bf16)."""
    import torch
    from tpukit import data

    return data.bert_mask(attention_mask, dtype or torch.float32)


def bert_inputs(batch: dict, dtype=None) -> dict:
    """``batch`` with its 2-D ``attention_mask`` replaced by :func:`bert_mask`'s 4-D one:
    ``model(**bert_inputs(batch))`` instead of ``model(**batch)``."""
    out = dict(batch)
    if out.get("attention_mask") is not None and out["attention_mask"].dim() == 2:
        out["attention_mask"] = bert_mask(out["attention_mask"], dtype)
    return out


# ------------------------------------------------------------------ child side

def start():
    """``tpukit.setup`` first (compile tracing on), then the heavy imports; returns the Runtime."""
    import tpukit

    rt = tpukit.setup(device="cpu")
    import warnings

    warnings.filterwarnings("once")
    return rt


def make_model(device):
    """MiniLM-L6 BERT with a fresh 2-way classifier (seeded), in train mode, on ``device``."""
    import torch
    from transformers import BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # only while loading: the expected "classifier.* newly initialized" report
    torch.manual_seed(SEED)
    try:
        model = BertForSequenceClassification.from_pretrained(model_path(), num_labels=2)
    finally:
        hf_logging.set_verbosity(level)
    model.train()
    return model.to(device) if device is not None else model


def tpukit_train(model, batches, device, lr: float = LR, recipe: bool = True, declare=None) -> dict:
    """The loop every tpukit way uses: track + forward/backward/AdamW + log. Returns measurements.

    ``batches`` may be a list or a live iterable (a BucketBatcher: then padding
    happens inside the timed loop). ``recipe=True`` feeds the model the 4-D mask
    (:func:`bert_inputs`); False passes the 2-D mask as transformers' examples do.
    ``declare``: the lengths the loop declares to ``track(shapes=...)`` (a BucketBatcher declares its own).
    """
    import torch
    import tpukit
    from tpukit import _xla

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    shapes = []
    before = tpukit.snapshot()
    c0 = time.process_time()
    t0 = time.perf_counter()
    tracker = tpukit.track(batches, device=device, progress=False, shapes=declare)
    for batch in tracker:
        shapes.append(tuple(batch["input_ids"].shape))
        loss = model(**(bert_inputs(batch) if recipe else batch)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        tpukit.log(loss=loss)
    _xla.wait_device_ops()
    total = time.perf_counter() - t0
    cpu = time.process_time() - c0
    delta = tpukit.snapshot() - before
    out = {**summarize(tracker.history, shapes, total, delta), "cpu_s": cpu, "mask": "4-D additive (recipe)"
           if recipe else "2-D (transformers default)"}
    try:
        out["tracker_summary"] = {k: v for k, v in tracker.summary().items()
                                  if isinstance(v, (int, float, str, type(None), dict))}
    except Exception as exc:  # the summary is a report, not the measurement
        out["tracker_summary"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def event_record(e, step: int | None = None, shape: str | None = None) -> dict:
    """One compile event as JSON: kind, what cut the graph, where, and tpukit's own one-line text."""
    rec = {"step": step, "shape": shape, "kind": getattr(e, "kind", None), "cut": getattr(e, "cut", None),
           "forced": bool(getattr(e, "forced", False)), "where": getattr(e, "where", None),
           "seconds": None if getattr(e, "duration", None) is None else round(e.duration, 2)}
    try:
        rec["describe"] = e.describe()
    except Exception as exc:  # pragma: no cover - a report, never fatal
        rec["describe"] = f"(describe failed: {type(exc).__name__}: {exc})"
    # The innermost frame outside torch/torch_xla/tpukit: for a read inside transformers, its line there
    # (the trace keeps it even when tpukit's `where` names the user's call).
    frames = [f for f in getattr(e, "frames", ()) if not f.is_machinery]
    rec["innermost_line"] = str(frames[0]) if frames else None
    return rec


def breakdown(events: list[dict]) -> dict:
    """Counts of compile events by kind and by cut, and the forced reads' locations."""
    by_kind: dict[str, int] = {}
    by_cut: dict[str, int] = {}
    for e in events:
        by_kind[str(e["kind"])] = by_kind.get(str(e["kind"]), 0) + 1
        by_cut[str(e["cut"])] = by_cut.get(str(e["cut"]), 0) + 1
    forced = [e for e in events if e["cut"] == "forced read" or e["forced"]]
    return {"by_kind": by_kind, "by_cut": by_cut, "forced_reads": len(forced),
            "forced_read_where": sorted({e["where"] for e in forced}),
            "forced_read_innermost_line": sorted({str(e.get("innermost_line")) for e in forced}),
            "forced_read_text": sorted({e["describe"] for e in forced})[:3]}


def summarize(history, shapes, total: float, delta) -> dict:
    """Compiles, times and per-shape graph counts of a tracked loop."""
    steady = [r.wall for r in history if r.compiles == 0]
    per_shape: dict[str, int] = {}
    step_graphs: dict[str, int] = {}  # the training-step graphs, without mid-step value reads
    forced_where: dict[str, int] = {}
    events = []
    for rec, shape in zip(history, shapes):
        key = "x".join(map(str, shape))
        events += [event_record(e, rec.step, key) for e in rec.compile_events]
        per_shape[key] = per_shape.get(key, 0) + rec.compiles
        forced = [e for e in rec.compile_events if e.forced]
        step_graphs[key] = step_graphs.get(key, 0) + rec.compiles - len(forced)
        for e in forced:
            where = e.where  # the user's line, else the innermost library line (e.g. transformers)
            forced_where[where] = forced_where.get(where, 0) + 1
    losses = [r.scalars.get("loss") for r in history if "loss" in r.scalars]
    return {
        "ok": True,
        "steps": len(history),
        "total_s": total,
        "compiles": delta.compiles,
        "compiles_in_steps": sum(r.compiles for r in history),
        "compile_time_s": delta.compile_time,
        "execute_time_s": delta.execute_time,
        "steady_steps": len(steady),
        "steady_step_s": statistics.median(steady) if steady else None,
        "step_walls_s": [round(r.wall, 3) for r in history],
        "step_compiles": [r.compiles for r in history],
        "shapes": ["x".join(map(str, s)) for s in shapes],
        "compiles_per_shape": per_shape,
        "step_graphs_per_shape": step_graphs,
        "forced_compiles": sum(forced_where.values()),
        "flagged_recompilations": [{"step": r.step, "shape": "x".join(map(str, sh)), "where": e.where, "hint": e.hint}
                                   for r, sh in zip(history, shapes) for e in r.recompilations],
        "forced_compiles_where": forced_where,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "mean_loss": statistics.mean(losses) if losses else None,
        "mean_loss_last_quarter": statistics.mean(losses[-max(1, len(losses) // 4):]) if losses else None,
        "fallbacks": delta.fallbacks,
        "compile_events": events,
        "compile_breakdown": breakdown(events),
    }
