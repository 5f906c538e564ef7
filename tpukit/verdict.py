"""Where a loop's time went, and how fast it went against the chip, over its step records.

Four shares of the wall time, each measured by the loop (``tpukit.track``) or read
from a profile: compiling, waiting for input, host tracing, device busy time. The
rule that turns them into one word and a suggestion lives here and nowhere else.
:func:`rate` is the one place a run of steps' tokens/s, achieved FLOP/s and MFU are
summed (the summary, the verdict and the dashboard use it); :func:`model_flops` is
the 6·N·tokens count used where no TPU compiler counted the step.
"""

from __future__ import annotations

from dataclasses import dataclass

NOT_A_TPU = "n/a: not a TPU"  # the MFU off a TPU (XLA:CPU): there is no chip peak to measure against
NO_FLOPS = ("n/a: no FLOPs count (pass track(model=...) for 6·N·tokens of a language model's batch, or set a "
            "target TPU: setup(target=...) for the TPU compiler's count)")


def model_flops(parameters: int, tokens: int) -> float:
    """A training step's model FLOPs by the usual estimate: 6·N·tokens (forward 2·N, backward 4·N per token,
    N the parameter count; attention's own FLOPs not counted)."""
    return 6.0 * parameters * tokens


@dataclass(frozen=True)
class Rate:
    """How fast a run of steps went: tokens/s, model FLOPs per step and achieved FLOP/s, and the MFU against
    the chips' peak (None where unknown; ``peak_source``: what the peak is of, or why there is none)."""

    steps: int
    tokens_per_s: float | None = None
    flops_per_step: float | None = None
    flops_source: str | None = None
    flops_per_s: float | None = None
    peak_flops: float | None = None
    peak_source: str | None = None

    @property
    def tflops(self) -> float | None:
        """Achieved TFLOP/s."""
        return self.flops_per_s / 1e12 if self.flops_per_s is not None else None

    def mfu_against(self, peak: float) -> float | None:
        """Achieved FLOP/s over ``peak`` FLOP/s (of all the chips the steps ran on)."""
        return self.flops_per_s / peak if self.flops_per_s is not None and peak > 0 else None

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilization against the chips' peak; None off a TPU or without a FLOPs count."""
        return self.mfu_against(self.peak_flops) if self.peak_flops else None

    @property
    def mfu_note(self) -> str:
        """``38% of 8 × v5e at 197 TFLOP/s (dense bf16)``, or why there is no MFU (``n/a: not a TPU``)."""
        if self.flops_per_s is None:
            return NO_FLOPS
        if self.mfu is None:
            return self.peak_source or NOT_A_TPU
        return f"{self.mfu:.0%} of {self.peak_source}"


def rate(records: list) -> Rate:
    """:class:`Rate` of ``records`` (step records): tokens/s over those with tokens; FLOPs over those counted
    like the last counted one (``flops_source``: a count that changed mid-run, the TPU compiler's answer
    arriving, is not mixed), FLOP/s their FLOPs over their wall time."""
    with_tokens = [r for r in records if getattr(r, "tokens", None)]
    wall = sum(r.wall for r in with_tokens)
    tokens_per_s = sum(r.tokens for r in with_tokens) / wall if with_tokens and wall > 0 else None
    counted = [r for r in records if getattr(r, "flops", None)]
    if not counted:
        return Rate(len(records), tokens_per_s)
    last = counted[-1]
    same = [r for r in counted if r.flops_source == last.flops_source]
    wall = sum(r.wall for r in same)
    return Rate(len(records), tokens_per_s, last.flops, last.flops_source,
                sum(r.flops for r in same) / wall if wall > 0 else None, last.peak_flops, last.peak_source)

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
    rate: Rate | None = None  # how fast the judged steps went: tokens/s, FLOP/s, MFU (see :func:`rate`)


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
    speed = rate(judged)
    mfu = f" at {speed.mfu:.0%} MFU" if speed.mfu is not None else ""
    sentence = f"{kind}-bound{mfu} over {over}: {pct} of the wall time"
    return Verdict(kind, shares, len(judged), settled, sentence, _SUGGEST[kind], speed)
