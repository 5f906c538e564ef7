"""Which TPU compiler answers: the runtime's by default, another on request, each in its own environment.

No mocks: the compilers are the real jax/libtpu pairs. The installed torch_xla's pair is the one installed
here on both CI stacks (Kaggle's: torch_xla 2.8, libtpu 0.0.17; Colab's: torch_xla 2.9, libtpu 0.0.21.1);
the other stack's pair is built once for this module, from the package index, into a fresh folder (uv's or
pip's own cache makes that a few seconds once it has the wheels; about 300 MB of downloads without).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

tpu = pytest.importorskip("tpukit.tpu")
if not tpu.available():  # the dev extra installs it; a bare install says how
    pytest.skip("the TPU compiler is not installed: pip install 'tpukit[tpu-estimate]'", allow_module_level=True)

pytestmark = pytest.mark.timeout(1200)

import torch  # noqa: E402

import tpukit  # noqa: E402
from tpukit import TpukitWarning, _xla, runtime  # noqa: E402
from tpukit.tpu.compiler import pins as compilers, venvs as envs, worker  # noqa: E402
from estimate_steps import mlp, train_step  # noqa: E402

HERE = compilers.pin()  # the pair of this stack's torch_xla (installed here)
OTHER = "torch_xla 2.9" if HERE.torch_xla == (2, 8) else "torch_xla 2.8"  # the other CI stack's


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """One on-disk answer cache for this module's tests (not the user's ~/.cache)."""
    monkeypatch.setenv("TPUKIT_TPU_CACHE", str(tmp_path_factory.getbasetemp() / "tpu-cache"))


@pytest.fixture(scope="module")
def compilers_dir(tmp_path_factory):
    """A fresh folder for the compilers' environments, for this module (each is built once per run)."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("compilers")
        mp.setenv(envs.ENV_VAR, str(path))
        yield path


@pytest.fixture(scope="module")
def other(compilers_dir):
    """The other CI stack's compiler, its environment built here (once): (Compiler, its python, seconds)."""
    comp = compilers.resolve(OTHER)
    start = time.perf_counter()
    exe = envs.python(comp.versions(), comp.name)
    seconds = time.perf_counter() - start
    print(f"\n{OTHER}'s compiler environment built in {seconds:.1f} s")
    yield comp, exe, seconds
    worker._process(comp).stop()


def test_compiler_names():
    c = compilers.resolve("torch_xla 2.6")
    assert (c.name, c.libtpu, c.jax, c.versions()["jaxlib"]) == ("torch_xla 2.6", "0.0.7.1", "0.4.38", "0.4.38")
    assert compilers.resolve("torch_xla==2.7.0").versions() == {"jax": "0.5.3", "jaxlib": "0.5.3",
                                                                 "libtpu": "0.0.11.1"}
    assert compilers.resolve("Torch_XLA 2.8").name == "torch_xla 2.8"
    by_libtpu = compilers.resolve("libtpu 0.0.17")
    assert (by_libtpu.name, by_libtpu.jax) == ("libtpu 0.0.17", "0.7.2")
    assert compilers.resolve("libtpu 0.0.21").libtpu == "0.0.21.1"  # torch_xla 2.9's pin, as Colab ships it
    pair = compilers.resolve("libtpu 0.0.50.1 jax 0.12.0.1")  # any pair, named in full; the name round-trips
    assert pair.versions()["jax"] == "0.12.0.1" and compilers.resolve(pair.name) == pair
    assert compilers.resolve(pair) is pair
    assert compilers.resolve("installed").versions() == tpu.versions()
    # What an estimate's text calls them.
    assert compilers.resolve("torch_xla 2.8").label == "torch_xla 2.8's compiler, libtpu 0.0.17 (jax 0.7.2)"
    assert by_libtpu.label == "libtpu 0.0.17 (jax 0.7.2)" and compilers.role("newest") == "the newest compiler"
    assert envs.key(c.versions()) == "0.0.7.1-0.4.38"
    assert envs.pins(c.versions()) == ["jax==0.4.38", "jaxlib==0.4.38", "libtpu==0.0.7.1"]
    assert all(r.source for r in compilers.RUNTIMES.values())
    for bad in ("torch_xla 2.5", "libtpu 0.0.33", "gcc 13", 3):
        with pytest.raises(compilers.CompilerError) as err:
            compilers.resolve(bad)
        text = str(err.value)
        assert isinstance(err.value, ValueError) and isinstance(err.value, tpukit.TpukitError)
        assert "'torch_xla 2.6', 'torch_xla 2.7', 'torch_xla 2.8', 'torch_xla 2.9'" in text, text
        assert "'newest'" in text and "'installed'" in text and "None" in text, text


def test_the_newest_compiler_is_what_pip_installs_today(compilers_dir):
    """``"newest"``: the jax[tpu] the package index has now (asked once a day, the answer kept)."""
    newest = compilers.resolve("newest")
    assert newest.name == "newest" and newest.label.startswith("the newest compiler, libtpu ")
    pins = [compilers._release(r.libtpu) for r in compilers.RUNTIMES.values()]
    assert compilers._release(newest.libtpu) > max(pins), newest  # newer than every torch_xla's pin
    kept = json.loads((compilers_dir / "newest.json").read_text())
    assert kept["versions"] == newest.versions()
    start = time.perf_counter()
    assert envs.newest() == newest.versions() and time.perf_counter() - start < 1  # the kept answer


def test_the_default_compiler_is_the_installed_torch_xlas(rt):
    default = compilers.resolve(None)
    assert default.name == f"torch_xla {'.'.join(map(str, _xla.versions.installed()))}" == HERE.name
    # Both CI stacks install their torch_xla's pair: the worker runs here, in this Python, as before.
    assert default.versions() == tpu.versions() and envs.is_installed(default.versions())
    assert envs.python(default.versions(), default.name) == sys.executable and envs.built(default.versions())
    model = mlp()
    x = torch.randn(32, 256, device=_xla.device())
    est = tpukit.estimate(train_step(model, torch.optim.AdamW(model.parameters())), x, target="v5e-1")
    assert est.fits and est.compiler_name == HERE.name and est.compiler_note is None, est
    assert f"by {est.compiler}, {HERE.name}'s compiler" in str(est) and f"{HERE.name}&#x27;s compiler" in \
        est._repr_html_()
    with pytest.raises(ValueError, match="unknown TPU compiler 'torch_xla 2.5'"):  # before anything is traced
        tpukit.estimate(lambda x: x, torch.ones(2), target="v5e-1", compiler="torch_xla 2.5")
    # The cache key of the default is the one of the versions installed here (answers kept before stay valid).
    req = worker.Request(b"graph", tpu.target("v5e-1"))
    assert req.key() == worker.Request(b"graph", tpu.target("v5e-1"), compiler=default).key()
    assert req.key() != worker.Request(b"graph", tpu.target("v5e-1"), compiler=compilers.resolve(OTHER)).key()


def test_setup_owns_the_compiler(rt, monkeypatch):
    monkeypatch.setattr(runtime, "_STATE", runtime._STATE)  # this test's setup() calls end with it

    def asked(name):  # the compiler a call naming ``name`` gets: resolved once, at the edge
        return tpu.ask.resolve(None, name, need_target=False)[1]

    monkeypatch.delenv(runtime.COMPILER_ENV, raising=False)
    with pytest.raises(compilers.CompilerError, match="unknown TPU compiler 'torch_xla 2.5'"):
        tpukit.setup(device="cpu", compiler="torch_xla 2.5")
    assert runtime.tpu_compiler() is None and asked(None).name == HERE.name
    monkeypatch.setenv(runtime.COMPILER_ENV, "torch_xla 2.6")  # the variable, when setup() names none
    assert runtime.tpu_compiler() == "torch_xla 2.6" and asked(None).libtpu == "0.0.7.1"
    now = tpukit.setup(device="cpu", compiler="libtpu 0.0.21")
    assert now.compiler == "libtpu 0.0.21.1" and runtime.current().compiler == "libtpu 0.0.21.1"
    assert runtime.tpu_compiler() == "libtpu 0.0.21.1" == asked(None).name  # setup() wins
    assert ("TPU compiler", "libtpu 0.0.21.1: it answers the target's compiles and tpukit.estimate") in now.rows()
    assert runtime.tpu_compiler("torch_xla 2.8") == "torch_xla 2.8"  # named: itself


def test_an_estimate_by_another_compiler_runs_in_its_environment(rt, other):
    comp, exe, _ = other
    assert exe.startswith(str(envs.root())) and not envs.is_installed(comp.versions())
    model = mlp()
    step = train_step(model, torch.optim.AdamW(model.parameters()))
    x = torch.randn(48, 256, device=_xla.device())  # a graph no other test of this module compiles
    misses = tpu.cache_info()["misses"]
    here = tpukit.estimate(step, x, target="v5e-1")
    est = tpukit.estimate(step, x, target="v5e-1", compiler=OTHER)
    assert tpu.cache_info()["misses"] == misses + 2  # one graph, two compilers: two answers, never mixed
    assert est.fits and est.compiler_name == OTHER and est.compiler == compilers.describe(comp.versions()), est
    assert here.compiler_name == HERE.name and here.compiler != est.compiler
    text = str(est)
    assert f"by libtpu {comp.libtpu} (jax {comp.jax}), {OTHER}'s compiler" in text, text
    # Not the libtpu the installed torch_xla's runtime loads: the estimate says so, and how to ask that one.
    assert f"{HERE.name}'s runtime runs libtpu {HERE.libtpu}" in est.compiler_note, est.compiler_note
    # Its worker is a process of its own, running the libtpu of its environment.
    pid, mine = tpu.worker_pid(OTHER), tpu.worker_pid()
    assert pid is not None and mine is not None and pid != mine
    with open(f"/proc/{pid}/maps") as maps:
        loaded = [line.split()[-1] for line in maps if "libtpu" in line]
    assert loaded and all(path.startswith(str(Path(exe).parents[1])) for path in loaded), loaded
    # The same compiler by another of its names shares the answers; compile_graph and largest_batch take it too.
    proto = _xla.hlo.hlo_module_proto([torch.ones(64, 128, device=_xla.device()) * 2])
    graph = tpu.compile_graph(proto, "v5e-1", compiler=f"libtpu {comp.libtpu}")
    assert graph.fits and graph.compiler == est.compiler and graph.compiler_name == f"libtpu {comp.libtpu}"
    fit = tpukit.largest_batch(step, lambda b: torch.randn(b, 256, device=_xla.device()), "v5e-1", limit=64,
                               compiler=OTHER)
    assert fit.batch == 64 and fit.estimate.compiler_name == OTHER, fit
    assert tpu.check(OTHER)["libtpu"] == comp.libtpu  # its worker loads its libtpu and a topology
    # The follower (setup(target=...)) compiles with the compiler it was given; another one replaces it.
    mine = tpu.follow("v5e-1", OTHER)
    try:
        assert mine.compiler == comp and tpu.follow("v5e-1", OTHER) is mine and tpu.follower() is mine
        assert tpu.follow("v5e-1").compiler.name == HERE.name and tpu.follower() is not mine
        assert tpukit.compiles.reader().hlo.protos  # the graphs keep their HLO for the follower ...
    finally:
        tpu.unfollow()
    assert not tpukit.compiles.reader().hlo.protos  # ... and no longer once it is stopped, however it was


def test_an_environment_is_built_once_and_atomically(other, compilers_dir):
    comp, exe, seconds = other
    dest = compilers_dir / envs.key(comp.versions())
    stamp = json.loads((dest / envs.STAMP).read_text())
    assert stamp["versions"] == comp.versions() and stamp["for"] == OTHER, stamp
    assert not [p.name for p in compilers_dir.iterdir() if ".building-" in p.name or ".stale-" in p.name]
    assert envs.built(comp.versions())
    tool = envs.uv()  # the installer it used: uv where there is one (Kaggle's stack), else pip (Colab's)
    assert tool is None or Path(tool).name.startswith("uv")
    start = time.perf_counter()
    assert envs.python(comp.versions(), comp.name) == exe and time.perf_counter() - start < 2  # built: used
    # The kernel's own packages never moved.
    assert tpu.versions() == {"jax": HERE.jax, "jaxlib": HERE.jax, "libtpu": HERE.libtpu}


BUILD = r"""
import sys, types, logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
for name, path in (("tpukit", sys.argv[1]), ("tpukit.tpu", sys.argv[1] + "/tpu"),
                   ("tpukit.tpu.compiler", sys.argv[1] + "/tpu/compiler")):  # venvs alone: no torch
    m = types.ModuleType(name); m.__path__ = [path]; sys.modules[name] = m
from tpukit.tpu.compiler import venvs as envs
print("PYTHON", envs.python(dict(jax=sys.argv[2], jaxlib=sys.argv[2], libtpu=sys.argv[3]), "the test"))
"""


def test_concurrent_builders_share_one_build_and_a_half_built_one_is_never_used(other, tmp_path):
    comp = other[0]
    root = tmp_path / "compilers"
    half = root / envs.key(comp.versions())
    (half / "bin").mkdir(parents=True)  # a build that died half way, at the final path (no stamp)
    (half / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
    env = dict(os.environ, **{envs.ENV_VAR: str(root)})
    kit = str(Path(tpukit.__file__).parent)
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, kit, comp.jax, comp.libtpu], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    pythons = {line for out, _ in outs for line in out.splitlines() if line.startswith("PYTHON ")}
    assert pythons == {f"PYTHON {half / 'bin' / 'python'}"}, outs
    builds = sum(err.count("building the TPU compiler environment for the test") for _, err in outs)
    assert builds == 1, [o[1][-2000:] for o in outs]
    assert json.loads((half / envs.STAMP).read_text())["versions"] == comp.versions()
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == [half.name]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """An empty compilers folder, and no index and no cache for either installer: what a machine without the
    network sees. Yields the folder."""
    root = tmp_path / "compilers"
    monkeypatch.setenv(envs.ENV_VAR, str(root))
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("UV_OFFLINE", "1")
    monkeypatch.setenv("UV_NO_CACHE", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    return root


def test_a_first_build_says_what_it_fetches_how_big_and_where_before_it_starts(offline):
    # Issue 44.8: the ~300 MB download of a compiler's own environment was announced at logging's WARNING level
    # only. It is a TpukitWarning now, before anything is fetched (here the fetch then fails: offline).
    found = compilers.resolve("torch_xla 2.6").versions()
    with pytest.warns(TpukitWarning) as seen, pytest.raises(envs.CompilerEnvError):
        envs.python(found, "torch_xla 2.6")
    (notice,) = [str(w.message) for w in seen if "downloading it once" in str(w.message)]
    assert f"about {envs.DOWNLOAD_MB} MB" in notice and str(offline / envs.key(found)) in notice, notice
    assert "torch_xla 2.6 (libtpu 0.0.7.1, jax 0.4.38)" in notice and "TPUKIT_COMPILERS" in notice, notice


def test_an_offline_build_fails_with_the_command_to_run(offline):
    root = offline
    found = compilers.resolve("torch_xla 2.6").versions()
    with pytest.raises(envs.CompilerEnvError) as err, pytest.warns(TpukitWarning, match="downloading it once"):
        envs.python(found, "torch_xla 2.6")
    text = str(err.value)
    assert "could not install the TPU compiler of torch_xla 2.6 (libtpu 0.0.7.1, jax 0.4.38)" in text, text
    assert "offline?" in text and envs.by_hand(found) in text, text
    assert "-m venv --without-pip" in envs.by_hand(found) and "install jax==0.4.38 jaxlib==0.4.38 libtpu==0.0.7.1" \
        in envs.by_hand(found)
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []  # nothing half-built left


def test_compare_tables_each_target_by_each_compiler(rt, other):
    comp = other[0]
    model = mlp()
    step = train_step(model, torch.optim.AdamW(model.parameters()))
    cmp = tpukit.compare(step, torch.randn(64, 256, device=_xla.device()), targets=["v5e-1", "v5e-8"],
                         compilers=[None, OTHER])
    assert [(e.target, e.compiler_name) for e in cmp.estimates] == [
        ("v5e-1", HERE.name), ("v5e-1", OTHER), ("v5e-8", HERE.name), ("v5e-8", OTHER)]
    assert all(e.fits for e in cmp.estimates) and not cmp.disagree and cmp.of("v5e-8", OTHER).compiler == \
        compilers.describe(comp.versions())
    text, page = str(cmp), cmp._repr_html_()
    assert text.splitlines()[0] == "tpukit.compare: train_step.<locals>.step (traced once), per chip", text
    assert f"{OTHER}: libtpu {comp.libtpu} (jax {comp.jax})" in text and "yes" in text, text
    assert page.startswith("<table") and f"{OTHER}: libtpu {comp.libtpu}" in page
    assert [r[0] for r in cmp.rows()] == ["v5e-1", "v5e-1", "v5e-8", "v5e-8"]
    with pytest.raises(KeyError, match="no estimate for"):
        cmp.of("v6e-1", OTHER)


class Attention(torch.nn.Module):
    """A pre-norm self-attention block: d=128, 8 heads, torch's scaled_dot_product_attention."""

    def __init__(self, d=128, heads=8):
        super().__init__()
        self.heads, self.norm = heads, torch.nn.LayerNorm(d)
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.out(a.transpose(1, 2).reshape(b, n, d))


def test_compare_reports_a_step_one_compiler_refuses_and_another_accepts(rt, compilers_dir):
    """Three attention layers at 64 x 1600 tokens (fp32, AdamW, no checkpointing; 3.4 GB of attention
    probabilities per layer): libtpu 0.0.17 recomputes them in the backward pass and compiles the step in
    11.53 GB; libtpu 0.0.7.1 (torch_xla 2.6's) keeps them all and refuses it, "Used 20.58G of 15.75G hbm"
    (measured here; the 16-layer version of this step in FACTS.md compiles for minutes). torch_xla 2.6's
    compiler runs in its own environment, with jax 0.4.38 and its version gates."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Attention() for _ in range(3)]).to(_xla.device())
    step = train_step(model, torch.optim.AdamW(model.parameters()))
    x = torch.randn(64, 1600, 128, device=_xla.device())
    cmp = tpukit.compare(step, x, pairs=[("v5e-1", None), ("v5e-1", "torch_xla 2.6")])
    here, old = cmp.of("v5e-1", HERE.name), cmp.of("v5e-1", "torch_xla 2.6")
    assert here.fits and here.hbm_bytes < here.hbm_limit_bytes, here
    assert not old.fits and old.status == "too big" and old.compiler == "libtpu 0.0.7.1 (jax 0.4.38)", old
    assert old.refusal is not None and old.hbm_bytes > old.hbm_limit_bytes, old
    assert cmp.disagree
    text = str(cmp)
    assert "NO (too big)" in text and "the compilers disagree on v5e-1" in text and "Used 20.5" in text, text
    print(f"\n{text}\ncompile: {HERE.name} {here.compile_s:.0f} s, torch_xla 2.6 {old.compile_s:.0f} s")


def test_installed_versions_are_read_again_after_an_install(tmp_path, monkeypatch):
    """versions() answers from memory while the import path is unchanged, and reads the packages again once a
    folder of it changed (an install writes a *.dist-info there): a jax installed mid-session is seen."""
    from tpukit.tpu.compiler import installed as _versions

    before = _versions.versions()
    assert before == tpu.versions() and before["libtpu"], before
    monkeypatch.syspath_prepend(str(tmp_path))  # an empty folder first on the path: nothing new in it
    assert _versions.versions() == before
    info = tmp_path / "libtpu-9.9.9.dist-info"  # what pip writes for an install into that folder
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: libtpu\nVersion: 9.9.9\n")
    assert _versions.versions() == dict(before, libtpu="9.9.9")
    (info / "METADATA").unlink()
    info.rmdir()  # uninstalled
    assert _versions.versions() == before
