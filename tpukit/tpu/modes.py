"""The fine-tuning modes of a decoder LM, each a real training step for :mod:`.plan` to compile.

A mode is a base (``"full"``: AdamW over every parameter; ``"lora"``: peft's LoRA adapters, AdamW over them
only) with options joined by ``+``: ``ckpt`` (each decoder layer under torch_xla's gradient checkpointing, the
XLA-safe form of ``gradient_checkpointing_enable()``: :func:`tpukit.rewrites.checkpointed`), ``bf16`` (the
weights cast to bfloat16 before the adapters are made) and ``fsdp`` (the step sharded over the target's chips
as under ``tpukit.fsdp``). ``"lora+ckpt"``, ``"full+bf16+fsdp"``.

The model is built on PyTorch's ``meta`` device and given XLA placeholders for its weights
(:func:`tpukit._xla.placeholders`): the step traced is the same program as on real weights (the same HLO),
and the host never holds them, so an 8B model is planned on a machine that could not hold it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .. import _xla
from ..rewrites import checkpointed, layers

BASES = ("full", "lora")
OPTIONS = ("ckpt", "bf16", "fsdp")
LORA_DEFAULTS = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0}  # peft's own target modules for the model


@dataclass(frozen=True)
class Mode:
    """One mode, parsed: its base and options (see the module doc)."""

    name: str
    base: str
    ckpt: bool = False
    bf16: bool = False
    fsdp: bool = False

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
        return cls("+".join([base, *options]), base, "ckpt" in options, "bf16" in options, "fsdp" in options)


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

    with torch.device("meta"):
        if callable(model) and not hasattr(model, "to_dict"):
            m = model()
        else:
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_config(model)
    if not isinstance(m, torch.nn.Module):
        raise TypeError(f"the model function returned {type(m).__name__}, not a torch module: pass a transformers "
                        "config or a function returning the model (e.g. lambda: AutoModelForCausalLM.from_config(cfg))")
    cfg = getattr(m, "config", None)
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

    def step(ids: Any) -> Any:
        opt.zero_grad()
        if found:
            with checkpointed(found):
                loss = m(input_ids=ids, labels=ids).loss
        else:
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    step.__qualname__ = f"{type(getattr(m, 'base_model', m)).__name__}[{mode.name}]"
    vocab = int(getattr(cfg, "vocab_size", 0) or m.get_input_embeddings().num_embeddings)
    return Built(mode, m, step, vocab, sum(p.numel() for p in m.parameters()), sum(p.numel() for p in trained),
                 getattr(cfg, "max_position_embeddings", None))


def _config_dtype(cfg: Any) -> Any:
    """The dtype a config names (``dtype`` in transformers 5, ``torch_dtype`` before), as a torch dtype."""
    import torch

    named = getattr(cfg, "dtype", None) if hasattr(cfg, "dtype") else getattr(cfg, "torch_dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) else None

