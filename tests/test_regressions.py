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

import estimate_steps
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


def mlp():
    return estimate_steps.mlp(16, 32)


def train_step(model):
    return estimate_steps.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))


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
    assert lines[1] == "Callback tpukit.hf False", lines  # not with the Callback either (issue 44: it loads torch_xla)
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


@pytest.mark.light
@needs_tpu_compiler
def test_estimate_without_any_target_says_how_to_name_one(rt, monkeypatch):
    monkeypatch.delenv("TPUKIT_TARGET", raising=False)
    if tpukit.runtime.tpu_target() is not None:
        pytest.skip("this session's runtime has a target")
    with pytest.raises(tpukit.TpukitError, match=r"no TPU target: pass target=.*tpukit.setup\(target='v5e-1'\)"):
        tpukit.estimate(train_step(mlp()), torch.randn(8, 16, device=_xla.device()))


# ---------------------------------------------------------------------------------------- 3. tied weights


@needs_tpu_compiler
def test_estimate_ties_again_what_the_move_to_the_device_untied_and_counts_it_once(rt, tpu_cache):
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied on the CPU
    model.to(_xla.device())
    # The trap itself (torch_xla 2.8 and 2.9): every parameter gets a new tensor on the device.
    assert model.lm_head.weight is not model.transformer.wte.weight
    ids = torch.randint(0, 64, (4, 16), device=_xla.device())
    with pytest.warns(TpukitWarning, match=r"lm_head\.weight and transformer\.wte\.weight tied but holds them as two "
                      r"tensors.*tpukit\.estimate tied them again with model\.tie_weights\(\)"):
        tied = tpukit.estimate(lm_step(model), ids, target="v5e-1", suggest=False)
    assert model.lm_head.weight is model.transformer.wte.weight

    # A model that cannot tie itself again (no tie_weights(): an attribute set on this instance stands for
    # one) is told how, and its estimate counts the two copies: the tied one counts the embedding once.
    apart = gpt2().to(_xla.device())
    apart.tie_weights = None
    with pytest.warns(TpukitWarning, match=r"could not tie them again\. Call model\.tie_weights\(\).*"
                      r"model\.lm_head\.weight = model\.transformer\.wte\.weight"):
        untied = tpukit.estimate(lm_step(apart), ids, target="v5e-1", suggest=False)
    assert untied.arguments_bytes - tied.arguments_bytes >= 64 * 32 * 4, (tied.arguments_bytes, untied.arguments_bytes)


def test_track_ties_again_what_the_move_to_the_device_untied(rt):
    model = gpt2().to(_xla.device())
    assert model.lm_head.weight is not model.transformer.wte.weight
    step = lm_step(model)
    batches = [torch.randint(0, 64, (4, 16)) for _ in range(2)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for ids in tpukit.track(batches, progress=False):
            step(ids)
    said = [w for w in record if issubclass(w.category, TpukitWarning) and "lm_head.weight" in str(w.message)]
    assert len(said) == 1, tpukit_warnings(record)  # once, at the model's first forward
    assert "tpukit.track tied them again" in str(said[0].message)
    assert said[0].filename == __file__, said[0].filename  # the user's line that called the model
    assert model.lm_head.weight is model.transformer.wte.weight


# ---------------------------------------------------------------------------------------- 4. estimate's inputs


@needs_tpu_compiler
def test_estimate_moves_a_batch_on_the_host_to_the_device(rt, tpu_cache):
    model = mlp()
    on_host = torch.randn(8, 16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        est = tpukit.estimate(train_step(model), on_host, target="v5e-1", suggest=False)
    assert est.fits and est.note is None
    assert not tpukit_warnings(record)
    assert on_host.device.type == "cpu"  # the caller's tensor is left where it was
    same = tpukit.estimate(train_step(model), on_host.to(_xla.device()), target="v5e-1", suggest=False)
    assert (est.arguments_bytes, est.temp_bytes) == (same.arguments_bytes, same.temp_bytes)


@needs_tpu_compiler
def test_estimate_warns_about_a_step_that_reads_a_value_from_the_device(rt, tpu_cache):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def step(x):
        loss = model(x).pow(2).mean()
        seen.append(loss.item())  # a device-to-host read: the forward runs here, mid-trace
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with pytest.warns(TpukitWarning, match=r"the step 'test_estimate_warns_about_a_step_that_reads_a_value_from_the_"
                      r"device.<locals>.step' read 1 value\(s\) from the device.*\.item\(\)"):
        tpukit.estimate(step, torch.randn(8, 16, device=_xla.device()), target="v5e-1", suggest=False)
    assert len(seen) == 1


@needs_tpu_compiler
def test_estimate_says_a_step_without_backward_is_a_forward(rt, tpu_cache):
    model = mlp()
    x = torch.randn(8, 16, device=_xla.device())

    def forward(x):
        return model(x).pow(2).mean()

    with pytest.warns(TpukitWarning, match="has no backward pass and no optimizer update"):
        est = tpukit.estimate(forward, x, target="v5e-1", suggest=False)
    assert est.note and est.note.startswith("forward only") and "note" in str(est)
    model.eval()  # inference, on purpose: said in the estimate, not warned about
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        est = tpukit.estimate(forward, x, target="v5e-1", suggest=False)
    assert not tpukit_warnings(record) and est.note.startswith("forward only")
    model.train()
    assert tpukit.estimate(train_step(model), x, target="v5e-1", suggest=False).note is None


# ---------------------------------------------------------------------------------------- 5. recompilations


def _shape_changing_loop(rows: list[int], **options):
    torch.manual_seed(0)
    model = torch.nn.Linear(13, 7).to(_xla.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = tpukit.track([torch.randn(n, 13) for n in rows], progress=False, **options)
    for x in tracker:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return tracker


def _alarm_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tpukit" and "recompilation" in r.getMessage()]


def test_a_recompilation_after_warmup_is_said_in_one_line(rt, caplog):
    caplog.set_level(logging.WARNING, logger="tpukit")
    tracker = _shape_changing_loop([11, 11, 11, 9, 9])  # the batch changes shape at step 4
    assert tracker.summary()["recompilations"] == 1
    lines = _alarm_lines(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith("tpukit: recompilation at step 4:") and "(11, 13) -> (9, 13)" in lines[0], lines[0]


def test_alarms_false_keeps_a_recompilation_quiet(rt, caplog):
    caplog.set_level(logging.WARNING, logger="tpukit")
    tracker = _shape_changing_loop([10, 10, 10, 8, 8], alarms=False)
    assert tracker.summary()["recompilations"] == 1  # counted, not said
    assert _alarm_lines(caplog) == []


SPMD_THEN_GLOO = """
import sys, tempfile, torch, tpukit
rt = tpukit.setup(device="cpu", cpu_devices=4, spmd=True)
x = tpukit.shard_batch(torch.randn(8, 4), tpukit.mesh())
model = tpukit.fsdp(torch.nn.Linear(8, 8).to(rt.device), tpukit.mesh())  # mark_sharding on each parameter
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
dist.barrier()
print("torchax" in sys.modules, torch._C._get_privateuse1_backend_name())
try:
    import torchax  # the user asking for it is told why not, and how
except ImportError as exc:
    print("TPUKIT_ALLOW_TORCHAX=1" in str(exc))
"""


def test_sharding_leaves_torchs_privateuse1_backend_to_torch_distributed():
    # torch_xla 2.8's mark_sharding imported torchax whenever jax was installed (Kaggle's TPU image, and
    # .venv's pins): torchax renamed torch's privateuse1 backend to "jax", and a gloo barrier then raised
    # "Please register PrivateUse1HooksInterface" (a slice's sharded checkpoint failed in notebook 08).
    out = run_python(SPMD_THEN_GLOO, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["False", "privateuseone", "True"], out.stdout


def test_the_optimizers_first_step_is_said_in_the_users_terms(rt):
    """Issue #37: "new graph at step 2: -231 ops (2127 -> 1896); +58 inputs" is the optimizer creating its
    state in its first step: the evidence says so before the compiler's terms, and only there (SGD without
    momentum creates no state: no second graph)."""
    import torch

    def run(make_opt):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2).to(rt.device)
        opt = make_opt(model.parameters())
        data = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(4)]
        tracker = tpukit.track(data, progress=False)
        for x, y in tracker:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return [(r.step, e) for r in tracker.history for e in r.compile_events]

    adam = run(torch.optim.AdamW)
    second = [e for step, e in adam if step == 2]
    assert len(second) == 1 and second[0].kind == "new graph", [e.describe() for _, e in adam]
    assert "state the first step created (an optimizer's, e.g. Adam's moments) is an input now" in second[0].describe()
    assert "+4 inputs" in second[0].describe()  # the compiler's terms stay, after
    assert not any("state the first step created" in e.describe() for step, e in adam if step != 2)
    plain = run(lambda p: torch.optim.SGD(p, lr=0.1))
    assert not any("state the first step created" in e.describe() for _, e in plain), [e.describe() for _, e in plain]


def test_the_dashboards_count_says_which_compiles_summary_counts(rt, capsys):
    """Issue #37: the dashboard's final line said "3 compiles" where ``summary()["compiles"]`` said 2. The
    third was the model's evaluation before the loop, queued on the device and run by the sync the loop makes
    as it begins (so step 1 measures only itself): in no step's record. The line says where each was, the
    summary counts it apart, and the loop's first graph is not compared with that evaluation's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(11, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).to(rt.device)
    with torch.no_grad():
        before_loop = model(torch.randn(5, 11, device=rt.device)).sum()  # queued, not run: the loop runs it
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    capsys.readouterr()
    tracker = tpukit.track([torch.randn(7, 11) for _ in range(4)], progress=False, dashboard=True)
    for x in tracker:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    out = capsys.readouterr().out
    assert before_loop.device.type == "xla"
    s = tracker.summary()
    done = next(line for line in out.splitlines() if line.startswith("tpukit: done"))
    assert f"· 2 compiles ({s['compiles']} in the 4 steps, 1 before them) ·" in done, (done, s["compiles"])
    assert (s["steps"], s["compiles"], s.get("compiles_before")) == (4, 1, 1), s
    assert "new graph before step 1: earlier-work flush graph at " in out, out
    (first,) = tracker.history[0].compile_events
    assert first.evidence[0].startswith("first graph here"), first.describe()  # not a diff against the evaluation
    assert "new graph at step 1: step graph at " in out and "state the first step created" not in out, out
