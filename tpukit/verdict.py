"""Where a loop's time went: the bottleneck verdict over its step records.

Four shares of the wall time, each measured by the loop (``tpukit.track``) or read
from a profile: compiling, waiting for input, host tracing, device busy time. The
rule that turns them into one word and a suggestion lives here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

BOTTLENECKS = ("compile", "input", "tracing", "device")
_SUGGEST = {
    "compile": "compiling dominates: find the recompilation alarms and fix their cause (bucket or pad the "
               "inputs, pass changing values as tensors); on a TPU keep the persistent compilation cache on",
    "input": "the loop waits for its data: use more DataLoader workers (num_workers), prefetch with "
             "tpukit.device_loader / track(DataLoader), or preprocess once up front",
    "tracing": "the host spends the step tracing Python ops: wrap the step in torch_xla.compile, fuse small "
               "ops, or do more work per step (a bigger batch)",
    "device": "the device is the limit: use bf16 (torch.autocast('xla', dtype=torch.bfloat16)), a bigger "
              "batch per chip, or more chips",
}


@dataclass(frozen=True)
class Verdict:
    """Where a loop's time went: the bottleneck, the measured shares of wall time, and what to do.

    ``shares`` are fractions of wall time over the judged steps: ``compile``, ``input``
    (waiting for the next batch) and ``tracing`` (host time in the loop body and the
    sync, compiles excluded) are host-side and add up to at most 1; ``device`` is the
    time the device was busy, which overlaps the host's.
    """

    bottleneck: str
    shares: dict
    steps: int
    settled: bool
    sentence: str
    suggestion: str


def bottleneck(records: list, settled_after: int | None = None, tail_wait: float = 0.0,
               tail_device: float = 0.0) -> Verdict | None:
    """Judge a loop's bottleneck over the steps after ``settled_after`` (all steps when None
    or when too few are left), with ``tail_wait``/``tail_device`` the final wait for the device.

    compile when compiling takes at least half the wall time; else input when waiting
    for data is the largest host share (and at least a quarter); else device when the
    device was busy at least 60% of the time; else tracing.
    """
    timed = [r for r in records if r.input_time is not None]
    if not timed:
        return None
    judged = [r for r in timed if settled_after is not None and r.step > settled_after]
    settled = settled_after is not None and len(judged) >= 2
    if not settled:
        judged = timed
    wall = sum(r.wall for r in judged) + tail_wait
    if wall <= 0:
        return None

    def share(total: float) -> float:
        return min(1.0, total / wall)

    shares = {"compile": share(sum(r.compile_time for r in judged)),
              "input": share(sum(r.input_time for r in judged)),
              "tracing": share(sum(r.tracing_time for r in judged)),
              "device": share(sum(r.device_time or 0.0 for r in judged) + tail_device)}
    if shares["compile"] >= 0.5:
        kind = "compile"
    elif shares["input"] >= max(shares["tracing"], 0.25):
        kind = "input"
    elif shares["device"] >= 0.6:
        kind = "device"
    else:
        kind = "tracing"
    over = (f"the {len(judged)} steps after step {settled_after}" if settled and settled_after
            else f"all {len(judged)} steps" + ("" if settled else " (the loop never settled)"))
    pct = ", ".join(f"{k} {shares[k]:.0%}" for k in BOTTLENECKS)
    sentence = f"{kind}-bound over {over}: {pct} of the wall time"
    return Verdict(kind, shares, len(judged), settled, sentence, _SUGGEST[kind])
