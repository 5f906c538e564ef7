"""The planning table of a decoder LM fine-tune, by the TPU compiler, timed: ``tpukit.plan`` on Llama-3.2-1B.

Llama-3.2-1B's published config (1.24B parameters, bf16 weights as the Hub ships them; built on the meta
device with placeholder weights, so nothing is downloaded and the host holds none of them), AdamW, the
fine-tuning modes people run:

- ``v5e-1``: one chip of Colab's TPU runtime, by Colab's compiler (torch_xla 2.9's libtpu): full, LoRA,
  LoRA + per-layer checkpointing, at 512 / 1024 / 2048 / 4096 / 8192 tokens;
- ``v5e-8``: Kaggle's eight chips, by Kaggle's compiler (torch_xla 2.8's libtpu), the same modes sharded
  over the eight (``+fsdp``);
- ``8b``: Llama-3.1-8B's published config on v5e-8, LoRA with each layer checkpointed and FSDP, at 1024 and
  2048 tokens by buffer assignments within an eight-minute budget, and the tracing process's peak host memory
  (it runs in a process of its own).

Each table runs in a fresh answer cache (every figure is a compile made in this run) and prints its cells
(who decided each), the prediction's measured error, its wall time and where the time went; all go to
``bench/results/llm_plan.json``.

    python bench/llm_plan.py [--only v5e-1 v5e-8 8b] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "llm_plan.json")

# Published configs (the Hub's config.json of each model; random weights: the HBM does not depend on values).
LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                    rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    name_or_path="meta-llama/Llama-3.2-1B")
LLAMA_3_1_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                    rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    name_or_path="meta-llama/Llama-3.1-8B")

RUNS = {
    "v5e-1": dict(config=LLAMA_3_2_1B, target="v5e-1", compiler="torch_xla 2.9",
                  modes=("full", "lora", "lora+ckpt"), lengths=(512, 1024, 2048, 4096, 8192)),
    "v5e-8": dict(config=LLAMA_3_2_1B, target="v5e-8", compiler="torch_xla 2.8",
                  modes=("full+fsdp", "lora+fsdp", "lora+ckpt+fsdp"), lengths=(512, 1024, 2048, 4096, 8192)),
    # One row, no full compile, eight minutes: an 8B step compiles for minutes here; the point is the host.
    "8b": dict(config=LLAMA_3_1_8B, target="v5e-8", compiler="torch_xla 2.8",
               modes=("lora+ckpt+fsdp",), lengths=(1024, 2048), verify=False, budget=480),
}


def run_one(key: str, budget: float | None) -> dict:
    """One table in this process: its cells, errors, times, and this process's peak host memory."""
    import torch
    from transformers import LlamaConfig

    import tpukit

    spec = RUNS[key]
    cfg = LlamaConfig(**{k: v for k, v in spec["config"].items() if k != "name_or_path"}, dtype=torch.bfloat16)
    cfg.name_or_path = spec["config"]["name_or_path"]
    t0 = time.time()
    plan = tpukit.plan(cfg, spec["target"], compiler=spec["compiler"], modes=spec["modes"], lengths=spec["lengths"],
                       budget=budget or spec.get("budget"), verify=spec.get("verify", True))
    wall = time.time() - t0
    print(plan, flush=True)
    by = {}
    for p in plan.points:
        by.setdefault(p.source, []).append(p.compile_s)
    return {
        "model": plan.model, "target": plan.target, "compiler": plan.compiler, "wall_s": round(wall, 1),
        "hbm_limit_bytes": plan.hbm_limit_bytes, "stopped": plan.stopped, "notes": list(plan.notes),
        "table": plan.rows(), "text": str(plan),
        "cells": [dict(mode=c.mode, length=c.length, batch=c.batch, how=c.how, refused=c.refused,
                       first_prediction=c.predicted) for c in plan.cells],
        "longest_at_batch_1": [dict(mode=c.mode, length=c.length, how=c.how, refused=c.refused,
                                    first_prediction=c.predicted) for c in plan.longest],
        "decided_by": {how: sum(c.how == how for c in plan.cells + plan.longest) for how in
                       ("compiler", "buffer assignment", "predicted")},
        "prediction_error": {"relative": [round(e, 4) for e in plan.errors()], "text": plan.error_text()},
        "times_s": {k: round(v, 1) for k, v in plan.times().items()},
        "per_compile_s": {k: {"n": len(v), "mean": round(sum(v) / len(v), 1)} for k, v in by.items()},
        "parameters": {m: {"all": a, "trained": t} for m, (a, t) in plan.parameters.items()},
        "points": [p.__dict__ for p in plan.points],
        "host_peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=list(RUNS), default=list(RUNS))
    ap.add_argument("--budget", type=float, default=None, help="seconds per table (default: none)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one table, its record on stdout's last line
        print("RESULT " + json.dumps(run_one(args.child, args.budget)), flush=True)
        return
    found = json.load(open(RESULTS)) if os.path.exists(RESULTS) else {}
    for key in args.only:
        env = dict(os.environ, PJRT_DEVICE="CPU", TPUKIT_TPU_CACHE=tempfile.mkdtemp(prefix="tpukit-bench-plan-"),
                   TPUKIT_DASHBOARD="text")
        cmd = [sys.executable, __file__, "--child", key] + (["--budget", str(args.budget)] if args.budget else [])
        print(f"== {key}", flush=True)
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        lines = out.stdout.splitlines()
        print("\n".join(line for line in lines if not line.startswith("RESULT ")), flush=True)
        result = next((json.loads(line[7:]) for line in lines if line.startswith("RESULT ")), None)
        if result is None:
            raise SystemExit(f"{key}: the table did not finish (exit {out.returncode})")
        found[key] = result
        found["machine"] = {"cores": os.cpu_count(), "python": platform.python_version(),
                            "date": time.strftime("%Y-%m-%d")}
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS + ".tmp", "w") as f:
            json.dump(found, f, indent=1)
        os.replace(RESULTS + ".tmp", RESULTS)


if __name__ == "__main__":
    main()
