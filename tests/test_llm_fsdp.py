"""A decoder trained with FSDPv2 by hand (issue 46): ``tpukit.fsdp(model, mesh, checkpoint=True)`` wraps each
decoder layer (its ``_no_split_modules``) in torch_xla's ``SpmdFullyShardedDataParallel``, checkpointed, and
``tpukit.track(loader, mesh=mesh)`` shards the batches; peft LoRA on the same path; the same code over a mesh of
one device gives the same losses.

Real torch_xla SPMD, transformers and peft on XLA:CPU, no mocks: tests/scenarios/llm_fsdp.py runs once over 8
virtual devices (every part) and once over 1 (the checkpointed run and the refusals), in two fresh interpreters
started together (each is mostly imports), and the tests below assert on what they report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import conftest

pytest.importorskip("transformers")
pytest.importorskip("peft")
SCENARIO = str(Path(__file__).parent / "scenarios" / "llm_fsdp.py")
RUNS = {8: ("ckpt", "plain", "lora", "errors"), 1: ("ckpt", "errors")}


def _env() -> dict:
    """This environment for a fresh XLA runtime, as conftest.run_python gives it."""
    dropped = ("PT_XLA_DEBUG", "CPU_NUM_DEVICES", "XLA_USE_SPMD", "XLA_FLAGS", "TPUKIT_CPU_DEVICES")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    if conftest.CPU_XLA_FLAGS:
        env["XLA_FLAGS"] = conftest.CPU_XLA_FLAGS
    env["PJRT_DEVICE"] = "CPU"
    return env


@pytest.fixture(scope="module")
def runs() -> dict:
    """``{devices: the scenario's report}``, both interpreters started at once."""
    procs = {n: subprocess.Popen([sys.executable, SCENARIO, str(n), *parts], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=_env()) for n, parts in RUNS.items()}
    found = {}
    try:
        for n, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=400)
            assert proc.returncode == 0, f"llm_fsdp.py {n} exited with {proc.returncode}:\n{stderr[-4000:]}"
            found[n] = json.loads(stdout.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return found


def _part(runs: dict, devices: int, name: str) -> dict:
    value = runs[devices][name]
    if "crashed" in value:
        pytest.fail(f"{name} crashed over {devices} devices: {value['crashed']}\n{value['traceback']}")
    return value


EIGHT = "{devices=[8,1]0,1,2,3,4,5,6,7}", "{devices=[1,8]0,1,2,3,4,5,6,7}", "{devices=[8]0,1,2,3,4,5,6,7}"


def test_a_checkpointed_decoder_trains_every_parameter_sharded_over_8(runs):
    assert runs[8]["devices"] == 8 and runs[8]["spmd"] is True
    got = _part(runs, 8, "ckpt")
    losses = got["losses"]
    assert len(losses) == got["records"] == 4 and 5.4 < losses[0] < 5.7  # ln(256) = 5.55
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.4, losses
    assert len(got["specs"]) == 21 and set(got["specs"].values()) <= set(EIGHT), got["specs"]  # each split 8 ways
    assert got["optimized"] == 21
    assert got["batch_specs"] == {"input_ids": EIGHT[0], "labels": EIGHT[0]}  # track(loader, mesh=) split them
    assert got["logits_spec"] == "{devices=[8,1,1]0,1,2,3,4,5,6,7}"  # the ModelOutput's logits, by batch
    assert got["compiles"] <= 2  # the first step, and at most one more: then every step runs the same graph
    assert not got["warnings"], got["warnings"]  # torch's notices about the wrapper's hooks are not the user's


def test_each_decoder_layer_has_its_own_checkpointed_wrapper(runs):
    got = _part(runs, 8, "ckpt")
    assert got["wrappers"] == ["model.layers.0", "model.layers.1"]  # the model's _no_split_modules, in the model
    assert got["checkpointed"] == ["model.layers.0._orig_module", "model.layers.1._orig_module"]
    assert got["attention_calls"] == 2 * 2 * 4  # 2 layers x 4 steps, each forward run again in the backward
    assert got["use_cache"] is False  # else the recompute would append to the cache
    plain = _part(runs, 8, "plain")
    assert plain["checkpointed"] == [] and plain["attention_calls"] == 2 * 4 and plain["use_cache"] is True
    assert plain["wrappers"] == got["wrappers"]


def test_the_checkpointed_forward_gives_the_plain_losses_and_gradients(runs):
    ckpt, plain = _part(runs, 8, "ckpt"), _part(runs, 8, "plain")
    assert plain["losses"] == pytest.approx(ckpt["losses"], abs=1e-6)
    assert plain["grad_max"] > 1e-3 and plain["grad_diff_vs_ckpt"] <= 1e-6 * plain["grad_max"], plain


def test_the_model_keeps_its_hugging_face_keys(runs):
    got = _part(runs, 8, "ckpt")
    assert got["keys"] == got["plain_keys"]  # as before wrapping: no _orig_module. in the wrapped layers
    assert "model.layers.0.self_attn.q_proj.weight" in got["keys"]
    assert not any("_orig_module" in k or "_fsdp_wrapped_module" in k for k in got["keys"])
    assert got["reloaded_fresh"] == 0.0 and got["reloaded_trained"] == 0.0  # they load back, strict
    assert got["wrapper_keys"][0] == "_orig_module.model.embed_tokens.weight"  # the returned wrapper's own prefix
    assert sorted(got["grad_norms"]) == sorted(got["keys"])  # named_parameters, prefix dropped, name the same


def test_lora_trains_only_the_adapters_with_frozen_weights_sharded_too(runs):
    got = _part(runs, 8, "lora")
    adapters = got["adapters"]
    assert len(adapters) == 8 and got["trainable"] == adapters == got["grads"]  # 2 layers x (q, v) x (A, B)
    assert got["optimized"] == 8  # the optimizer holds the trainable parameters only
    assert got["adapters_changed"] == adapters
    assert len(got["base_unchanged"]) == 21 == got["params"] - 8  # the frozen weights, bitwise as before
    assert len(got["specs"]) == 29 and set(got["specs"].values()) <= set(EIGHT)  # frozen ones sharded too
    assert got["keys"] == got["plain_keys"]  # peft's own keys, as get_peft_model_state_dict reads them
    assert got["wrappers"] == ["base_model.model.model.layers.0", "base_model.model.model.layers.1"]
    # Behind frozen embeddings the first layer is checkpointed too (its input made to need a gradient).
    assert got["attention_calls"] == 2 * 2 * 4
    losses = got["losses"]
    assert losses[-1] < losses[0] - 0.03 and min(losses) < losses[0], losses


def test_one_device_gives_the_losses_of_eight(runs):
    assert runs[1]["devices"] == 1 and runs[1]["spmd"] is True
    one, eight = _part(runs, 1, "ckpt"), _part(runs, 8, "ckpt")
    assert set(one["specs"].values()) == {"{replicated}"}  # one device: nothing to split
    assert one["wrappers"] == eight["wrappers"] and one["keys"] == eight["keys"]
    assert one["losses"] == pytest.approx(eight["losses"], rel=1e-5, abs=1e-5)
    for name, norm in eight["grad_norms"].items():
        assert one["grad_norms"][name] == pytest.approx(norm, rel=1e-4, abs=1e-7), name


def test_fsdp_refuses_what_it_cannot_wrap(runs):
    for devices in (8, 1):
        got = _part(runs, devices, "errors")
        unknown = got["unknown_layer"]
        assert unknown["type"] == "ValueError" and "layers='Nope'" in unknown["message"]
        assert "LlamaDecoderLayer" in unknown["message"] and "layers=False" in unknown["message"]
        assert got["not_a_layer"]["type"] == "TypeError" and "got int 3" in got["not_a_layer"]["message"]
        assert got["checkpoint_without_layers"]["type"] == "ValueError"
        assert "no layer is wrapped" in got["checkpoint_without_layers"]["message"]
        assert got["twice"]["type"] == "ValueError" and "already wrapped" in got["twice"]["message"]
        assert got["layers_false_wrappers"] == [""]  # the returned one alone, as before issue 46
        assert got["by_class_wrappers"] == ["model.layers.0", "model.layers.1"]
