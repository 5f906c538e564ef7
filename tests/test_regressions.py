"""Traps a newcomer hit (issue #37), each pinned by a test on the real torch_xla runtime (XLA:CPU).

1. ``tpukit.hf`` after a plain ``import tpukit``.
2. ``setup(target=...)`` is the target ``estimate()`` compiles for.
3. Weights a model ties (GPT-2) lost their tie on the way to the device, silently.
4. ``estimate`` took what it cannot use: a batch on the host, a step that reads a value, a step
   without a backward pass.
5. A recompilation after warm-up said nothing in a plain ``track(loader)``.

Nothing of torch_xla is mocked. The TPU compiler (libtpu, compile-only) runs here; the tests
that use it skip when it is not installed.
"""

from __future__ import annotations

import logging
import textwrap
import warnings

import pytest
import torch

from conftest import run_python

import tpukit
from tpukit import TpukitWarning, _xla, tpu

needs_tpu_compiler = pytest.mark.skipif(not tpu.available(), reason="the TPU compiler is not installed: "
                                        "pip install 'tpukit[tpu-estimate]'")


@pytest.fixture
def tpu_cache(tmp_path_factory, monkeypatch):
    """The TPU compiler's answers cached in this session's temp folder (not the user's ~/.cache)."""
    path = tmp_path_factory.getbasetemp() / "tpu-cache"
    monkeypatch.setenv("TPUKIT_TPU_CACHE", str(path))
    return path


def mlp(dim=16, hidden=32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, dim)).to(
        _xla.device())


def train_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def gpt2():
    """A tiny GPT-2 (its lm_head tied to its token embedding), built from a config: no hub."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def lm_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def tpukit_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, TpukitWarning)]


# ---------------------------------------------------------------------------------------- 1. tpukit.hf


def test_hf_is_an_attribute_after_a_plain_import_tpukit():
    out = run_python(textwrap.dedent("""
        import sys
        import tpukit
        print(sorted(m for m in ("transformers", "ipywidgets", "jax", "torch_xla") if m in sys.modules))
        print(tpukit.hf.Callback.__name__, tpukit.hf.Callback.__module__, "transformers" in sys.modules)
        print(tpukit.widgets.Dashboard.__name__, tpukit.tpu.estimate is tpukit.estimate)
        try:
            tpukit.no_such_thing
        except AttributeError as exc:
            print("AttributeError:", exc)
    """))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "[]", f"import tpukit imported {lines[0]}"  # nothing heavy until a part is used
    assert lines[1] == "Callback tpukit.hf True", lines  # transformers loads with the Callback, not before
    assert lines[2] == "Dashboard True", lines
    assert lines[3].startswith("AttributeError: module 'tpukit' has no attribute 'no_such_thing'") and \
        "tpukit.__all__" in lines[3] and "tpukit.hf" in lines[3], lines[3]


# ---------------------------------------------------------------------------------------- 2. the target


@needs_tpu_compiler
def test_setup_target_is_what_estimate_compiles_for(tpu_cache):
    # A fresh runtime: setup(target=...) starts following the target (every graph goes to the TPU compiler).
    out = run_python(textwrap.dedent("""
        import torch
        import tpukit
        from tpukit import _xla, runtime

        tpukit.setup(device="cpu", target="v6e-1")  # the first call names it
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).to(_xla.device())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        x = torch.randn(8, 16, device=_xla.device())
        print(tpukit.estimate(step, x, suggest=False).target, runtime.tpu_target().name)
        tpukit.setup(target="v5e-1")  # a later call changes it
        print(tpukit.estimate(step, x, suggest=False).target, runtime.tpu_target().name,
              tpukit.tpu.follower().target.name)
        assert not hasattr(runtime, "follow_target")  # one owner, one accessor: runtime.tpu_target()
    """), env={"TPUKIT_TPU_CACHE": str(tpu_cache)}, drop=("TPUKIT_TARGET",))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-2:] == ["v6e-1 v6e-1", "v5e-1 v5e-1 v5e-1"], out.stdout


@needs_tpu_compiler
def test_estimate_without_any_target_says_how_to_name_one(rt, monkeypatch):
    monkeypatch.delenv("TPUKIT_TARGET", raising=False)
    if tpukit.runtime.tpu_target() is not None:
        pytest.skip("this session's runtime has a target")
    with pytest.raises(tpukit.TpukitError, match=r"no TPU target: pass target=.*tpukit.setup\(target='v5e-1'\)"):
        tpukit.estimate(train_step(mlp()), torch.randn(8, 16, device=_xla.device()))


