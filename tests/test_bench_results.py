"""bench/results/estimate_time.json: the time of a TPU estimate against the compiler's own compile time.

No compiles here: the file is what bench/estimate_time.py wrote. Each step has its warm measurement (the
worker already running), some also a cold one (the estimate first in a fresh process); every ratio must follow
from the timings beside it, the breakdown must add up to the estimate's wall time, and the verdict on the
issue's requirement (warm estimate <= 1.1 x the compiler's compile time) must follow from the ratios.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "estimate_time.json"
TOP = ("what", "target", "requirement", "requirement_ratio", "requirement_met", "warm_ratio_max", "worker_start_s",
       "steps", "breakdown_parts", "compiler", "stack", "machine")
CASE = ("estimate_wall_s", "compile_s", "ratio_compile_s", "direct_compile_s", "ratio_direct", "breakdown",
        "worker_started_in_estimate", "hlo_bytes", "hlo_sha256", "compiler", "same_program")
PARTS = ("before_trace_s", "trace_s", "key_and_lookup_s", "worker_compile_s", "worker_round_trip_s", "after_call_s")


@pytest.fixture(scope="module")
def data():
    with open(RESULTS) as f:
        return json.load(f)


def _cases(data):
    for name, step in data["steps"].items():
        for case in ("warm", "cold"):
            if step.get(case) is not None:
                yield name, case, step[case]


def test_the_file_has_its_fields_and_names_its_stack(data):
    missing = [k for k in TOP if k not in data]
    assert not missing, missing
    assert set(data["breakdown_parts"]) == set(PARTS)
    for k in ("python", "torch", "torch_xla", "transformers", "jax", "jaxlib", "libtpu"):
        assert data["stack"].get(k), k
    assert data["compiler"].get("libtpu") == data["stack"]["libtpu"]
    assert data["machine"]["cpus"] >= 1
    # an MLP and at least two BERT steps, each measured warm; at least one also cold
    assert "mlp" in data["steps"] and sum("BERT" in s["step"] for s in data["steps"].values()) >= 2
    assert all(s["warm"] is not None for s in data["steps"].values())
    assert any(s.get("cold") is not None for s in data["steps"].values())
    for name, case, r in _cases(data):
        missing = [k for k in CASE if k not in r]
        assert not missing, (name, case, missing)
        assert set(r["breakdown"]) == set(PARTS), (name, case)
        assert r["compiler"].startswith(f"libtpu {data['stack']['libtpu']}"), r["compiler"]


def test_each_ratio_follows_from_its_timings(data):
    for name, case, r in _cases(data):
        assert r["estimate_wall_s"] > r["compile_s"] > 0, (name, case)  # the compile is inside the estimate
        assert math.isclose(r["ratio_compile_s"], r["estimate_wall_s"] / r["compile_s"], rel_tol=1e-9), (name, case)
        assert math.isclose(r["ratio_direct"], r["estimate_wall_s"] / (r["direct_compile_s"] if case == "warm" else
                                                                       r["direct_process_s"]), rel_tol=1e-9)
        assert math.isclose(r["direct_compile_s"], r["direct"]["total_s"], rel_tol=1e-9), (name, case)
        if case == "cold":
            assert math.isclose(r["direct_process_s"], r["direct_start_s"] + r["direct_compile_s"], rel_tol=1e-9)


def test_the_breakdown_adds_up_to_the_estimate(data):
    for name, case, r in _cases(data):
        b = r["breakdown"]
        assert math.isclose(sum(b.values()), r["estimate_wall_s"], rel_tol=1e-6), (name, case)
        assert b["worker_compile_s"] == r["compile_s"]
        assert all(v >= 0 for v in b.values()), (name, case, b)
        # the worker starts inside a cold estimate only
        assert r["worker_started_in_estimate"] == (case == "cold"), (name, case)


def test_the_plain_jax_compile_is_of_the_same_program(data):
    for name, case, r in _cases(data):
        assert r["same_program"] and r["direct"]["temp_bytes"] == r["temp_bytes"], (name, case)
    for name, step in data["steps"].items():
        if step.get("cold") is not None:
            assert step["same_hlo_cold_and_warm"], name  # the same step traced in two processes: the same bytes


def test_the_verdict_follows_from_the_warm_ratios(data):
    ratios = [s["warm"]["ratio_compile_s"] for s in data["steps"].values()]
    assert math.isclose(data["warm_ratio_max"], max(ratios), rel_tol=1e-12)
    assert data["requirement_met"] == all(r <= data["requirement_ratio"] for r in ratios)
    assert data["requirement_ratio"] == 1.1
