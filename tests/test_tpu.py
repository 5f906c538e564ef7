"""tpukit.estimate and tpukit.tpu: the real TPU compiler (libtpu, compile-only, in its worker process) on this CPU.

No mocks: every estimate here is a step traced lazily on XLA:CPU and compiled
for a TPU target by libtpu's TPU compiler, which runs on a machine without a
TPU. The models are small so each compile takes a few seconds.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import pytest

from conftest import run_python
from estimate_steps import mlp, train_step

tpu = pytest.importorskip("tpukit.tpu")
if not tpu.available():  # the dev extra installs it; a bare install says how
    pytest.skip(f"the TPU compiler is not installed: pip install 'tpukit[tpu-estimate]'", allow_module_level=True)

# libtpu's compiles take minutes on 2 cores (Kaggle's libtpu 0.0.17 spent 327 s on the refused step of
# test_what_to_do_when_it_does_not_fit and its fixes on a loaded machine): more than the default timeout.
pytestmark = pytest.mark.timeout(900)

import torch  # noqa: E402

import tpukit  # noqa: E402
from tpukit import _xla  # noqa: E402


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """One on-disk cache for this module's tests (not the user's ~/.cache)."""
    monkeypatch.setenv("TPUKIT_TPU_CACHE", str(tmp_path_factory.getbasetemp() / "tpu-cache"))


def n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.light
def test_unknown_target_lists_the_known_ones(rt):
    with pytest.raises(tpu.TargetError, match="Known targets: v5e-1.*v5e-8.*v6e-1.*v5p-8.*v4-8"):
        tpu.target("v7x-3")
    model = mlp(16, 16)
    with pytest.raises(ValueError, match="unknown TPU target 'h100'"):
        tpukit.estimate(train_step(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                        torch.ones(2, 16, device=_xla.device()), target="h100")


def test_every_target_is_a_topology_the_compiler_knows(rt):
    # A one-op graph compiled for each slice of the table: the topology names and host bounds are libtpu's.
    x = torch.ones(64, 128, device=_xla.device()) * 2
    proto = _xla.hlo.hlo_module_proto([x])
    for name, t in tpu.TARGETS.items():
        est = tpu.compile_graph(proto, name, num_partitions=1)
        assert est.fits and est.hbm_bytes > 0 and est.message is None, (name, est)
        assert t.chip.source.startswith("https://cloud.google.com/tpu/docs/")


def test_known_mlp_step_has_the_memory_and_flops_it_must(rt):
    batch = 64
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    est = tpukit.estimate(train_step(model, opt), torch.randn(batch, 256, device=_xla.device()), target="v5e-1")
    p = n_params(model)
    assert est.fits and est.target == "v5e-1" and est.message is None
    # The first step creates Adam's two moments: parameters + two moments per chip at least.
    assert est.hbm_bytes >= 3 * 4 * p, est
    assert est.sum_bytes == (est.arguments_bytes + est.outputs_bytes + est.temp_bytes + est.code_bytes
                             - est.aliased_bytes)
    # hbm_bytes is the compiler's own peak where it reports one (libtpu 0.0.21.1, Colab's), else that sum
    # (0.0.17, Kaggle's, leaves the peak at 0); hbm_source says which.
    assert est.hbm_source in ("compiler peak", "sum of buffers") and est.status == "fits", est
    if est.hbm_source == "sum of buffers":
        assert est.hbm_bytes == est.sum_bytes
    assert est.flops >= 4 * p * batch, est
    # The limit is the HBM the compiler lets a program use on a v5e (its refusals: "Used X of 15.75G hbm"),
    # not the chip's 16 GiB.
    assert est.hbm_limit_bytes == int(15.75 * 1024**3) and 0 < est.compile_s < 120
    floor = max(est.flops / 197e12, est.bytes_accessed / 819e9)  # v5e's public peak and bandwidth
    assert est.step_s_min == pytest.approx(floor) and est.bound in ("compute", "memory")
    text, page = str(est), est._repr_html_()
    assert "HBM per chip" in text and "roofline" in text and "<table>" in page
    assert f", {est.hbm_source}" in text and est.hbm_source in tpu.line(est)  # where hbm_bytes comes from
    # It names the compiler that answered: the libtpu and jax installed here (the worker's own report).
    found = tpu.versions()
    assert est.compiler == f"libtpu {found['libtpu']} (jax {found['jax']})" and f"by {est.compiler}" in text
    # Both CI stacks install the libtpu their torch_xla pins (Kaggle's 0.0.17, Colab's 0.0.21.1): no note.
    assert est.compiler_note is None, est.compiler_note


def test_fits_is_the_compilers_verdict_even_when_the_sum_of_buffers_exceeds_the_limit(rt):
    """The sum of the buffers the compiler lists is not what it weighs against the HBM. AdamW's first step
    on 8 layers of 8192 x 8192 (2.1 GB of fp32 weights; its moments are new outputs) at 73728 rows: libtpu
    0.0.17 lists 17.32 GB (arguments 2.15, outputs 6.44, temporaries 10.87, aliased 2.15) against its usable
    16.91 GB (15.75 GiB) and compiles it; the kit once said "does NOT fit". (Its refusal at 106496 rows
    totals reserved + program + arguments, "Used 16.62G of 15.75G hbm", and lists "Output size 6.00G;
    shares 2.00G with arguments" beside it: up to 98304 rows, 20.94 GB of buffers, compile.)"""
    # Uninitialized weights (skip_init): their values do not matter to the compiler, and initializing 537M
    # parameters on XLA:CPU took the Colab stack's test minutes of CPU.
    model = torch.nn.Sequential(*[torch.nn.utils.skip_init(torch.nn.Linear, 8192, 8192, bias=False,
                                                           device=_xla.device()) for _ in range(8)])
    _xla.sync()  # the weights are device data: arguments of the step, not a graph inside it
    step = train_step(model, torch.optim.AdamW(model.parameters()))
    est = tpukit.estimate(step, torch.randn(73728, 8192, device=_xla.device()), target="v5e-1", suggest=False)
    assert est.fits and est.status == "fits" and est.message is None, est
    assert est.sum_bytes > est.hbm_limit_bytes == int(15.75 * 1024**3), est
    # What must be held at once at the end (the arguments and the outputs, less the donated) is below it.
    assert est.arguments_bytes + est.outputs_bytes - est.aliased_bytes < est.hbm_limit_bytes, est
    text = str(est)
    assert ("fits", "yes") in est.rows(), text
    if est.hbm_source == "compiler peak":  # libtpu 0.0.21.1 (Colab's) reports a peak: here the sum itself
        assert est.hbm_bytes > est.hbm_limit_bytes, est
        assert "reported peak exceeds the usable HBM, yet the compiler fits the step" in text, text
    else:  # libtpu 0.0.17 reports none: the sum is shown, named as such, and the text says why it is over
        assert est.hbm_source == "sum of buffers" and est.hbm_bytes == est.sum_bytes, est
        assert "sum of buffers exceeds the usable HBM, yet the compiler fits the step" in text, text
    assert f", {est.hbm_source}" in text and "warning" not in text, text


def test_an_estimate_says_when_its_compiler_is_not_the_runtimes():
    from tpukit.tpu.compiler import pins as compilers

    # torch_xla's releases and the libtpu each pins (setup.py), Colab's and Kaggle's as they ship them.
    assert {r: (c.libtpu, c.jax) for r, c in compilers.RUNTIMES.items()} == {
        (2, 6): ("0.0.7.1", "0.4.38"), (2, 7): ("0.0.11.1", "0.5.3"), (2, 8): ("0.0.17", "0.7.2"),
        (2, 9): ("0.0.21.1", "0.7.2")}
    newest = {"jax": "0.12.0.1", "jaxlib": "0.12.0.1", "libtpu": "0.0.50.1"}
    note = compilers.mismatch(newest, (2, 8))
    assert "libtpu 0.0.50.1" in note and "torch_xla 2.8's runtime runs libtpu 0.0.17" in note, note
    assert compilers.mismatch({"libtpu": "0.0.21"}, (2, 9)) is None  # torch_xla 2.9's pin, Colab's 0.0.21.1
    assert compilers.mismatch({"libtpu": "0.0.17"}, (2, 8)) is None
    assert compilers.mismatch(newest, (3, 0)) is None  # a release the table does not know: nothing to say
    assert compilers.describe(newest) == "libtpu 0.0.50.1 (jax 0.12.0.1)" and compilers.describe({}) == ""
    assert compilers.pin((2, 9)).name == "torch_xla 2.9"
    installed = compilers.pin()  # the torch_xla of this stack
    assert installed is not None and installed.torch_xla == _xla.versions.installed()


def test_in_place_update_is_donated(rt):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    step = train_step(model, opt)
    x = torch.randn(32, 256, device=_xla.device())
    step(x)
    _xla.sync()  # Adam's moments exist: the steady step updates parameters and both moments in place
    est = tpukit.estimate(step, x, target="v5e-1")
    assert est.aliased_bytes >= 3 * 4 * n_params(model), est


def test_the_model_optimizer_and_rng_are_unchanged_after_an_estimate(rt):
    def pair():
        model = mlp(dropout=0.1)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    x = torch.randn(16, 256).to(_xla.device())
    a, opt_a = pair()
    b, opt_b = pair()
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.5)
    step_a = train_step(a, opt_a)

    def with_sched(x):
        out = step_a(x)
        sched.step()
        return out

    for model, opt in ((a, opt_a), (b, opt_b)):  # one real step each (same dropout): moments exist, grads None
        _xla.set_rng_seed(3)
        train_step(model, opt)(x)
        _xla.sync()
    assert all(torch.equal(p.cpu(), q.cpu()) for p, q in zip(a.parameters(), b.parameters()))
    before = [t.cpu().clone() for t in a.parameters()]
    seed, lr, moments = _xla.rng_seed(), opt_a.param_groups[0]["lr"], len(opt_a.state)
    est = tpukit.estimate(with_sched, x, target="v5e-1")
    assert est.fits
    assert not any(_xla.has_pending(list(a.parameters())))  # still device data: no graph added to the next step
    assert all(torch.equal(p.cpu(), q) for p, q in zip(a.parameters(), before))
    assert _xla.rng_seed() == seed and opt_a.param_groups[0]["lr"] == lr and len(opt_a.state) == moments
    assert all(p.grad is None for p in a.parameters()) and sched.last_epoch == 0
    # The next real step gives exactly what it gives on a twin that was never estimated.
    _xla.set_rng_seed(7)
    train_step(a, opt_a)(x)
    _xla.sync()
    _xla.set_rng_seed(7)
    train_step(b, opt_b)(x)
    _xla.sync()
    assert all(torch.equal(p.cpu(), q.cpu()) for p, q in zip(a.parameters(), b.parameters()))


def test_the_same_graph_is_compiled_once(rt):
    model = mlp(128, 512)
    step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 128, device=_xla.device())
    first = tpukit.estimate(step, x, target="v6e-1")
    info = tpu.cache_info()
    again = tpukit.estimate(step, x, target="v6e-1")
    after = tpu.cache_info()
    assert after["hits"] == info["hits"] + 1 and after["misses"] == info["misses"]
    assert again == first  # the same answer, the compiler's own compile time included
    future = tpu.compile_graph_async(_xla.hlo.hlo_module_proto([x * 3]), "v6e-1")
    assert future.result(timeout=300).fits


CELL = """
model = mlp(80, 208)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

def step(x):
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss
"""


def test_a_notebook_cells_step_is_the_caches_answer_after_a_kernel_restart(rt):
    """The graph's op metadata names each op's file, and a notebook cell's file is in a folder named by its
    kernel's process id: the same cell in a restarted kernel (another id) is the cache's answer; an edited
    cell (another file name) is a new question."""
    from tpukit.tpu import trace
    from tpukit.tpu.compiler import worker

    def cell(kernel_pid, name="3120539446.py"):  # ipykernel's file for a cell: <tmp>/ipykernel_<pid>/<hash>.py
        scope = {"mlp": mlp, "torch": torch}
        exec(compile(CELL, f"/tmp/ipykernel_{kernel_pid}/{name}", "exec"), scope)
        return scope["step"]

    x = torch.randn(4, 80, device=_xla.device())
    before_restart, after_restart, edited = cell(1111), cell(2222), cell(2222, "981220374.py")
    hlos = [trace.trace(step, (x,), {}).hlo for step in (before_restart, after_restart, edited)]
    assert b"/tmp/ipykernel_1111/3120539446.py" in hlos[0] and b"ipykernel_2222" in hlos[1]  # what the key meets
    keys = [worker.Request(hlo, tpu.target("v5e-1")).key() for hlo in hlos]
    assert keys[0] == keys[1] != keys[2]

    first = tpukit.estimate(before_restart, x, target="v5e-1")
    info = tpu.cache_info()
    again = tpukit.estimate(after_restart, x, target="v5e-1")
    after = tpu.cache_info()
    assert after["hits"] == info["hits"] + 1 and after["misses"] == info["misses"], (info, after)
    assert again == first


def test_the_same_graph_asked_for_twice_at_once_is_compiled_once(rt):
    """Two threads ask for one graph and target together (``%%xla`` and the follower do): the second waits
    for the first's compile instead of compiling it again, and both get its answer."""
    import threading

    model = mlp(96, 352)  # a shape no other test compiles: not in the cache yet
    loss = model(torch.randn(8, 96, device=_xla.device())).pow(2).mean()
    loss.backward()
    proto = _xla.hlo.hlo_module_proto([loss] + [p.grad for p in model.parameters()])
    _xla.sync()
    start, answers = threading.Barrier(2), [None, None]

    def ask(i):
        start.wait()
        answers[i] = tpu.compile_graph(proto, "v5e-1", name="step")

    before = tpu.cache_info()
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    after = tpu.cache_info()
    assert answers[0] is not None and answers[0].fits, answers
    assert after["misses"] == before["misses"] + 1, (before, after)
    assert answers[1] == answers[0]  # one compile's answer, its compile time included


SUMMARY_WHILE_COMPILING = r"""
import json, os, signal, time, tpukit
rt = tpukit.setup(device="cpu", target="v5e-1")
import torch
tpukit.tpu.compiler.worker.warm(tpukit.tpu.compiler.resolve())
pid = tpukit.tpu.worker_pid()
open(os.environ["WORKER_PID_FILE"], "w").write(str(pid))
os.kill(pid, signal.SIGSTOP)  # the worker is busy: as with a graph that takes the compiler minutes
try:
    model = torch.nn.Linear(48, 24).to(rt.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = tpukit.track([torch.randn(4, 48) for _ in range(3)], progress=False)
    for x in tracker:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    deadline = time.time() + 120
    while not tpukit.tpu.follower().pending() and time.time() < deadline:  # the follower has the loop's graph
        time.sleep(0.1)
    compiling, t0 = tpukit.tpu.follower().pending(), time.time()
    early = tracker.summary()["tpu"]
    early_s = time.time() - t0
finally:
    os.kill(pid, signal.SIGCONT)  # else this process would wait at exit for the compile under way
later = tracker.summary(wait=300)["tpu"]
print("RESULT " + json.dumps({"compiling": compiling, "early": early, "early_s": early_s, "later": later}))
"""


def test_summary_reports_answers_still_being_compiled_as_pending_without_waiting_for_them(tmp_path):
    """With a target set, ``summary()`` returns within seconds while the TPU compiler is still busy with
    the loop's graphs, saying their answers are pending; ``summary(wait=...)`` waits for them."""
    import signal

    pid_file = tmp_path / "worker.pid"
    try:
        done = run_python(SUMMARY_WHILE_COMPILING, timeout=600,
                          env={"PJRT_DEVICE": "CPU", "TPUKIT_TPU_CACHE": str(tmp_path / "cache"),
                               "WORKER_PID_FILE": str(pid_file)})
    finally:
        if pid_file.exists():  # never leave a stopped worker behind, whatever happened to its parent
            try:
                os.kill(int(pid_file.read_text()), signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert out["compiling"] >= 1 and out["early_s"] < 10, out  # 60 s before: it waited for the answers
    assert out["early"] and all(r["pending"] and not r["answered"] for r in out["early"]), out
    assert out["later"] and all(r["answered"] and not r["pending"] and r["fits"] for r in out["later"]), out


def test_the_compiler_runs_in_its_worker_never_here(rt):
    jax_here = "jax" in sys.modules  # another test's library (transformers) may have imported jax itself
    model = mlp(64, 64)
    tpukit.estimate(train_step(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                    torch.randn(4, 64, device=_xla.device()), target="v5e-1")
    pid = tpu.worker_pid()
    assert pid is not None and pid != os.getpid()
    assert ("jax" in sys.modules) == jax_here  # an estimate imports no jax here
    with open("/proc/self/maps") as maps:
        assert "libtpu" not in maps.read()
    with open(f"/proc/{pid}/maps") as maps:
        worker_maps = maps.read()
    assert "libtpu" in worker_maps
    # libtpu would leave a log file named after the worker's pid in /tmp/tpu_logs at every start.
    assert not list(Path("/tmp/tpu_logs").glob(f"*.{pid}"))
    # The worker runs libtpu on mimalloc when the extra installed it (Kaggle's stack here), else on glibc's
    # malloc (Colab's pins have no cmeel-mimalloc): the preload takes effect there and never here.
    lib = tpu.compiler.worker.allocator()
    assert ("libmimalloc" in worker_maps) == (lib is not None and not os.environ.get("LD_PRELOAD"))
    with open("/proc/self/maps") as maps:
        assert "libmimalloc" not in maps.read()


def attention_step(seq):
    """One attention layer's training step: libtpu would rewrite it into flash attention, torch_xla says not to."""
    torch.manual_seed(0)
    heads, dim = 16, 64
    proj = torch.nn.Linear(heads * dim, 3 * heads * dim).to(_xla.device())
    opt = torch.optim.SGD(proj.parameters(), lr=0.1)

    def step(x):
        q, k, v = proj(x).view(1, seq, 3, heads, dim).permute(2, 0, 3, 1, 4)
        out = ((q @ k.transpose(-1, -2)) / dim**0.5).softmax(-1) @ v
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, torch.randn(1, seq, heads * dim, device=_xla.device())


def test_the_compile_gets_torch_xlas_runtime_flags_and_the_users_win(rt, monkeypatch):
    from tpukit.tpu.compiler.flags import compile_flags, user_flags

    assert compile_flags(tpu.target("v5e-8"))["xla_enable_async_all_gather"] == "true"  # torch_xla: v5 only
    assert "xla_enable_async_all_gather" not in compile_flags(tpu.target("v6e-1"))
    assert user_flags("--xla_tpu_enable_flash_attention=true --foo") == {
        "xla_tpu_enable_flash_attention": "true", "foo": "true"}
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    step, x = attention_step(1024)
    kit = tpukit.estimate(step, x, target="v5e-1", suggest=False)

    def users(value):
        # The user's LIBTPU_INIT_ARGS names the flag: compiled by a new worker (libtpu reads its flags when
        # it loads), not served from another setting's cache entry.
        monkeypatch.setenv("LIBTPU_INIT_ARGS", f"--xla_tpu_enable_flash_attention={value}")
        assert "xla_tpu_enable_flash_attention" not in compile_flags(tpu.target("v5e-1"))
        pid, misses = tpu.worker_pid(), tpu.cache_info()["misses"]
        est = tpukit.estimate(step, x, target="v5e-1", suggest=False)
        assert tpu.cache_info()["misses"] == misses + 1 and tpu.worker_pid() not in (None, pid)
        return est

    plain, flash = users("false"), users("true")
    # The kit compiles what torch_xla's runtime does (flash attention off), to the byte and the FLOP.
    assert (kit.flops, kit.temp_bytes, kit.hbm_bytes) == (plain.flops, plain.temp_bytes, plain.hbm_bytes)
    if tuple(int(p) for p in tpu.versions()["libtpu"].split(".")[:3]) >= (0, 0, 42):
        # libtpu 0.0.42+ rewrites this attention by default: another program, fewer FLOPs (0.0.21.1, Colab's,
        # leaves it as it is).
        assert kit.flops > flash.flops * 1.03, (kit.flops, flash.flops)


def test_an_oversized_step_is_refused_with_the_compilers_numbers(rt):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = mlp(1024, 4096)
    step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(1 << 20, 1024, device=_xla.device())  # 4 GiB of input, never materialized
    est = tpukit.estimate(step, x, target="v5e-1", suggest=False)
    assert not est.fits and est.status == "too big" and est.hbm_source == "compiler refusal", est
    assert "RESOURCE_EXHAUSTED" in est.message or "memory" in est.message.lower(), est.message
    assert est.hbm_bytes > est.hbm_limit_bytes > 15 * 1024**3, est  # both parsed from the compiler's message
    assert "NO (too big)" in str(est) and "does NOT fit (too big" in tpu.line(est)
    # Why, in the compiler's words: its largest allocations, the biggest first, are this batch's activations
    # (1M rows of the 4096-wide hidden layer: 16 GiB in f32), and the estimate's text shows them.
    why = est.refusal
    assert why is not None and why.used_bytes == est.hbm_bytes, why
    # The limit is the HBM the compiler lets a program use, as its refusal says ("Used 30.00G of 15.75G hbm",
    # libtpu 0.0.17), the figure the chip table keeps for steps that fit; not the chip's 16 GiB. (The older
    # phrasing of one allocation names the whole 16 GiB: the table's figure stands then.)
    assert est.hbm_limit_bytes == tpu.target("v5e-1").usable_hbm_bytes == int(15.75 * 1024**3), est
    assert why.limit_bytes == est.hbm_limit_bytes or "would exceed memory" in est.message, why
    top = why.largest()
    assert top and top[0].bytes == max(a.bytes for a in why.allocations) and "1048576" in top[0].shape, top
    assert top[0].bytes >= 4 * 1024**3 and top[0].kind and top[0].instruction != "?", top[0]
    assert why.program_bytes is None or why.program_bytes <= why.used_bytes
    assert "why: the largest buffers" in str(est) and top[0].shape in str(est), str(est)
    assert tpu.compiler.refusal.parse("INVALID_ARGUMENT: something else") is None
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    assert grown < 1024**3, f"host memory grew {grown / 1e9:.1f} GB"


def big_step():
    """AdamW on ``mlp(1024, 8192)`` and a batch of 2**19 rows (about 30 GB per step: twice a v5e's HBM).

    test_what_to_do_when_it_does_not_fit and test_largest_batch ask about the same graphs: the batch
    sizes the suggestions' search compiles (of ``x[:b]``) are the first a search from 2**18 compiles,
    so they are answered from the session's cache.
    """
    model = mlp(1024, 8192)
    step = train_step(model, torch.optim.AdamW(model.parameters()))
    return step, torch.randn(1 << 19, 1024, device=_xla.device())


def test_what_to_do_when_it_does_not_fit(rt):
    step, x = big_step()
    est = tpukit.estimate(step, x, target="v5e-1")
    assert not est.fits
    tips = {s.change.split(" ")[0]: s for s in est.advice}
    assert set(tips) >= {"batch", "accumulate", "bf16", "FSDP"}, est.advice
    smaller = tips["batch"]
    assert smaller.fits and smaller.hbm_bytes <= est.hbm_limit_bytes and int(smaller.change.split()[1]) < 1 << 19
    assert tips["FSDP"].hbm_bytes is not None and "v5e-8" in tips["FSDP"].how
    assert "try: batch" in str(est)


def test_largest_batch(rt):
    step, x = big_step()
    fit = tpukit.largest_batch(step, lambda b: x[:b], target="v5e-1", start=1 << 18)
    assert fit.estimate.fits and fit.batch > 1 << 15 and len(fit.tried) <= 5, fit
    assert fit.estimate.hbm_bytes >= 0.85 * fit.estimate.hbm_limit_bytes, fit  # it fills the chip
    # Bounded by a refusal: the compiler refused a size above the answer, within the search's precision
    # (1/32 of the batch), so an eighth more does not fit; asked again, that size is the cache's answer.
    assert not fit.at_limit and fit.refused is not None and (fit.refused, False) in fit.tried, fit
    assert fit.batch < fit.refused <= fit.batch + max(8, fit.batch // 32) <= fit.batch * 9 // 8, fit
    misses = tpu.cache_info()["misses"]
    over = tpukit.estimate(step, x[:fit.refused], target="v5e-1", suggest=False)
    assert not over.fits and tpu.cache_info()["misses"] == misses, (fit, over)
    # It names the compiler that answered, as its estimates do.
    assert fit.compiler == fit.estimate.compiler == over.compiler != "", fit
    text = str(fit)
    assert "v5e-1: batch" in text and f"{fit.refused} refused" in text and f"by {fit.compiler}" in text, text


def test_a_search_that_reaches_its_limit_says_so(rt):
    model = mlp(128, 512)
    step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # Its first size is test_the_same_graph_is_compiled_once's step: the cache's answer.
    fit = tpukit.largest_batch(step, lambda b: torch.randn(b, 128, device=_xla.device()), target="v6e-1",
                               limit=64)
    # Far below what fits: the search stops at its limit, the answer is a lower bound, and says so.
    assert fit.batch == 64 and fit.at_limit and fit.refused is None and fit.tried == ((8, True), (64, True)), fit
    assert fit.compiler == fit.estimate.compiler != "", fit
    text = str(fit)
    assert "the search stopped at its limit 64" in text and f"by {fit.compiler}" in text, text


def test_a_fit_without_a_refusal_says_it_is_a_lower_bound():
    # The tried sizes of two real searches (bench/tpu_estimate.py, BERT-base bf16 on v5e-8 FSDP): the
    # first stopped with the chip 98 % full and nothing refused, yet 2064 rows fit too (17.09 GB).
    from tpukit.tpu import BatchFit

    lower = BatchFit("v5e-8", 1632, None, ((64, True), (128, True), (696, True), (1632, True)))
    bounded = BatchFit("v5e-8", 2064, None, ((16, True), (32, True), (4096, False), (2064, True)))
    assert lower.refused is None and bounded.refused == 4096
    assert lower.compiler == "" and not lower.at_limit  # built as before the search named its compiler
    assert "no batch fits (tried 8, 4) by libtpu 0.0.17" in str(
        BatchFit("v5e-1", 0, None, ((8, False), (4, False)), "libtpu 0.0.17 (jax 0.7.2)"))


def test_a_search_whose_guesses_overshoot_narrows_the_gap_whatever_its_compile_budget():
    # The search's arithmetic, replayed on the answers libtpu 0.0.21.1 gave for BERT-large's fp32 step on a
    # v5e-1 (bench/results/tpu_estimate.json: 4 and 8 rows fit, 8 at 4.47 GB; 192 and 184 refused). That search
    # costs 15 minutes of real TPU compiles, and what is tested here is what the search does with the answers:
    # the answers are the recorded ones where recorded, and a rising HBM that fits up to 64 rows elsewhere.
    from tpukit.tpu.search import _sizes
    from tpukit.tpu.outcome import TpuEstimate

    limit, gb, v5e1 = 16_911_433_728, 1e9, "v5e-1"

    def at(b):
        hbm = (3.93 + 0.0676 * b) if b <= 8 else 4.47 + 0.19 * (b - 8)
        return TpuEstimate(target=v5e1, status="fits" if b <= 64 else "too big", hbm_bytes=int(hbm * gb),
                           hbm_limit_bytes=limit,
                           arguments_bytes=0, outputs_bytes=0, aliased_bytes=0, temp_bytes=0, code_bytes=0,
                           compile_s=0.0, flops=0.0, bytes_accessed=0.0, step_s_min=0.0, bound="memory",
                           compiler="libtpu 0.0.21.1 (jax 0.7.2)")

    fit = _sizes(at, v5e1, start=4, limit=4096, steps=1)
    assert fit.tried[:4] == ((4, True), (8, True), (192, False), (184, False)), fit.tried  # the bench's own search
    assert fit.refused is not None and fit.refused <= 2 * fit.batch, fit  # not "8 fits, 184 refused"
    assert 32 < fit.batch <= 64 and all(fits == (b <= 64) for b, fits in fit.tried), fit
    assert fit.compiler == "libtpu 0.0.21.1 (jax 0.7.2)" and "refused" in str(fit)


def test_largest_batch_split_over_a_targets_chips_gives_every_chip_rows(rt):
    model = mlp(1024, 8192)
    step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def make(b):
        return torch.randn(b, 1024, device=_xla.device())

    # A batch of 2 or 4 split over 8 chips is padded to a row per chip: its HBM says nothing about the
    # next row, and a slope taken there sent the search to the limit (BERT-large: "largest batch 8").
    # bisect=0: the search stops at its first refusal, without narrowing the gap below it (this test is
    # about where it starts and how far it gets, each compile of this step taking 10-40 s).
    fit = tpukit.largest_batch(step, make, target="v5e-8", start=2, fsdp=True, bisect=0)
    assert all(b % 8 == 0 for b, _ in fit.tried) and fit.tried[0][0] == 64, fit  # 8 rows per chip first
    # Most of the chip, not a few rows of it: the compiler's HBM is not even monotonic in the batch here
    # (libtpu 0.0.50.1: 250016 rows took 13.9 GB, 316008 rows 13.0 GB; libtpu 0.0.17: 305728 rows 74 % of
    # the chip, 495032 rows 79 %, 618784 rows 106 % and fits), so no slope lands exactly: a refusal bounds it.
    assert fit.estimate.fits and fit.estimate.hbm_bytes >= 0.7 * fit.estimate.hbm_limit_bytes, fit
    assert fit.batch >= 100_000 and len(fit.tried) <= 8, fit
    assert not fit.at_limit and fit.refused is not None and fit.tried[-1] == (fit.refused, False), fit


def test_bucket_costs_feed_the_advisor(rt):
    from tpukit.data import suggest_buckets

    emb = torch.nn.Embedding(1000, 64).to(_xla.device())
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)

    def step(ids):
        loss = emb(ids).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    costs = tpu.bucket_costs(lambda n: tpukit.estimate(step, torch.zeros(8, n, dtype=torch.long,
                                                                         device=_xla.device()), target="v5e-1"),
                             [32, 128], target="v5e-1")
    assert set(costs["step_time"]) == {32, 128} and costs["compile_s"] > 0
    assert costs["step_time"][128] >= costs["step_time"][32] > 0
    advice = suggest_buckets([20, 30, 100, 120], 8, **costs)
    assert advice.buckets[-1] >= 120


def test_a_graph_the_compiler_cannot_read_is_a_record_not_an_exception(rt):
    est = tpu.compile_graph(b"not an HLO module", "v5e-1", name="broken")
    assert not est.fits and "broken" in est.message
    assert est.status == "does not compile" and "NO (does not compile)" in str(est), est


SPMD = r"""
import json, torch, tpukit
from tpukit import _xla
rt = tpukit.setup(device="cpu", cpu_devices=4, spmd=True)
mesh = tpukit.mesh()
out = {}
for kind in ("replicated", "fsdp"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
    model = model.to(_xla.device())
    if kind == "fsdp":
        model = tpukit.fsdp(model, mesh)
    opt = torch.optim.AdamW(model.parameters())
    x = tpukit.shard_batch(torch.randn(16, 1024), mesh)
    def step(x):
        loss = model(x).pow(2).mean(); loss.backward(); opt.step(); opt.zero_grad(); return loss
    before = [p.detach().cpu().clone() for p in model.parameters()]
    est = tpukit.estimate(step, x, target="v5e-4")
    same = all(torch.equal(p.detach().cpu(), q) for p, q in zip(model.parameters(), before))
    out[kind] = dict(hbm=est.hbm_bytes, outputs=est.outputs_bytes, aliased=est.aliased_bytes, fits=est.fits,
                     same=same, params=sum(p.numel() for p in model.parameters()))
print(json.dumps(out))
"""


def test_spmd_fsdp_step_over_four_chips(tmp_path):
    proc = run_python(SPMD, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4",
                                 "TPUKIT_TPU_CACHE": str(tmp_path)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rep, fsdp = out["replicated"], out["fsdp"]
    assert rep["fits"] and fsdp["fits"] and rep["same"] and fsdp["same"], out
    assert fsdp["hbm"] <= 0.45 * rep["hbm"], out
    assert fsdp["outputs"] <= 0.45 * rep["outputs"], out  # outputs keep their shardings, not replicated
    assert fsdp["aliased"] > 0, out


ORPHAN = """
import os, signal, sys, threading, time
import tpukit
rt = tpukit.setup(device="cpu")
import torch
from tpukit.tpu import worker_pid
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(96)]).to(rt.device)
opt = torch.optim.AdamW(model.parameters())
def step(x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss
threading.Thread(target=tpukit.estimate, args=(step, torch.ones(64, 2048, device=rt.device)),
                 kwargs=dict(target="v5e-1", suggest=False), daemon=True).start()
while worker_pid() is None:
    time.sleep(0.05)
print(worker_pid(), flush=True)


def cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# Wait until the graph is traced, sent and compiling: the worker burns CPU (on a loaded machine the
# trace alone can take longer than any fixed sleep).
deadline = time.monotonic() + float(sys.argv[1])
while True:
    busy = cpu(worker_pid())
    time.sleep(0.5)
    busy = cpu(worker_pid()) - busy  # the worker's CPU seconds in that half second
    if busy > 0.05 or time.monotonic() > deadline:
        break
print(busy, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # a kernel killed mid-compile: no exit hook runs
"""


def test_the_worker_ends_with_the_process_that_started_it_even_mid_compile(tmp_path):
    # A 96-layer MLP step takes the TPU compiler about 25 s here; its starter is killed as soon as
    # the worker is seen compiling.
    import subprocess
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_XLA_DEBUG", "XLA_FLAGS"))}
    env.update(PJRT_DEVICE="CPU", TPUKIT_TPU_CACHE=str(tmp_path))
    starter = subprocess.Popen([sys.executable, "-c", ORPHAN, "60"], stdout=subprocess.PIPE, text=True, env=env)
    pid = int(starter.stdout.readline())
    busy = float(starter.stdout.readline())
    assert starter.wait(timeout=120) == -9
    # Busy, so not reading its stdin: the closed pipe alone would not end it before its compile did.
    assert busy > 0.05, busy
    killed = time.monotonic()
    while time.monotonic() - killed < 60:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the TPU compiler's worker {pid} outlived its starter by 60 s")
    gone_after = time.monotonic() - killed
    assert gone_after < 5, gone_after  # the watch notices within a second or two, long before the compile ends
