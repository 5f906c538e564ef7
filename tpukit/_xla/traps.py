"""Known failures of the PyTorch stack on XLA tensors, recognised from their exception: what happened, why,
and the line that fixes it. A trace (``tpukit.estimate``) raises the explanation in place of the bare
error; a tracked loop that stopped on one says it in its report (``tpukit.track``).
"""

from __future__ import annotations

import traceback

# torch.utils.checkpoint (transformers' gradient_checkpointing_enable()) asks torch for the device's module
# (torch.xla) to save its RNG state or to infer the autocast device: torch_xla registers none in torch 2.8.
_CHECKPOINT = ("torch/utils/checkpoint.py", "torch/random.py")
_NO_MODULE = ("has no attribute 'xla'", "torch has no module of `xla`")
CHECKPOINT_ON_XLA = (
    "torch.utils.checkpoint failed on XLA tensors ({error}): transformers' model.gradient_checkpointing_enable() "
    "checkpoints each layer with it, and in torch 2.8 it asks torch for a device module torch_xla does not "
    "register (use_reentrant and preserve_rng_state do not avoid it). Checkpoint each layer with torch_xla's "
    "checkpoint instead: call model.gradient_checkpointing_disable() and run the training step inside "
    "`with tpukit.rewrites.checkpointed(list(model.model.layers)):` (torch_xla.utils.checkpoint around each "
    "decoder layer), or use the Trainer's FSDPv2 with fsdp_config={{'xla_fsdp_grad_ckpt': True}}.")

# torch.autocast("xla") casts matmuls, not scaled_dot_product_attention (it is in CUDA's autocast lists, not
# XLA's): a decoder's queries and keys come out of its rotary embedding in float32, its values from a bf16
# matmul, and sdpa refuses the mix (transformers' Llama/Qwen/Gemma under autocast, seen on torch_xla 2.8).
_SDPA_DTYPES = "Expected query, key, and value to have the same dtype"
SDPA_UNDER_AUTOCAST = (
    "scaled_dot_product_attention failed under autocast ({error}): torch.autocast('xla') casts the matmuls but "
    "not sdpa's inputs, so a decoder's float32 queries and keys (after its rotary embedding) meet bf16 values. "
    "Use eager attention under autocast (AutoModelForCausalLM.from_config(cfg, attn_implementation='eager'), "
    "or model.set_attn_implementation('eager'): its matmuls are autocast), or cast the weights to bf16 "
    "(model.to(torch.bfloat16)) instead of autocasting.")


def explain(exc: BaseException) -> str | None:
    """What/why/fix for a known failure (``exc`` and its causes), or None for any other exception."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        files = [f.filename.replace("\\", "/") for f in traceback.extract_tb(exc.__traceback__)]
        if any(m in str(exc) for m in _NO_MODULE) and any(f.endswith(c) for f in files for c in _CHECKPOINT):
            return CHECKPOINT_ON_XLA.format(error=f"{type(exc).__name__}: {exc}")
        if _SDPA_DTYPES in str(exc):
            return SDPA_UNDER_AUTOCAST.format(error=str(exc).strip().splitlines()[0])
        exc = exc.__cause__ or exc.__context__
    return None
