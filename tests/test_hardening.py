"""Misuses of the public API (issue 27) that gave a silently wrong result or a raw error.

Each case asserts the right result, or a clear error / warning that says what to do.
Everything runs on the real torch_xla runtime on XLA:CPU; cases that need a fresh
runtime (SPMD, virtual devices, a runtime started before setup()) run in a subprocess.
"""

import json
import math
import os
import random
import shutil
import tempfile
import time

import numpy as np
import pytest
import torch

import tpukit
from tpukit import buckets, data
from conftest import run_python

# ------------------------------------------------------------------ BucketBatcher


def test_bucket_batcher_refuses_sequences_longer_than_its_largest_bucket():
    seqs = [[1] * n for n in (3, 9, 40, 12, 70, 5)]
    with pytest.raises(data.DataError) as err:
        data.BucketBatcher(seqs, batch_size=2, buckets=[8, 16])
    msg = str(err.value)
    assert "2 of 6 sequences are longer than the largest bucket, 16" in msg and "70 tokens" in msg
    assert "truncate=True" in msg and "bucket of at least 70" in msg


def test_bucket_batcher_truncate_counts_what_it_cut():
    seqs = [[1] * n for n in (3, 9, 40, 12, 70, 5, 30)]
    batcher = data.BucketBatcher(seqs, batch_size=2, buckets=[8, 16], truncate=True)
    batches = list(batcher)
    fed = sorted(int(m.sum()) for b in batches for m in b["attention_mask"])
    # bucket 8: [3, 5]; bucket 16: [9, 40], [12, 70] and a partial [30], dropped (drop_last)
    assert fed == [3, 5, 9, 12, 16, 16]
    assert (batcher.truncated, batcher.dropped) == (2, 1)  # 40 and 70 were cut and fed; 30 was dropped
    assert len(fed) + batcher.dropped == len(seqs)


# ------------------------------------------------------------------ bert_mask

MIN = torch.finfo(torch.float32).min


def test_bert_mask_refuses_a_3d_mask():
    with pytest.raises(data.DataError, match=r"2-D attention_mask \(batch, length\).*shape \(2, 1, 4\)"):
        data.bert_mask(torch.ones(2, 1, 4, dtype=torch.long))


def test_bert_mask_refuses_input_ids_and_a_2_on_cpu():
    ids, mask = data.pad_to([[101, 7592, 102], [101, 102]], 4)
    with pytest.raises(data.DataError, match="holds 101: is it input_ids.*attention_mask"):
        data.bert_mask(ids)
    with pytest.raises(data.DataError, match="0 \\(padding\\) and 1 \\(a token\\), but it holds 2"):
        data.bert_mask(torch.tensor([[1, 2, 0]]))


def test_bert_mask_refuses_1d_list_and_non_float_result_dtype():
    with pytest.raises(data.DataError, match=r"shape \(3,\).*mask\[None\]"):
        data.bert_mask(torch.tensor([1, 1, 0]))
    with pytest.raises(TypeError, match="not a list.*torch.tensor\\(mask\\)"):
        data.bert_mask([[1, 1, 0]])
    with pytest.raises(TypeError, match="floating dtype"):
        data.bert_mask(torch.tensor([[1, 0]]), torch.int64)


def test_bert_mask_takes_int_bool_and_float_masks_alike():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    want = torch.tensor([[0.0, 0.0, MIN], [0.0, MIN, MIN]]).view(2, 1, 1, 3)
    for m in (mask, mask.int(), mask.bool(), mask.float(), mask.to(torch.uint8)):
        assert torch.equal(data.bert_mask(m), want), m.dtype


def test_bert_mask_on_the_device_never_boosts_and_never_reads(rt):
    """On an XLA tensor the values are not checked (that would read the device mid-step); a 2 or
    input_ids then mask only the zeros instead of giving +inf / +3.4e38 biases."""
    import torch_xla

    device = torch_xla.device()
    bad = torch.tensor([[1, 2, 0], [101, 0, 0]], device=device)
    torch_xla.sync()
    before = tpukit.snapshot()
    m4 = data.bert_mask(bad)
    reads = (tpukit.snapshot() - before).item_reads
    assert reads == 0
    out = m4.cpu()
    assert torch.equal(out, torch.tensor([[0.0, 0.0, MIN], [0.0, MIN, MIN]]).view(2, 1, 1, 3))
    assert out.max() <= 0


# ------------------------------------------------------------------ suggest_buckets


def test_suggest_buckets_refuses_float_lengths():
    for lengths in ([12, 3.5, 20], [12.0, 20.0], np.array([12.0, 20.0]), ["12", "20"]):
        with pytest.raises(data.DataError, match="whole numbers.*floats are refused"):
            data.suggest_buckets(lengths, 8)
    # int-like values of other types are fine
    assert data.suggest_buckets(np.array([12, 20, 33]), 8).buckets == data.suggest_buckets([12, 20, 33], 8).buckets


def _old_suggest(lengths, batch_size, *, max_buckets=8, multiple=8, max_length=None, compile_s=None,
                 step_time=None, epochs=1):
    """The advisor before issue 27, kept as the reference: plain loops over every example and every
    (a, j) pair of candidates. The new one must give exactly the same BucketAdvice."""
    ls = [int(n) for n in lengths]
    compile_time = buckets.DEFAULT_COMPILE_S if compile_s is None else float(compile_s)
    step = buckets._step_model(batch_size, None, None, step_time)

    def round_up(n):
        r = max(multiple, math.ceil(n / multiple) * multiple)
        return min(r, max_length) if max_length is not None else r

    per = {}
    for n in ls:
        per[round_up(n)] = per.get(round_up(n), 0) + 1
    cands = sorted(per)
    before = [0]
    for c in cands:
        before.append(before[-1] + per[c])
    times = [float(step(c)) for c in cands]
    d, top_k = len(cands), min(max_buckets + 1, len(cands))

    def cost(a, j):
        return epochs * math.ceil((before[j + 1] - before[a]) / batch_size) * times[j]

    inf = float("inf")
    best, back = [[cost(0, j) for j in range(d)]], [[0] * d]
    for k in range(2, top_k + 1):
        prev, row, arg = best[-1], [inf] * d, [0] * d
        for j in range(k - 1, d):
            for a in range(k - 1, j + 1):
                v = prev[a - 1] + cost(a, j)
                if v < row[j]:
                    row[j], arg[j] = v, a
        best.append(row)
        back.append(arg)
    totals = [best[k - 1][d - 1] + k * compile_time for k in range(1, min(max_buckets, d) + 1)]
    k = min(range(len(totals)), key=lambda i: (totals[i], i)) + 1
    chosen, j = [], d - 1
    for kk in range(k, 0, -1):
        chosen.append(cands[j])
        j = back[kk - 1][j] - 1
    more = best[k - 1][d - 1] - best[k][d - 1] if k < top_k else None
    # the old cost model, example by example
    bs = sorted(chosen)
    counts, fill = {b: 0 for b in bs}, {b: 0 for b in bs}
    for n in ls:
        b = next((b for b in bs if n <= b), bs[-1])
        counts[b] += 1
        fill[b] += min(n, b)
    n_ex = tuple(counts[b] for b in bs)
    n_steps = tuple(math.ceil(n / batch_size) for n in n_ex)
    st = tuple(float(step(b)) for b in bs)
    slots = [s * batch_size * b for s, b in zip(n_steps, bs)]
    step_s = epochs * sum(s * t for s, t in zip(n_steps, st))
    padding_s = epochs * sum(s * t * (1 - fill[b] / n) for s, t, b, n in zip(n_steps, st, bs, slots) if n)
    return data.BucketAdvice(tuple(bs), batch_size, epochs, n_ex, n_steps, st, compile_time, sum(fill.values()),
                             sum(slots), step_s, padding_s, compile_time * sum(1 for s in n_steps if s),
                             max_buckets=max_buckets, more_saves_s=more)


def test_suggest_buckets_gives_exactly_what_the_old_search_gave():
    rnd = random.Random(27)
    for trial in range(150):
        n = rnd.choice((1, 3, 20, 200, 1500))
        top = rnd.choice((5, 40, 300))
        lengths = [rnd.randint(0, top) if rnd.random() < 0.3 else int(min(top, rnd.lognormvariate(2.5, 0.8)))
                   for _ in range(n)]
        kw = dict(max_buckets=rnd.choice((1, 2, 3, 5, 8, 64)), multiple=rnd.choice((1, 2, 8)),
                  compile_s=rnd.choice((None, 0.0, 0.5, 15.0, 1e4)), epochs=rnd.choice((1, 3)))
        if rnd.random() < 0.3:
            kw["max_length"] = max(lengths + [1]) + rnd.choice((0, 5))
        kind = rnd.random()
        if kind < 0.2:  # measured points: interpolated
            kw["step_time"] = {8: 0.3, 64: 1.1, 128: 1.9}
        elif kind < 0.35:  # a step time that is not monotone (the search is still exact over its candidates)
            kw["step_time"] = lambda length: 0.2 + (length % 7) * 0.05
        bs = rnd.choice((1, 4, 16))
        assert data.suggest_buckets(lengths, bs, **kw) == _old_suggest(lengths, bs, **kw), (trial, kw)


def test_suggest_buckets_on_a_million_lengths_is_fast():
    rnd = random.Random(0)
    lengths = [max(1, min(2048, int(rnd.lognormvariate(5.0, 0.9)))) for _ in range(1_000_000)]
    assert len(set(lengths)) > 2000  # 2000+ candidate lengths with multiple=1: the old search took minutes
    t = time.perf_counter()
    advice = data.suggest_buckets(lengths, 16, multiple=1, max_buckets=64)
    took = time.perf_counter() - t
    assert len(advice.buckets) == 64 and advice.buckets[-1] == max(lengths)
    assert sum(advice.examples_per_bucket) == len(lengths) and advice.tokens == sum(lengths)
    assert took < 30, f"suggest_buckets took {took:.1f} s on 1,000,000 lengths"


# ------------------------------------------------------------------ shard_batch / fsdp


def test_shard_batch_converts_numpy_arrays():
    code = (
        "import numpy as np, torch, tpukit\n"
        "tpukit.setup(device='cpu', cpu_devices=4, spmd=True)\n"
        "m = tpukit.mesh()\n"
        "b = tpukit.shard_batch({'x': np.arange(24, dtype=np.float32).reshape(8, 3), 'y': np.arange(8),\n"
        "                        'text': np.array(['a'] * 8)}, m)\n"
        "print(type(b['x']).__name__, b['x'].device.type, b['x'].dtype, tpukit.sharding_spec(b['x']))\n"
        "print(b['y'].dtype, tpukit.sharding_spec(b['y']), b['y'].cpu().tolist())\n"
        "print(type(b['text']).__name__, float(b['x'].cpu().sum()))\n"
        "try:\n"
        "    tpukit.shard_batch({'x': np.zeros((6, 2))}, m)\n"
        "except tpukit.ShardingError as e:\n"
        "    print('refused:', e)\n"
    )
    out = run_python(code, env={"PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stderr[-3000:]
    x, y, rest, refused = out.stdout.strip().splitlines()[-4:]
    assert x.startswith("Tensor xla torch.float32 {devices=[4,1]"), x
    assert y.startswith("torch.int64 {devices=[4]") and y.endswith("[0, 1, 2, 3, 4, 5, 6, 7]"), y
    assert rest == "ndarray 276.0"  # an array of strings passes through, like any other non-tensor leaf
    assert "batch of 6" in refused and "multiple of 4" in refused


def test_fsdp_of_a_name_is_a_clear_type_error():
    with pytest.raises(TypeError, match=r"torch.nn.Module \(the model itself\), not a str.*tpukit.fsdp\(model, mesh\)"):
        tpukit.fsdp("model", object())


# ------------------------------------------------------------------ profile logdir


def test_profile_logdir_that_cannot_be_created_is_a_clear_error():
    # /sys refuses new directories even to root: a real uncreatable place on any Linux machine
    with pytest.raises(tpukit.TpukitError) as err:
        with tpukit.profile(logdir="/sys/tpukit-no-such/run"):
            pass
    msg = str(err.value)
    assert "/sys/tpukit-no-such/run" in msg and "cannot be created" in msg
    assert "directory you can write to" in msg and "leave logdir out" in msg


def test_profile_logdir_that_is_read_only_is_a_clear_error():
    base = tempfile.mkdtemp(prefix="tpukit-test-ro-")  # under /tmp, so another user can reach it
    os.chmod(base, 0o755)
    ro = os.path.join(base, "read-only")
    os.mkdir(ro, 0o555)
    os.chmod(ro, 0o555)
    # root may write anywhere, so the child then becomes an ordinary user (nobody) once tpukit is imported
    become = "import os\nos.setgid(65534)\nos.setuid(65534)\n" if os.geteuid() == 0 else ""
    try:
        out = run_python("import tpukit\n" + become +
                         "try:\n"
                         f"    tpukit.profile(logdir={os.path.join(ro, 'run')!r})\n"
                         "except tpukit.TpukitError as e:\n"
                         "    print(e)\n", env={"PJRT_DEVICE": "CPU"})
    finally:
        os.chmod(ro, 0o755)
        shutil.rmtree(base)
    assert out.returncode == 0, out.stderr[-3000:]
    msg = out.stdout.strip()
    assert f"{ro}, where it would be created, is not writable" in msg, msg
    assert "directory you can write to" in msg


# ------------------------------------------------------------------ setup()

_WARNINGS = ("import json, warnings\n"
             "def calls(*kwargs_list):\n"
             "    import tpukit\n"
             "    out = []\n"
             "    for kw in kwargs_list:\n"
             "        with warnings.catch_warnings(record=True) as got:\n"
             "            warnings.simplefilter('always')\n"
             "            rt = tpukit.setup(**kw)\n"
             "        out.append({'problems': list(rt.problems),\n"
             "                    'warnings': [str(w.message) for w in got if w.category is tpukit.TpukitWarning],\n"
             "                    'lines': [w.lineno for w in got if w.category is tpukit.TpukitWarning]})\n"
             "    print(json.dumps(out))\n")


def _calls(code: str) -> list[dict]:
    out = run_python(_WARNINGS + code, env={"PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_setup_after_load_names_tpukit_load_not_the_user(tmp_path):
    ckpt = tmp_path / "c.pt"
    out = run_python("import torch, tpukit\n"
                     "tpukit.setup(device='cpu')\n"
                     "x = torch.ones(2, device=tpukit._xla.device()) + 1\n"
                     f"tpukit.save({{'w': x}}, {str(ckpt)!r}, rng=True)\n", env={"PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stderr[-3000:]
    [call] = _calls(f"import tpukit\ntpukit.load({str(ckpt)!r}, rng=True)\ncalls(dict(spmd=True))\n")
    text = "\n".join(call["warnings"])
    assert call["warnings"] == call["problems"] and len(call["problems"]) == 2
    assert "torch_xla was loaded by tpukit.load() before tpukit.setup() could configure compile tracing" in text
    assert "spmd=True could not be applied" in text and "(torch_xla was loaded by tpukit.load(), before" in text
    assert "before importing torch_xla" not in text  # the old message blamed the user
    assert text.count("Restart the kernel and call tpukit.setup") == 2


def test_second_setup_with_other_settings_warns_once_per_problem():
    first, spmd, again, trace_off, cache, default = _calls(
        "calls(dict(device='cpu'), dict(spmd=True), dict(spmd=True), dict(trace_compiles=False),\n"
        "      dict(compile_cache='/tmp/tpukit-test-cache'), dict())\n")
    assert first == {"problems": [], "warnings": [], "lines": []}
    [w] = spmd["warnings"]
    assert w.startswith("spmd=True was requested but the runtime already started without SPMD (as the first "
                        "tpukit.setup() call started it). Restart the kernel")
    assert spmd["problems"] == [w] and spmd["lines"] == [8]  # the warning points at the setup() call
    assert again["problems"] == [w] and again["warnings"] == []  # the same problem is warned once
    [w] = trace_off["warnings"]
    assert "trace_compiles=False was requested but compile tracing is already on" in w and "stays on" in w
    [w] = cache["warnings"]
    assert "compile_cache='/tmp/tpukit-test-cache' was requested but the persistent compile cache is off on XLA:CPU" in w
    assert default == {"problems": [], "warnings": [], "lines": []}


def test_setup_after_torch_xla_was_used_warns_each_problem():
    [call] = _calls("import torch, torch_xla\n"
                    "x = torch.ones(2, device=torch_xla.device()) + 1\n"
                    "calls(dict(device='cpu', cpu_devices=4, spmd=True))\n")
    assert len(call["problems"]) == 3 and call["warnings"] == call["problems"]
    text = "\n".join(call["warnings"])
    for what in ("Compile causes are unavailable", "spmd=True could not be applied", "cpu_devices=4 was requested"):
        assert what in text
    assert "by code outside tpukit" in text and text.count("Restart the kernel") == 3


# ------------------------------------------------------------------ track()

@pytest.mark.parametrize("shapes", ["nonsense", 3.5, {"input_ids": 16}, [None], [-1, 0], [(2, "a")], [True]])
def test_track_refuses_shapes_it_cannot_declare(shapes):
    with pytest.raises((TypeError, ValueError)) as err:
        tpukit.track([torch.ones(2)], shapes=shapes, progress=False)
    assert "track(shapes=...) takes a list of sequence lengths" in str(err.value)


def test_track_takes_lengths_and_shapes():
    tracker = tpukit.track([torch.ones(2)], shapes=[16, (8, 32), [4, 4]], progress=False)
    assert tracker.declared == frozenset({16, (8, 32), (4, 4)})


@pytest.mark.parametrize("guard, says", [(tpukit.no_recompile_after, "must be called"), ("strict", "not a step guard")])
def test_track_refuses_a_guard_before_any_step_runs(guard, says):
    ran = []
    with pytest.raises(TypeError) as err:
        for x in tpukit.track([1, 2], guard=guard, progress=False):
            ran.append(x)
    assert says in str(err.value) and "no_recompile_after(" in str(err.value) and ran == []


def test_a_loop_left_by_break_closes_like_one_that_ran_out(rt):
    """Leaving after 3 of 8 steps: 3 records, the last one synced with its logged value, the loop
    finished (its report shown, on_track_end called)."""
    ended = []

    class Ends:
        def on_track_end(self, tracker):
            ended.append(tracker)

    listener = Ends()
    tpukit.add_listener(listener)
    try:
        w = torch.zeros(4, device=rt.device)
        tracker = tpukit.track([torch.full((4,), float(i)) for i in range(8)], progress=False)
        for step, x in enumerate(tracker, 1):
            w = w + x
            tpukit.log(total=w.sum())
            if step == 3:
                break
    finally:
        tpukit.remove_listener(listener)
    assert [r.step for r in tracker.history] == [1, 2, 3]
    assert [r.scalars.get("total") for r in tracker.history] == [0.0, 4.0, 12.0]
    assert tracker.finished is not None and ended == [tracker]
    assert tracker.summary()["steps"] == 3


CHILD_STEP = ("import torch, torch_xla\n"
              "t = torch.ones(3, device=torch_xla.device()) * 2\n"
              "torch_xla.sync()\n"
              "print(float(t.sum()))\n")


def _child(env: dict):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", CHILD_STEP], env=env, capture_output=True, text=True, timeout=300)


def test_a_child_that_never_calls_setup_does_not_write_into_the_kernels_trace(rt, tmp_path):
    """`!python train.py` from a traced kernel inherits its environment, PT_XLA_DEBUG_FILE included:
    tpukit's sitecustomize (first on the children's PYTHONPATH) drops it before the child's torch_xla reads it."""
    from tpukit.compiles import config

    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == config.CHILD_PATH
    trace = rt.trace_file
    before = os.path.getsize(trace)
    out = _child(dict(os.environ))  # exactly what a shell command from this process inherits
    assert out.returncode == 0 and out.stdout.split()[-1] == "6.0", out.stderr[-2000:]
    assert os.path.getsize(trace) == before
    assert "Compilation Analysis" not in out.stdout  # nor does the trace go to the child's output

    # The control, on a stand-in parent trace (not this process's): without the folder on PYTHONPATH the
    # same child appends its compile analysis to it, so the check above can fail.
    parent = tmp_path / "tpukit-0" / "compiles-1.log"
    parent.parent.mkdir()
    parent.write_text("")
    env = dict(os.environ, PT_XLA_DEBUG_FILE=str(parent), PT_XLA_DEBUG_LEVEL="1")
    assert _child(env).returncode == 0 and parent.stat().st_size == 0
    env["PYTHONPATH"] = os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep) if p != config.CHILD_PATH)
    assert _child(env).returncode == 0 and "Compilation Analysis" in parent.read_text()


def test_the_childrens_sitecustomize_knows_tpukits_trace_names_and_runs_the_one_it_shadows(tmp_path):
    """The stand-alone sitecustomize (it never imports tpukit) uses config's pattern, keeps a trace that is
    the child's own or the user's, and still runs the sitecustomize it shadows."""
    import importlib.util

    from tpukit.compiles import config

    spec = importlib.util.spec_from_file_location("child_site", os.path.join(config.CHILD_PATH, "sitecustomize.py"))
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)
    assert site.TRACE_NAME == config.TRACE_NAME
    own = {"PT_XLA_DEBUG_FILE": "/tmp/tpukit-0/compiles-42.log", "PT_XLA_DEBUG_LEVEL": "1"}
    assert not site.drop_inherited_trace(own, pid=42) and len(own) == 2
    users = {"PT_XLA_DEBUG_FILE": "/home/me/xla-debug.log", "PT_XLA_DEBUG_LEVEL": "1"}
    assert not site.drop_inherited_trace(users, pid=42) and len(users) == 2
    parents = {"PT_XLA_DEBUG_FILE": "/tmp/tpukit-0/compiles-41.log", "PT_XLA_DEBUG_LEVEL": "1", "OTHER": "x"}
    assert site.drop_inherited_trace(parents, pid=42) and parents == {"OTHER": "x"}

    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_RAN'] = 'yes'\n")
    out = run_python("import os; print(os.environ.get('SHADOWED_RAN'))",
                     env={"PYTHONPATH": os.pathsep.join([config.CHILD_PATH, str(tmp_path)])})
    assert out.returncode == 0 and out.stdout.split()[-1] == "yes", out.stderr
