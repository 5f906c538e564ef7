"""A value read from the device inside library code is named at the library's line and at
the user's line that called it (issue 17), on the real XLA:CPU runtime.

The library is transformers 5.x: BERT given a 2-D attention mask checks it for padding
(``padding_mask.all()`` in ``transformers/masking_utils.py``) during the forward pass, a
forced read. The model is a tiny BERT built from a config (no hub). Its sizes and the
batch shape are used by no other test, so XLA's process-wide graph cache cannot hide
the compiles from this one.
"""

import ast
import inspect
import os

import torch

import tpukit
from tpukit.compiles import classify

MASK_FILE = "transformers/masking_utils.py"
TESTS = os.path.dirname(os.path.abspath(__file__))


def _read_line() -> tuple[str, int]:
    """The function and line of the installed transformers that reads ``padding_mask.all()``."""
    from transformers import masking_utils

    fn = masking_utils._ignore_bidirectional_mask_sdpa
    lines, first = inspect.getsourcelines(fn)
    hits = [first + k for k, text in enumerate(lines) if "padding_mask.all()" in text]
    assert len(hits) == 1, f"transformers changed its mask check: {hits}"
    return fn.__name__, hits[0]


def _line_of(marker: str) -> int:
    src = open(__file__).read().splitlines()
    hits = [k + 1 for k, text in enumerate(src) if text.rstrip().endswith(f"# MARK: {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def _tiny_bert():
    """A 1-layer BERT classifier built from a config (no hub), in eval mode on the XLA device,
    and a batch with a 2-D attention mask (one row padded), as transformers' examples pass it."""
    import torch_xla
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=40, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=56, max_position_embeddings=24, num_labels=3)
    config._attn_implementation = "sdpa"
    model = BertForSequenceClassification(config).eval().to(torch_xla.device())
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[1, 9:] = 0
    return model, {"input_ids": torch.randint(1, 50, (3, 13)), "attention_mask": mask}


def _bert_loop():
    """Two steps of a tracked eval loop over the tiny BERT."""
    model, batch = _tiny_bert()
    tracker = tpukit.track([batch, batch], progress=False)
    with torch.no_grad():
        for batch in tracker:
            logits = model(**batch).logits  # MARK: model call
            tpukit.log(top=logits.max())
    return tracker


def _item_loop():
    """The user's own mid-step read: named at the user's line, with the user's hint."""
    import torch_xla

    w = torch.randn(7, 5, device=torch_xla.device())
    tracker = tpukit.track([torch.randn(3, 7) for _ in range(2)], progress=False)
    for x in tracker:
        y = x @ w
        if y.abs().sum().item() > 0:  # MARK: own read
            y = y * 2
    return tracker


def test_a_read_inside_transformers_is_named_at_its_line_and_at_the_users_call(rt):
    function, line = _read_line()
    tracker = _bert_loop()
    events = [e for r in tracker.history for e in r.compile_events]
    said = "\n".join(e.describe() for e in events)
    forced = [e for e in events if e.forced]
    assert len(forced) == 1 and tracker.history[0].item_reads == 1, said
    ev = forced[0]
    read_at = f"{MASK_FILE}:{line} in {function}"
    user_at = f"test_library_reads.py:{_line_of('model call')} in _bert_loop"
    assert ev.read_frame is not None and ev.read_frame.package_path == MASK_FILE, said
    assert (ev.read_frame.line, str(ev.read_frame)) == (line, read_at), said
    assert ev.where == user_at, said  # the user's line stays the place to look
    assert ev.cut == "forced read" and ev.kind == classify.NEW, said
    assert ev.name.startswith(f"forced read graph at {read_at}, called from {user_at} ("), ev.name
    assert ev.hint.startswith("transformers reads the value in its own code, during your call"), ev.hint
    assert "tpukit.data.bert_mask(mask)" in ev.hint, ev.hint
    text = ev.describe()
    assert text.startswith(f"new graph: forced read graph at {read_at}, called from {user_at} (") and \
        "tpukit.data.bert_mask" in text, text
    # The step's own graph is named at the user's line alone.
    steps = [e for e in events if not e.forced]
    assert steps and all(e.read_frame is None and e.name.startswith(f"step graph at {user_at.rsplit(':', 1)[0]}")
                         for e in steps), said


def test_a_read_on_the_users_own_line_keeps_the_users_hint(rt):
    tracker = _item_loop()
    forced = [e for r in tracker.history for e in r.compile_events if e.forced]
    assert forced, [e.describe() for r in tracker.history for e in r.compile_events]
    ev = forced[0]
    user_at = f"test_library_reads.py:{_line_of('own read')} in _item_loop"
    assert ev.read_frame is None and ev.where == user_at
    assert ev.name.startswith(f"forced read graph at {user_at} (") and ev.hint == classify.FORCED_HINT


def test_in_a_notebook_cell_the_read_is_called_from_the_cells_line():
    """The same read from a cell of a real IPython shell, in a fresh interpreter: called from the cell's line."""
    from conftest import run_python  # here: the child imports this module, and conftest configures a runtime

    cells = [f"import sys, torch\nsys.path.insert(0, {TESTS!r})\nfrom test_library_reads import _tiny_bert\n"
             "model, batch = _tiny_bert()\nbatch = {k: v.to(model.device) for k, v in batch.items()}\n",
             "# the forward pass, as transformers' examples write it\nwith torch.no_grad():\n"
             "    logits = model(**batch).logits\nprint(logits.sum().cpu())\n"]
    code = ("import tpukit\ntpukit.setup(device='cpu')\n"
            "from IPython.core.interactiveshell import InteractiveShell\nfrom tpukit import compiles\n"
            "shell = InteractiveShell.instance()\n"
            f"for cell in {cells!r}:\n"
            "    assert shell.run_cell(cell, store_history=True).success\n"
            "print('NAMES', [e.name for e in compiles.events_since(0) if e.forced])\n")
    out = run_python(code, env={"PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    names = ast.literal_eval(next(ln[6:] for ln in out.stdout.splitlines() if ln.startswith("NAMES ")))
    function, line = _read_line()
    assert len(names) == 2, names  # transformers' read, then the cell's own .cpu() of the result
    read_at = f"{MASK_FILE}:{line} in {function}"
    assert names[0].startswith(f"forced read graph at {read_at}, called from cell [2] line 3 ("), names
    assert names[1].startswith("forced read graph at cell [2] line 4 ("), names
