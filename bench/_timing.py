"""What the loop benchmarks share: whether a repetition was quiet, and the interval of a median.

``bench/overhead.py`` (tpukit's loop against the loops users write instead) and ``bench/fsdp_loop.py``
(the kit's FSDPv2 loop against torch_xla's) time their loops in repetitions, take a ratio per repetition,
leave out the repetitions during which other processes used the CPUs, and give the median ratio with a
bootstrap interval. Nothing here imports torch or tpukit.
"""

from __future__ import annotations

import os
import random
import statistics


def busy_jiffies() -> tuple[int, int] | None:
    """(CPU jiffies the whole machine was busy, jiffies of this process), from /proc; None elsewhere."""
    try:
        with open("/proc/stat") as f:
            cpu = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            mine = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0)  # idle + iowait
    return sum(cpu[:8]) - idle, int(mine[11]) + int(mine[12])  # utime + stime of all our threads


def others_share(before, after, seconds: float) -> float | None:
    """Fraction of the machine's CPU used by *other* processes between two busy_jiffies()."""
    if before is None or after is None or seconds <= 0:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others / hz / (seconds * (os.cpu_count() or 1)))


def interval(values: list[float], draws: int = 2000, level: float = 0.9) -> tuple[float, float]:
    """A bootstrap interval of the median of ``values`` (``level``: its coverage), seeded: the same
    ratios give the same interval."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    cut = int(draws * (1 - level) / 2)
    return meds[cut], meds[-cut - 1]


def rotated(loops: tuple[str, ...], rep: int) -> tuple[str, ...]:
    """The loops in the order repetition ``rep`` runs them: each goes first in turn."""
    k = rep % len(loops)
    return loops[k:] + loops[:k]


class CountingListener:
    """Stands in for the dashboard: receives every step record."""

    def __init__(self):
        self.steps = 0

    def on_step(self, rec):
        self.steps += 1
