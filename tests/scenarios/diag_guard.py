"""The corpus loops under ``no_recompile_after(2)`` in a fresh interpreter (test_diagnosis.py).

Prints ``RESULT <json>``: per loop, the error message it raised (or None), its steps
and how many graphs it compiled after the warm-up.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tpukit

tpukit.setup(device="cpu")

import diag_loops as loops

NAMES = sys.argv[1:] or ["guide_single_device", "gradient_accumulation", "bucket_batcher", "dynamic_padding",
                         "last_partial_batch"]
out = {}
for name in NAMES:
    try:
        tr = getattr(loops, name)(guard=tpukit.no_recompile_after(2))
        out[name] = {"raised": None, "steps": len(tr.history),
                     "late_compiles": sum(r.compiles for r in tr.history[2:])}
    except tpukit.RecompilationError as e:
        out[name] = {"raised": str(e)}
print("RESULT", json.dumps(out))
