"""bench/results/oom_reports.json: real TPUs' out-of-memory reports held against the kit's compiles.

No compiles here: the file is what bench/oom_reports.py wrote. Each report names its public source, the
chip and runtime, the real "Used X of Y hbm", the kit's figure and verdict, and a ratio that follows from them.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "oom_reports.json"
FIELDS = ("key", "url", "stated_step", "chip", "torch_xla", "real", "real_used_gib", "real_limit_gib",
          "real_used_bytes", "target", "compiler", "compiler_versions", "kit_hbm_bytes", "kit_hbm_source",
          "fits", "status", "ratio", "not_rebuilt")
GiB = 2**30


@pytest.fixture(scope="module")
def data():
    with open(RESULTS) as f:
        return json.load(f)


def test_at_least_three_reports_from_distinct_public_sources(data):
    reports = data["reports"]
    assert len(reports) >= 3
    urls = [r["url"] for r in reports]
    assert len(set(urls)) == len(urls)
    for r in reports:
        missing = [k for k in FIELDS if k not in r]
        assert not missing, (r.get("key"), missing)
        assert re.match(r"https://github\.com/[\w.-]+/[\w.-]+/", r["url"]), r["url"]
        assert r["stated_step"] and r["chip"] and r["torch_xla"] and r["not_rebuilt"]
    assert data["machine"]["torch_xla"] and data["machine"]["transformers"]


def test_the_real_figures_are_the_reports_own_words(data):
    for r in data["reports"]:
        m = re.search(r"Used ([\d.]+)G of ([\d.]+)G hbm", r["real"])
        assert m, r["real"]
        assert float(m.group(1)) == r["real_used_gib"] and float(m.group(2)) == r["real_limit_gib"]
        assert r["real_used_gib"] > r["real_limit_gib"]  # an out-of-memory report
        assert abs(r["real_used_bytes"] - r["real_used_gib"] * GiB) < GiB / 100


def test_each_ratio_follows_from_the_figures(data):
    for r in data["reports"]:
        assert r["kit_hbm_bytes"] > 0 and r["compiler_versions"].startswith("libtpu")
        assert math.isclose(r["ratio"], r["kit_hbm_bytes"] / r["real_used_bytes"], rel_tol=1e-9)
        assert r["status"] in ("fits", "too big") and r["fits"] == (r["status"] == "fits")
        if r["status"] == "too big":  # a refusal gives the compiler's own "Used X of Y"
            assert r["refusal"]["used_bytes"] and r["kit_hbm_source"] == "compiler refusal"
        for comp, o in r.get("other_compilers", {}).items():
            assert comp.startswith("torch_xla") and o["kit_hbm_bytes"] > 0
            assert math.isclose(o["ratio"], o["kit_hbm_bytes"] / r["real_used_bytes"], rel_tol=1e-9)
