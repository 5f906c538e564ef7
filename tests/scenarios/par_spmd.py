"""SPMD checks for tests/test_parallel.py, run in a fresh process with 4 virtual XLA:CPU devices.

Run with PJRT_DEVICE=CPU CPU_NUM_DEVICES=4. Prints one JSON object (the last
line of stdout) with everything the tests assert on; the assertions live in
test_parallel.py so a failure names what broke.
"""

import io
import warnings
import json
import sys
import time
import traceback

import tpukit
from tpukit import _xla, spmd

T0 = time.time()
rt = tpukit.setup(device="cpu", cpu_devices=4, spmd=True)

import torch  # noqa: E402

out: dict = {"runtime": {"device_count": rt.device_count, "spmd": rt.spmd, "problems": list(rt.problems)}}
STEPS, BATCH, DIM, HIDDEN, CLASSES = 10, 32, 16, 32, 4


def section(name):
    def wrap(fn):
        try:
            out[name] = fn()
        except Exception as exc:  # recorded so one broken part does not hide the others
            out[name] = {"crashed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        return fn
    return wrap


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


gen = torch.Generator().manual_seed(1)
X = torch.randn(STEPS, BATCH, DIM, generator=gen)
Y = (X @ torch.randn(DIM, CLASSES, generator=gen)).argmax(-1)  # learnable labels: the loss must fall


def eager_reference():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for i in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(X[i]), Y[i])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


REF_LOSSES, REF_STATE = eager_reference()
MESH = spmd.mesh()


def max_diff(state):
    return max(float((state[k].float() - REF_STATE[k]).abs().max()) for k in REF_STATE)


@section("equivalence")
def _():
    model = make_model().to(_xla.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, specs = [], {}
    for i in range(STEPS):
        batch = spmd.shard_batch({"x": X[i], "y": Y[i]}, MESH)
        if i == 0:
            specs = {k: spmd.sharding_spec(v) for k, v in batch.items()}
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        _xla.sync()
        losses.append(loss.item())
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    return {"losses": losses, "ref_losses": REF_LOSSES, "batch_specs": specs, "max_weight_diff": max_diff(state)}


@section("shard_batch")
def _():
    nested = {"x": X[0], "pair": (X[0][:, :4], Y[0]), "list": [Y[0]], "scalar": torch.tensor(2.5), "name": "ids"}
    b = spmd.shard_batch(nested, MESH)
    on_dev = torch.randn(8, 3).to(_xla.device())
    same = spmd.shard_batch(on_dev, MESH)
    plain = torch.randn(8, 3).to(_xla.device())
    m2 = spmd.mesh(("data", "model"), (2, 2))
    two_d = spmd.shard_batch(X[0], m2)
    return {
        "x": spmd.sharding_spec(b["x"]),
        "pair0": spmd.sharding_spec(b["pair"][0]),
        "pair_is_tuple": isinstance(b["pair"], tuple),
        "y": spmd.sharding_spec(b["pair"][1]),
        "list_y": spmd.sharding_spec(b["list"][0]),
        "scalar_device": str(b["scalar"].device),
        "scalar_value": b["scalar"].item(),
        "name": b["name"],
        "x_roundtrip_equal": bool(torch.equal(b["x"].cpu(), X[0])),
        "in_place_same_object": same is on_dev,
        "in_place_spec": spmd.sharding_spec(on_dev),
        "unsharded_spec": spmd.sharding_spec(plain),
        "type_is_plain_tensor": type(b["x"]) is torch.Tensor,
        "two_d_mesh_spec": spmd.sharding_spec(two_d),
    }


@section("indivisible")
def _():
    try:
        spmd.shard_batch({"x": torch.randn(30, DIM)}, MESH)
    except Exception as exc:
        return {"type": type(exc).__name__, "is_tpukit": isinstance(exc, tpukit.TpukitError),
                "is_value_error": isinstance(exc, ValueError), "message": str(exc)}
    return {"type": None}


@section("mesh")
def _():
    res = {"default": _xla.mesh_axes(MESH), "two_axes": _xla.mesh_axes(spmd.mesh(("data", "model"), (2, 2))),
           "inferred": _xla.mesh_axes(spmd.mesh(("data", "model"), (-1, 2)))}
    for key, kwargs in {"bad_shape": {"shape": (3,)}, "bad_len": {"axes": ("data",), "shape": (2, 2)},
                        "dup_axes": {"axes": ("data", "data")}}.items():
        try:
            spmd.mesh(**kwargs)
            res[key] = None
        except ValueError as exc:
            res[key] = str(exc)
    try:
        spmd.shard_batch(X[0], MESH, axis="model")
        res["missing_axis"] = None
    except ValueError as exc:
        res["missing_axis"] = str(exc)
    return res


@section("device_loader")
def _():
    ds = torch.utils.data.TensorDataset(X.reshape(-1, DIM), Y.reshape(-1))
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False)
    specs, equal, n = set(), True, 0
    for i, (xb, yb) in enumerate(spmd.device_loader(loader, MESH)):
        specs.add((spmd.sharding_spec(xb), spmd.sharding_spec(yb)))
        equal = equal and torch.equal(xb.cpu(), X[i]) and torch.equal(yb.cpu(), Y[i])
        n += 1

    dict_loader = [{"input_ids": X[i], "labels": Y[i]} for i in range(2)]
    dict_specs = [{k: spmd.sharding_spec(v) for k, v in b.items()} for b in spmd.device_loader(dict_loader, MESH)]

    plain = [spmd.sharding_spec(xb) for xb, _ in spmd.device_loader(loader)][:1]

    ragged = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(330, DIM)), batch_size=BATCH, drop_last=False)
    good, err = 0, None
    try:
        for (xb,) in spmd.device_loader(ragged, MESH):
            good += 1
    except Exception as exc:
        err = {"type": type(exc).__name__, "message": str(exc)}
    dropped = sum(1 for _ in spmd.device_loader(
        torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(330, DIM)), batch_size=BATCH,
                                    drop_last=True), MESH))
    return {"specs": sorted(specs), "values_equal": bool(equal), "batches": n, "dict_specs": dict_specs,
            "no_mesh_specs": plain, "no_mesh_device": str(next(iter(spmd.device_loader(loader)))[0].device),
            "ragged_good_batches": good, "ragged_error": err, "drop_last_batches": dropped}


@section("fsdp")
def _():
    model = make_model()
    wrapped = spmd.fsdp(model, MESH)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    param_specs = {n: spmd.sharding_spec(p) for n, p in model.named_parameters()}
    losses = []
    with warnings.catch_warnings(record=True) as caught:  # what a training loop shows (fsdp() silences torch's hook notice)
        for i in range(STEPS):
            batch = spmd.shard_batch((X[i], Y[i]), MESH)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(wrapped(batch[0]), batch[1])
            loss.backward()
            opt.step()
            _xla.sync()
            losses.append(loss.item())
    after_specs = {n: spmd.sharding_spec(p) for n, p in model.named_parameters()}
    # What a checkpoint does: gather to CPU, save, load into a fresh CPU model.
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    fresh = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))
    fresh.load_state_dict(torch.load(buf))
    with torch.no_grad():
        restored_logits = fresh(X[0])
        live_logits = wrapped(X[0].to(_xla.device())).cpu()
    return {
        "warnings": [str(w.message) for w in caught],
        "losses": losses, "param_specs": param_specs, "after_specs": after_specs,
        "shapes": {k: list(v.shape) for k, v in state.items()},
        "ref_shapes": {k: list(v.shape) for k, v in REF_STATE.items()},
        "max_weight_diff": max_diff(state),
        "restored_matches_live": float((restored_logits - live_logits).abs().max()),
        "wrapper_keys": sorted(wrapped.state_dict())[:2],
    }


@section("launch_refused_under_spmd")
def _():
    try:
        tpukit.launch(lambda i: i, debug_single_process=True)
    except tpukit.LaunchError as exc:
        return str(exc)
    return None


out["seconds"] = round(time.time() - T0, 1)
sys.stdout.flush()
print(json.dumps(out))
