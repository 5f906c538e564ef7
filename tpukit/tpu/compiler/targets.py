"""The TPUs tpukit can estimate for: one table of chips and slices, each number with its public source.

A target names a slice the way Cloud TPU and Colab/Kaggle do (``v5e-8``: eight
v5e chips); ``v5p-8`` and ``v4-8`` keep Google's older naming by TensorCores
(two per chip), so they are four chips. The TPU compiler is given the slice's
topology (``topology``, ``chips_per_host``), compile-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from ...errors import TpukitError

GiB = 1024**3


class TargetError(TpukitError, ValueError):
    """An unknown TPU target name."""


@dataclass(frozen=True)
class Chip:
    """One TPU generation's per-chip figures, with the page they come from."""

    name: str
    hbm_bytes: int  # HBM per chip
    peak_bf16_flops: float  # dense bf16 FLOP/s per chip
    hbm_bytes_per_s: float  # HBM bandwidth per chip
    source: str
    usable_hbm_bytes: int = 0  # the HBM the TPU compiler lets a program use, per chip (0: not measured: the full HBM)


# Public figures from Cloud TPU's system-architecture pages (checked 2026-11). usable_hbm_bytes is the TPU
# compiler's own: measured 2026-11-28 with libtpu 0.0.17 (jax 0.7.2), compile-only, by compiling for one chip
# of each target an MLP training step too big for it (1024-4096-1024, SGD; 1M rows on v5e, 1.5M rows on v6e
# and v4, 6M rows on v5p) and reading the refusal's "Used X of Y hbm" (Y is written to 2 decimals of GiB):
#   v5e-1: "Used 30.00G of 15.75G hbm", reserved 258.00M (libtpu 0.0.7.1 says 15.75G too)
#   v6e-1: "Used 45.00G of 31.25G hbm", reserved 260.00M
#   v5p-8: "Used 180.00G of 95.74G hbm", reserved 263.00M (more than the public 95 GiB: the compiler's figure)
#   v4-8:  "Used 45.00G of 15.25G hbm", reserved 16.75G (half the chip's 32 GiB kept back on this
#          compile-only topology; its check of a single allocation still allows 32 GiB: "Allocation
#          (size=...) would exceed memory (size=34359738368)")
# A refusal's own figure wins over these (TpuEstimate.hbm_limit_bytes); they are the limit of a step that fits.
CHIPS = {
    "v5e": Chip("v5e", 16 * GiB, 197e12, 819e9, "https://cloud.google.com/tpu/docs/v5e", int(15.75 * GiB)),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 1640e9, "https://cloud.google.com/tpu/docs/v6e", int(31.25 * GiB)),
    "v5p": Chip("v5p", 95 * GiB, 459e12, 2765e9, "https://cloud.google.com/tpu/docs/v5p", int(95.74 * GiB)),
    "v4": Chip("v4", 32 * GiB, 275e12, 1228e9, "https://cloud.google.com/tpu/docs/v4", int(15.25 * GiB)),
}


@dataclass(frozen=True)
class Target:
    """A TPU slice to compile for: its chip, how many chips, and the topology the compiler is given."""

    name: str  # e.g. "v5e-8"
    chip: Chip
    chips: int
    chips_per_host: int
    topology: str  # jax.experimental.topologies name, e.g. "v5e:2x4"
    host_bounds: tuple[int, int, int]  # chips per host as the topology's (x, y, z) bounds
    note: str = ""

    @property
    def hosts(self) -> int:
        """Hosts (TPU VMs) in the slice."""
        return max(1, self.chips // self.chips_per_host)

    @property
    def hbm_bytes(self) -> int:
        """HBM per chip."""
        return self.chip.hbm_bytes

    @property
    def usable_hbm_bytes(self) -> int:
        """The HBM per chip the TPU compiler lets a program use (what it measures a step against)."""
        return self.chip.usable_hbm_bytes or self.chip.hbm_bytes


def _t(name: str, chip: str, chips: int, per_host: int, topology: str, bounds: tuple[int, int, int],
       note: str = "") -> Target:
    return Target(name, CHIPS[chip], chips, per_host, topology, bounds, note)


TARGETS: dict[str, Target] = {t.name: t for t in [
    _t("v5e-1", "v5e", 1, 1, "v5e:1x1", (1, 1, 1), "Colab's TPU runtime"),
    _t("v5e-4", "v5e", 4, 4, "v5e:2x2", (2, 2, 1)),
    _t("v5e-8", "v5e", 8, 8, "v5e:2x4", (2, 4, 1), "Kaggle's TPU image (one host)"),
    _t("v5e-16", "v5e", 16, 4, "v5e:4x4", (2, 2, 1), "four hosts of four chips"),
    _t("v5e-32", "v5e", 32, 4, "v5e:4x8", (2, 2, 1), "eight hosts of four chips"),
    _t("v6e-1", "v6e", 1, 1, "v6e:1x1", (1, 1, 1)),
    _t("v6e-4", "v6e", 4, 4, "v6e:2x2", (2, 2, 1)),
    _t("v6e-8", "v6e", 8, 8, "v6e:2x4", (2, 4, 1), "one host"),
    _t("v6e-16", "v6e", 16, 4, "v6e:4x4", (2, 2, 1), "four hosts of four chips"),
    _t("v5p-8", "v5p", 4, 4, "v5p:2x2x1", (2, 2, 1), "8 TensorCores = 4 chips"),
    _t("v4-8", "v4", 4, 4, "v4:2x2x1", (2, 2, 1), "8 TensorCores = 4 chips"),
]}


def target(name: str | Target) -> Target:
    """The :class:`Target` called ``name`` (e.g. ``"v5e-8"``); a clear error lists the known ones."""
    if isinstance(name, Target):
        return name
    key = str(name).strip().lower().replace("_", "-")
    key = {"v5litepod-" + k.split("-")[1]: k for k in TARGETS if k.startswith("v5e-")}.get(key, key)
    if key not in TARGETS:
        raise TargetError(f"unknown TPU target {name!r}. Known targets: {', '.join(TARGETS)}.")
    return TARGETS[key]

