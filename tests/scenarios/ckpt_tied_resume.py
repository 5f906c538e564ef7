"""A tiny GPT-2 trained in the README's order, for the tied-weights resume test (tests/test_checkpoint_scale.py).

  python ckpt_tied_resume.py DIR full     train steps 1..6 under tpukit.track, checkpoint after step 3
  python ckpt_tied_resume.py DIR resume   a model and optimizer made the same way, restore step 3, train 4..6

The README's order: the model goes to the device (torch_xla's move unties ``lm_head.weight`` from
``transformer.wte.weight``), the optimizer is made over its parameters (17 tensors for 16), and only
then the loop (``full``) or the restore (``resume``) ties them again. Dropout is off and the batches
are drawn from a generator seeded per step, so both runs train on the same numbers. Prints one
"loss STEP HEX" line per step (the float's exact hex), then "tied True|False" and
"optimizer N model M same True|False" (the optimizer's tensors against the model's parameters).
"""

import sys

import torch

import tpukit
from tpukit.checkpoint import CheckpointManager

VOCAB, SEQ, BATCH = 128, 16, 4


def batches(first: int, last: int) -> list[torch.Tensor]:
    """The token ids of steps ``first..last``, each drawn from its own seed."""
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(s))
            for s in range(first, last + 1)]


def main(directory: str, mode: str) -> None:
    rt = tpukit.setup(device="cpu")
    from transformers import GPT2Config, GPT2LMHeadModel  # after setup: transformers imports torch_xla

    torch.manual_seed(0 if mode == "full" else 1)  # the resume's own initial weights are overwritten
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).to(rt.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = CheckpointManager(directory, keep=2)
    first = 1
    if mode == "resume":
        first = mgr.restore(model, opt) + 1
        assert first == 4, first
    for step, ids in enumerate(tpukit.track(batches(first, 6), progress=False), first):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        print("loss", step, float(loss.item()).hex(), flush=True)
        if mode == "full" and step == 3:
            mgr.save(step, model=model.state_dict(), optimizer=opt.state_dict())
    mgr.close()
    print("tied", model.lm_head.weight is model.transformer.wte.weight)
    held = [p for g in opt.param_groups for p in g["params"]]
    own = list(model.parameters())
    print("optimizer", len(held), "model", len(own), "same", {id(p) for p in held} == {id(p) for p in own})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
