"""Cells run through a real IPython InteractiveShell in a fresh interpreter (test_diagnosis.py).

Prints ``RESULT <json>``: for each cell, its execution count and its compile events
as ``[kind, where, evidence]``.
"""

import json

import tpukit

tpukit.setup(device="cpu")

from IPython.core.interactiveshell import InteractiveShell

from tpukit import compiles

CELLS = [
    # [1]
    ("import torch\n"
     "import torch.nn as nn\n"
     "import torch_xla\n"
     "import torch_xla.core.xla_model as xm\n"
     "import tpukit\n"),
    # [2]
    ("device = torch_xla.device()\n"
     "model = nn.Sequential(nn.Linear(6, 51), nn.ReLU(), nn.Linear(51, 51), nn.ReLU(), nn.Linear(51, 1)).to(device)\n"
     "optimizer = torch.optim.SGD(model.parameters(), lr=0.01)\n"
     "batches = [torch.randn(n, 6) for n in (4, 4, 4, 4, 6, 6)]\n"),
    # [3]: a tracked loop; the batch grows from 4 to 6 rows at step 5
    ("tracker = tpukit.track(batches, progress=False)\n"
     "for x in tracker:\n"
     "    loss = model(x).pow(2).mean()\n"
     "    loss.backward()\n"
     "    optimizer.step()\n"
     "    optimizer.zero_grad()\n"),
    # [4]: the guide's own loop with xm.mark_step() at line 8; the input grows at the 4th step
    ("# the guide's loop, no track\n"
     "for n in (3, 3, 3, 5):\n"
     "    x = torch.randn(n, 6).to(device)\n"
     "    loss = model(x).pow(2).mean()\n"
     "    loss.backward()\n"
     "    optimizer.step()\n"
     "    optimizer.zero_grad()\n"
     "    xm.mark_step()\n"),
]

shell = InteractiveShell.instance()
out = []
for code in CELLS:
    n0 = compiles.event_count()
    res = shell.run_cell(code, store_history=True)
    assert res.success, res.error_in_exec
    evs = compiles.events_since(n0)
    out.append({"count": res.execution_count, "events": [[e.kind, e.where, list(e.evidence)] for e in evs]})
print("RESULT", json.dumps(out))
