"""What to change when a decoder LM's fine-tune does not fit: ``tpukit.fit`` on published configs.

Two steps people bring to Colab's v5e-1, by Colab's compiler (torch_xla 2.9's libtpu): Llama-3.2-1B's full
fine-tune at 4 x 2048 tokens, and Gemma-3-1B (a 262k vocabulary: its logits are the peak) with LoRA at
8 x 2048. Each prints the step's verdict, every change compiled and ordered by the HBM it leaves, and the
wall time; the results go to ``bench/results/llm_fit.json``. Random weights on the meta device (the HBM does
not depend on values; the host holds none). About 10 minutes here.

    .venv/bin/python bench/llm_fit.py
"""

from __future__ import annotations

import json
import os
import platform
import resource
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "llm_fit.json")

from llm_plan import LLAMA_3_2_1B  # noqa: E402  (the published config, one place)

# google/gemma-3-1b-pt's config.json (text model).
GEMMA_3_1B = dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                  max_position_embeddings=32768, rope_theta=1000000.0, query_pre_attn_scalar=256,
                  rms_norm_eps=1e-6, name_or_path="google/gemma-3-1b-pt")

CASES = (
    dict(config=LLAMA_3_2_1B, kind="llama", mode="full", batch=4, length=2048),
    dict(config=GEMMA_3_1B, kind="gemma3_text", mode="lora", batch=8, length=2048),
)


def main() -> None:
    import torch
    from transformers import Gemma3TextConfig, LlamaConfig

    import tpukit

    out = []
    for case in CASES:
        cls = LlamaConfig if case["kind"] == "llama" else Gemma3TextConfig
        cfg = cls(**{k: v for k, v in case["config"].items() if k != "name_or_path"}, dtype=torch.bfloat16)
        cfg.name_or_path = case["config"]["name_or_path"]
        t0 = time.time()
        f = tpukit.fit(cfg, "v5e-1", compiler="torch_xla 2.9", mode=case["mode"], batch=case["batch"],
                       length=case["length"])
        wall = time.time() - t0
        print(f, f"\n({wall / 60:.1f} min)\n", flush=True)
        out.append(dict(model=f.model, target=f.target, compiler=f.compiler, mode=f.mode, batch=f.batch,
                        length=f.length, fits=f.fits, hbm_bytes=f.hbm_bytes, note=f.note, wall_s=round(wall, 1),
                        advice=[dict(change=s.change, hbm_bytes=s.hbm_bytes, fits=s.fits, unchecked=s.unchecked)
                                for s in f.advice], text=str(f)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS + ".tmp", "w") as fh:
        json.dump(dict(host=platform.node(), cores=os.cpu_count(), host_peak_gb=round(peak, 2), runs=out), fh,
                  indent=1)
    os.replace(RESULTS + ".tmp", RESULTS)
    print(f"host peak {peak:.2f} GB; wrote {RESULTS}")


if __name__ == "__main__":
    main()
