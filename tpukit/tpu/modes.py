"""The fine-tuning modes of a decoder LM, each a real training step for :mod:`.plan` to compile.

A mode is a base (``"full"``: AdamW over every parameter; ``"lora"``: peft's LoRA adapters, AdamW over them
only) with options joined by ``+``:

- ``ckpt``: each decoder layer under torch_xla's gradient checkpointing, the XLA-safe form of
  ``gradient_checkpointing_enable()`` (:func:`tpukit.rewrites.checkpointed`);
- ``bf16``: the weights cast to bfloat16 before the adapters are made;
- ``autocast``: the forward and the loss under ``torch.autocast("xla", dtype=torch.bfloat16)``;
- ``chunk``: the loss over slices of the tokens, the head's projection inside each, so that one slice's
  logits are live at a time (:func:`tpukit.rewrites.chunked_loss`: what a 256k vocabulary, Gemma's, needs);
- ``eager``: transformers' eager attention (the scores as a tensor) instead of its default, ``sdpa``;
- ``flash``: torch_xla's Pallas flash attention (:func:`tpukit._xla.kernels.flash_attention`, lowered for the
  TPU while the step is traced: :meth:`Built.tracing`);
- ``fsdp``: the step sharded over the target's chips as under ``tpukit.fsdp``.

``"lora+ckpt"``, ``"full+bf16+fsdp"``, ``"lora+ckpt+flash"``.

The model is built on PyTorch's ``meta`` device and given XLA placeholders for its weights
(:func:`tpukit._xla.placeholders`): the step traced is the same program as on real weights (the same HLO),
and the host never holds them, so an 8B model is planned on a machine that could not hold it.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import _xla
from ..rewrites import checkpointed, chunked_loss, heads, layers

BASES = ("full", "lora")
OPTIONS = ("ckpt", "bf16", "autocast", "chunk", "eager", "flash", "fsdp")
FLASH = "tpukit_pallas"  # the name transformers' AttentionInterface knows the Pallas flash attention by
LORA_DEFAULTS = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0}  # peft's own target modules for the model


@dataclass(frozen=True)
class Mode:
    """One mode, parsed: its base and options (see the module doc)."""

    name: str
    base: str
    ckpt: bool = False
    bf16: bool = False
    fsdp: bool = False
    autocast: bool = False
    chunk: bool = False
    eager: bool = False
    flash: bool = False

    @classmethod
    def parse(cls, name: str) -> "Mode":
        """``"lora+ckpt"`` -> Mode(base="lora", ckpt=True); a clear error naming what is known otherwise."""
        base, *options = [p.strip() for p in str(name).lower().split("+")]
        if base not in BASES:
            raise ValueError(f"mode {name!r}: it starts with one of {', '.join(BASES)} (then +{', +'.join(OPTIONS)})")
        unknown = [o for o in options if o not in OPTIONS]
        if unknown:
            raise ValueError(f"mode {name!r}: unknown option(s) {', '.join(unknown)}; the options are "
                             f"{', '.join(OPTIONS)} (e.g. 'lora+ckpt')")
        if "eager" in options and "flash" in options:
            raise ValueError(f"mode {name!r}: one attention at a time: +eager (transformers' eager) or +flash "
                             "(torch_xla's Pallas flash attention); neither is transformers' default, sdpa")
        if "flash" in options and "fsdp" in options:
            raise ValueError(f"mode {name!r}: +flash with +fsdp is not planned: torch_xla's flash attention under "
                             "SPMD needs its partition_spec and mesh in the model's code, and the plan shards the "
                             "step at its compile. Plan +flash on one chip, or +fsdp with sdpa")
        return cls("+".join([base, *options]), base, **{o: o in options for o in OPTIONS})

    @property
    def attention(self) -> str | None:
        """The attention implementation the mode asks transformers for (None: the model's default)."""
        return "eager" if self.eager else FLASH if self.flash else None


@dataclass
class Built:
    """A mode's model (placeholders on the XLA device), its optimizer and its step ``step(ids)``, with what
    the table says of it: parameters in all and trained."""

    mode: Mode
    model: Any
    step: Callable
    vocab: int
    parameters: int
    trained: int
    max_length: int | None = None  # the model's longest position (its config's max_position_embeddings)
    extra: dict = field(default_factory=dict)
    mosaic: int | None = None  # the Mosaic format version +flash's kernels are written at (None: jax's choice)

    def tracing(self) -> Any:
        """The context the step is traced in: for ``+flash``, torch_xla's Pallas kernels lowered for the TPU
        (:func:`tpukit._xla.kernels.for_tpu`, at :attr:`mosaic`); otherwise nothing."""
        return _xla.kernels.for_tpu(self.mosaic) if self.mode.flash else contextlib.nullcontext()


def model_name(model: Any) -> str:
    """What a planning answer calls the model: its config's ``name_or_path``, else its class."""
    cfg = getattr(model, "config", model)
    named = getattr(cfg, "name_or_path", "") or getattr(cfg, "_name_or_path", "")
    if named:
        return named
    arch = getattr(cfg, "architectures", None)
    return (arch[0] if arch else None) or getattr(cfg, "model_type", None) or getattr(model, "__qualname__", "model")


OPTIMIZERS = ("adamw", "adafactor")


def build(model: Any, mode: Mode, dtype: Any = None, lora: dict | None = None, optimizer: str = "adamw") -> Built:
    """The mode's model and step. ``model``: a transformers config (built with ``AutoModelForCausalLM``) or
    a function returning the model (called on the ``meta`` device). ``dtype``: the weights' dtype (None: the
    config's, else float32; ``+bf16`` casts to bfloat16). ``lora``: peft ``LoraConfig`` options over
    :data:`LORA_DEFAULTS`. ``optimizer``: ``"adamw"`` (torch's AdamW) or ``"adafactor"`` (transformers'
    Adafactor as the Trainer's ``optim="adafactor"`` makes it: no relative step, no parameter scaling)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: one of {', '.join(OPTIMIZERS)}")
    import torch

    made_by = None
    if not (callable(model) and not hasattr(model, "to_dict")):
        from transformers import AutoModelForCausalLM

        # The model's module is imported here, outside the meta device: imported first under it, Gemma 3's
        # import of torch._dynamo ran into itself ("partially initialized module 'torch._dynamo'").
        AutoModelForCausalLM._model_mapping[type(model)]
        made_by = AutoModelForCausalLM.from_config
    with torch.device("meta"):
        # a mode's attention is not the config's: each mode builds from a copy
        m = model() if made_by is None else made_by(copy.deepcopy(model))
    if not isinstance(m, torch.nn.Module):
        raise TypeError(f"the model function returned {type(m).__name__}, not a torch module: pass a transformers "
                        "config or a function returning the model (e.g. lambda: AutoModelForCausalLM.from_config(cfg))")
    cfg = getattr(m, "config", None)
    if mode.attention:
        _attention(m, mode)
    want = torch.bfloat16 if mode.bf16 else dtype or _config_dtype(cfg) or torch.float32
    m = m.to(want)
    if mode.base == "lora":
        import peft

        m = peft.get_peft_model(m, peft.LoraConfig(**{**LORA_DEFAULTS, **(lora or {})}))
    _xla.placeholders(m)  # a tie made on meta stays one parameter
    m.train()
    trained = [p for p in m.parameters() if p.requires_grad]
    if optimizer == "adafactor":
        from transformers.optimization import Adafactor

        opt = Adafactor(trained, lr=1e-4, scale_parameter=False, relative_step=False)
    else:
        opt = torch.optim.AdamW(trained, lr=1e-4)
    found = layers([m])[1] if mode.ckpt else []
    if mode.ckpt and not found:
        raise ValueError(f"mode {mode.name!r}: the model has no repeated layers to checkpoint")
    head = heads([m.get_base_model() if hasattr(m, "get_base_model") else m]) if mode.chunk else []  # under peft
    if mode.chunk and not head:
        raise ValueError(f"mode {mode.name!r}: the model's loss is not one transformers computes from its "
                         "lm_head's logits, so the kit cannot chunk it")

    def forward(ids: Any) -> Any:
        with contextlib.ExitStack() as on:
            if found:
                on.enter_context(checkpointed(found))
            if head:
                on.enter_context(chunked_loss(head))
            if mode.autocast:
                on.enter_context(torch.autocast("xla", dtype=torch.bfloat16))
            return m(input_ids=ids, labels=ids, use_cache=False).loss  # training: no key/value cache

    def step(ids: Any) -> Any:
        opt.zero_grad()
        loss = forward(ids)
        loss.backward()
        opt.step()
        return loss

    step.__qualname__ = f"{type(getattr(m, 'base_model', m)).__name__}[{mode.name}]"
    vocab = int(getattr(cfg, "vocab_size", 0) or m.get_input_embeddings().num_embeddings)
    return Built(mode, m, step, vocab, sum(p.numel() for p in m.parameters()), sum(p.numel() for p in trained),
                 getattr(cfg, "max_position_embeddings", None))


def _attention(m: Any, mode: Mode) -> None:
    """Set the model's attention implementation to the mode's (``+flash``: registered with transformers first)."""
    if mode.flash:
        from transformers import AttentionInterface

        AttentionInterface.register(FLASH, _flash_forward)
    try:
        m.set_attn_implementation(mode.attention)
    except (AttributeError, ValueError) as exc:
        raise ValueError(f"mode {mode.name!r}: the model does not take attn_implementation={mode.attention!r} "
                         f"({exc})") from exc


def _flash_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                   scaling: float | None = None, **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention interface over torch_xla's Pallas flash attention: causal, no padding mask (a
    custom attention gets none: the plan's batches have no padding), no dropout, no soft-capping."""
    if kwargs.get("softcap") is not None:
        raise ValueError("+flash: the model soft-caps its attention scores (Gemma 2's attn_logit_softcapping), "
                         "which torch_xla's flash attention does not do: plan it with sdpa or +eager")
    if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
        raise ValueError("+flash: the model's layers attend over a sliding window (Gemma 3's, Mistral's), which "
                         "torch_xla's flash attention does not do: plan it with sdpa")
    out = _xla.kernels.flash_attention(query, key, value, scaling, causal=getattr(module, "is_causal", True))
    return out.transpose(1, 2).contiguous(), None


def _config_dtype(cfg: Any) -> Any:
    """The dtype a config names (``dtype`` in transformers 5, ``torch_dtype`` before), as a torch dtype."""
    import torch

    named = getattr(cfg, "dtype", None) if hasattr(cfg, "dtype") else getattr(cfg, "torch_dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) else None

