"""Held against real chips, for decoder LLM fine-tunes: public runs on a named TPU, rebuilt and compiled by the kit.

Each report below is a decoder fine-tune with PyTorch/XLA (Hugging Face's optimum-tpu examples, through the
Trainer's FSDPv2) on a v5e-8 that ran, or was given up for running out of memory, at stated sizes. The step
is rebuilt with the published config (placeholder weights: tpukit.tpu.modes), the report's mode (full or
LoRA with its rank and targets, each decoder layer checkpointed as ``xla_fsdp_grad_ckpt`` does, bf16
weights, Adafactor as ``optim="adafactor"`` makes it), the global batch sharded FSDP-style over the eight
chips, and compiled for v5e-8 by the oldest TPU compiler the kit pins (torch_xla 2.6's; the reports ran
torch_xla 2.2-2.5), twice: stopped at its buffer assignment (the plan's fast answer) and in full (the
compiler's verdict). The kit's verdict is the plan's (``tpukit.tpu.plan.holds``: compiled, and arguments,
outputs and temporaries within the usable HBM). Results: ``bench/results/llm_reports.json``.

    python bench/llm_reports.py [--only KEY ...] [--compiler "torch_xla 2.6"]

No report gives an HBM figure ("Used X of Y"): the outcome is what its author states (a run log, "works
well", "a bigger system might be necessary to avoid OOMs"). Sources and what each leaves unstated are in
REPORTS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "llm_reports.json")

LLAMA_3_2_1B = dict(kind="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                    rope_theta=500000.0, max_position_embeddings=131072)
LLAMA_2_7B = dict(kind="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False,
                  max_position_embeddings=4096)
GEMMA_2B = dict(kind="gemma", vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                num_attention_heads=8, num_key_value_heads=1, head_dim=256, max_position_embeddings=8192)
GEMMA_7B = dict(kind="gemma", vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=16, head_dim=256, max_position_embeddings=8192)

REPORTS = [
    {
        "key": "llama32_1b_lora",
        "url": "https://github.com/huggingface/optimum-tpu/blob/060b709a19ccd189c7f63fb9e31f287d811a4271/"
               "examples/language-modeling/llama_tuning.ipynb",
        "model": "meta-llama/Llama-3.2-1B", "config": LLAMA_3_2_1B, "mode": "lora+ckpt+fsdp",
        "lora": {"r": 256, "lora_alpha": 128, "lora_dropout": 0.05, "target_modules": "all-linear"},
        "batch": 32, "length": 512, "real": "ran",
        "stated": "v5litepod8; LoRA r=256 all-linear; per_device_train_batch_size=32 (the global batch under "
                  "SPMD), max_seq_length=512 packed; optim=adafactor; FSDPv2 with xla_fsdp_grad_ckpt; "
                  "TrainOutput(global_step=70, train_runtime 409.6 s); torch_xla 2.5.1",
        "assumed": "the chip is the notebook's stated setup ('such as a v5litepod8'), not printed by the run",
    },
    {
        "key": "gemma_2b_lora",
        "url": "https://github.com/huggingface/optimum-tpu/commit/8bb637b835f01092531c06faca2b22258c12ed8f",
        "model": "google/gemma-2b", "config": GEMMA_2B, "mode": "lora+ckpt+fsdp",
        "lora": {"r": 8, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["k_proj", "v_proj"]},
        "batch": 64, "length": 1024, "real": "ran",
        "stated": "'gemma tuning works well on gemma 2b'; v5litepod8; LoRA r=8 k_proj,v_proj; "
                  "per_device_train_batch_size=64 (global), max_seq_length=1024 packed; optim=adafactor; "
                  "FSDPv2 (grad checkpointing always on in optimum-tpu's fsdp_v2 config); torch_xla ~2.3",
        "assumed": "lora_alpha not stated (peft's default 8); no run log",
    },
    {
        "key": "gemma_7b_lora",
        "url": "https://github.com/huggingface/optimum-tpu/commit/8bb637b835f01092531c06faca2b22258c12ed8f",
        "model": "google/gemma-7b", "config": GEMMA_7B, "mode": "lora+ckpt+fsdp",
        "lora": {"r": 8, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["k_proj", "v_proj"]},
        "batch": 64, "length": 1024, "real": "out of memory",
        "stated": "the same notebook with gemma-7b: 'For gemma 7b a bigger system might be necessary to avoid "
                  "OOMs.' (the commit moved the example to gemma-2b, sizes unchanged)",
        "assumed": "the OOM is stated, hedged, without a figure; whether at compile or at run time is not said",
    },
    {
        "key": "llama2_7b_full",
        "url": "https://github.com/huggingface/optimum-tpu/blob/8a70783d916ea3ca0666387b122a3b1201d8a60a/"
               "examples/language-modeling/llama_tuning.md",
        "model": "meta-llama/Llama-2-7b-hf", "config": LLAMA_2_7B, "mode": "full+ckpt+fsdp", "lora": None,
        "batch": 4, "length": 1024, "real": "ran",
        "stated": "run_clm.py --per_device_train_batch_size 4 --block_size 1024 --optim adafactor --torch_dtype "
                  "bfloat16 --spmd_2d_sharding 1 --spmd_grad_chkpt; 'Training can take around 20 minutes on a "
                  "TPU v5e-litepod8'; torch_xla ~2.2",
        "assumed": "the 2D sharding with a model axis of 1 is FSDP-style over the 8 chips' data axis",
    },
]


def config_of(spec: dict):
    """The transformers config of a published config dict."""
    import torch
    from transformers import GemmaConfig, LlamaConfig

    kw = {k: v for k, v in spec.items() if k != "kind"}
    cls = GemmaConfig if spec["kind"] == "gemma" else LlamaConfig
    return cls(**kw, dtype=torch.bfloat16)


def rebuild(report: dict, compiler: str) -> dict:
    """The report's step traced and compiled twice (to its buffer assignment; in full), the kit's verdicts."""
    import resource

    import torch

    from tpukit.tpu import ask, modes, trace
    from tpukit.tpu.plan import held_bytes, holds

    t0 = time.time()
    made = modes.build(config_of(report["config"]), modes.Mode.parse(report["mode"]), lora=report["lora"],
                       optimizer="adafactor")
    tgt, comp = ask.resolve("v5e-8", compiler)
    ask.begin(made.step, (), {}, comp, "bench")
    traced = trace.trace(made.step, (torch.randint(0, made.vocab, (report["batch"], report["length"])),), {})
    traced_s = time.time() - t0
    out = {"trace_s": round(traced_s, 1), "parameters": made.parameters, "trained": made.trained}
    for how, early in (("buffer assignment", True), ("full compile", False)):
        t1 = time.time()
        est = ask.ask(traced, tgt, comp, report["key"], shard_over=tgt.chips, early=early)
        held = held_bytes(est)
        out[how] = {"compiler_verdict": est.status, "kit_fits": holds(est),
                    "held_gb_per_chip": round(held / 1e9, 2) if held else None,
                    "hbm_gb": round(est.hbm_bytes / 1e9, 2) if est.hbm_bytes else None,
                    "hbm_source": est.hbm_source, "seconds": round(time.time() - t1, 1),
                    "message": (est.message or "")[:300], "compiler": est.compiler}
        print(f"  {how}: {est.status}, held {out[how]['held_gb_per_chip']} GB per chip -> kit says "
              f"{'fits' if out[how]['kit_fits'] else 'does not fit'} ({out[how]['seconds']} s)", flush=True)
    out["host_peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=[r["key"] for r in REPORTS])
    ap.add_argument("--compiler", default="torch_xla 2.6")
    args = ap.parse_args()
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("TPUKIT_TPU_CACHE", tempfile.mkdtemp(prefix="tpukit-bench-llm-reports-"))
    found = json.load(open(RESULTS)) if os.path.exists(RESULTS) else {"reports": {}}
    for report in REPORTS:
        if report["key"] not in args.only:
            continue
        print(f"== {report['key']}: {report['model']} {report['mode']} {report['batch']} x {report['length']} on "
              f"v5e-8; real: {report['real']}", flush=True)
        result = rebuild(report, args.compiler)
        kit = result["full compile"]["kit_fits"]
        result.update({k: v for k, v in report.items() if k != "config"},
                      agrees=kit == (report["real"] == "ran"))
        found["reports"][report["key"]] = result
        found["machine"] = {"cores": os.cpu_count(), "python": platform.python_version(),
                            "date": time.strftime("%Y-%m-%d"), "compiler_asked": args.compiler}
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS + ".tmp", "w") as f:
            json.dump(found, f, indent=1)
        os.replace(RESULTS + ".tmp", RESULTS)
        print(f"  real: {report['real']}; kit: {'fits' if kit else 'does not fit'}; "
              f"{'agrees' if result['agrees'] else 'DISAGREES'}", flush=True)


if __name__ == "__main__":
    main()
