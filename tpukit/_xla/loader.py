"""Importing torch_xla: lazily, once per module, with failures turned into tpukit errors.

Every other module of the adapter reaches torch_xla through :func:`module`
(or the shortcuts below it), never with an ``import`` statement, so that
``import tpukit`` stays cheap and tpukit can set environment variables (device
kind, virtual CPU devices, compile tracing) before the runtime reads them.

A failed import says what to do: a torch/torch_xla pair built for different
releases (an undefined symbol in ``_XLAC``) raises
:class:`~tpukit.VersionMismatchError`, a missing torch_xla
:class:`~tpukit.TorchXlaMissingError`, both with the install command.

After each first import the eager-mode switch is wrapped (:mod:`.eager`), so
that it is followed from whichever torch_xla module is loaded first.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys
import traceback
from typing import Any

from .. import environment
from ..errors import TorchXlaMissingError, VersionMismatchError
from . import eager

_MODULES: dict[str, Any] = {}
_FIRST_USE: list[str] = []  # the tpukit function whose call imported torch_xla; "" if it was already imported


def is_imported() -> bool:
    """True when torch_xla has been imported in this process (by anyone)."""
    return "torch_xla" in sys.modules


def imported_by() -> str | None:
    """``module.function`` of the tpukit call that imported torch_xla in this process (the outermost
    tpukit frame, e.g. ``tpukit.checkpoint.saveload.load``); ``""`` when it was imported outside
    tpukit first; None when tpukit has not used it yet. Lets ``setup()`` say who started the runtime."""
    return _FIRST_USE[0] if _FIRST_USE else None


def module(name: str = "torch_xla") -> Any:
    """The torch_xla module ``name``, imported on first use."""
    mod = _MODULES.get(name)
    if mod is None:
        if not _FIRST_USE:
            frames = [f for f, _ in traceback.walk_stack(None) if f.f_globals.get("__name__", "").startswith("tpukit")]
            outer = frames[-1] if frames and not is_imported() else None
            _FIRST_USE.append(f"{outer.f_globals['__name__']}.{outer.f_code.co_name}" if outer else "")
        mod = _MODULES[name] = _import(name)
        eager.watch()
    return mod


class _TorchaxGate(importlib.abc.MetaPathFinder):
    """Keeps torchax from loading next to torch_xla (unless ``TPUKIT_ALLOW_TORCHAX=1``).

    torch_xla 2.8's ``mark_sharding`` asks ``maybe_get_torchax()`` whether a tensor is torchax's, which
    imports torchax whenever jax is installed (Kaggle's TPU image). torchax then renames torch's privateuse1
    backend to "jax" with no hooks behind it, and torch.distributed breaks in the process: a gloo barrier
    raises "Please register PrivateUse1HooksInterface", DCP's saver asks torchax for CUDA streams (a slice's
    sharded checkpoint failed both ways). torch_xla takes the ImportError as "no torchax" and goes on.
    """

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        """Refuse ``torchax`` with the reason and the way out; leave every other import alone."""
        if name == "torchax" and os.environ.get("TPUKIT_ALLOW_TORCHAX") != "1":
            raise ImportError("tpukit keeps torchax from loading next to torch_xla: it renames torch's "
                              "privateuse1 backend and torch.distributed then fails (barriers, sharded "
                              "checkpoints). Set TPUKIT_ALLOW_TORCHAX=1 to allow it.")
        return None


if "torchax" not in sys.modules:  # a process that loaded torchax before tpukit keeps it
    sys.meta_path.insert(0, _TorchaxGate())


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        text = str(exc)
        if "undefined symbol" in text or "torch_xla/_XLAC" in text:
            v = environment.versions()
            raise VersionMismatchError(
                f"torch_xla {v.get('torch_xla')} cannot load with torch {v.get('torch')}: "
                f"its C extension was built for another torch release ({text.splitlines()[0][:160]}). "
                f"Install a matching pair: {environment.install_command()}"
            ) from None
        if exc.name and exc.name.split(".")[0] == "torch_xla":
            raise TorchXlaMissingError(
                "torch_xla is not installed in this Python environment. "
                f"Install it with: {environment.install_command()}"
            ) from None
        raise


def torch_xla() -> Any:
    """The imported ``torch_xla`` module (imports it on first call)."""
    return module("torch_xla")


def runtime() -> Any:
    """The ``torch_xla.runtime`` module."""
    return module("torch_xla.runtime")


def xlac() -> Any:
    """torch_xla's C extension, ``torch_xla._XLAC`` (the calls with no public Python wrapper)."""
    return torch_xla()._XLAC


def xm() -> Any:
    """``torch_xla.core.xla_model``."""
    return module("torch_xla.core.xla_model")


def xs() -> Any:
    """``torch_xla.distributed.spmd``."""
    return module("torch_xla.distributed.spmd")
