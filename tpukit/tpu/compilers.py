"""Which TPU compiler answers, and which one the user's runtime runs.

torch_xla pins the libtpu its runtime loads, and the TPU compiler is in libtpu:
two releases of it can answer differently for the same step (a 16-layer
long-sequence training step for a v5e-1 was refused at 52.32 GB by libtpu
0.0.7.1, compiled in 15.7 GB by 0.0.17 and in 12.9 GB by 0.0.50.1). An estimate
is only as true as the compiler that made it, so every :class:`TpuEstimate`
names its compiler (:func:`describe`), and says so when it is not the one the
installed torch_xla's runtime loads (:func:`mismatch`).

:data:`RUNTIMES`: torch_xla release -> the libtpu it pins and the jax that drives
that libtpu. Sources: torch_xla's ``setup.py`` (``_libtpu_version``, the
``tpu`` extra) for each release; Colab's TPU runtime ships torch_xla 2.9 with
libtpu 0.0.21.1 and jax 0.7.2, Kaggle's TPU image torch_xla 2.8 with libtpu
0.0.17 (force-installed) and jax 0.7.2 (Kaggle/docker-python, ``tpu/Dockerfile``,
``tpu/requirements.in``). All of these pairs install from the package index and
compile compile-only on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._xla import versions as _torch_xla


@dataclass(frozen=True)
class Runtime:
    """The TPU compiler a torch_xla release's runtime runs: its libtpu, and the jax release that drives it."""

    torch_xla: tuple[int, int]
    libtpu: str
    jax: str
    source: str

    @property
    def name(self) -> str:
        """``"torch_xla 2.8"``."""
        return "torch_xla " + ".".join(map(str, self.torch_xla))


_SETUP = "pytorch/xla setup.py of the release (_libtpu_version, the tpu extra)"
RUNTIMES: dict[tuple[int, int], Runtime] = {r.torch_xla: r for r in (
    Runtime((2, 6), "0.0.7.1", "0.4.38", _SETUP),
    Runtime((2, 7), "0.0.11.1", "0.5.3", _SETUP),
    Runtime((2, 8), "0.0.17", "0.7.2", _SETUP + "; Kaggle's TPU image (Kaggle/docker-python tpu/Dockerfile)"),
    Runtime((2, 9), "0.0.21.1", "0.7.2", _SETUP + " (0.0.21); Colab's TPU runtime ships 0.0.21.1 with jax 0.7.2"),
)}


def runtime(release: tuple[int, int] | None = None) -> Runtime | None:
    """The compiler torch_xla ``release`` runs (default: the installed torch_xla's); None for a release the
    table does not know, or when torch_xla is not installed."""
    release = release or _torch_xla.installed()
    return RUNTIMES.get(tuple(release)) if release else None


def describe(found: dict[str, str]) -> str:
    """``"libtpu 0.0.17 (jax 0.7.2)"`` from the versions the worker reports (``tpukit.tpu.versions()``)."""
    if not found.get("libtpu"):
        return ""
    return f"libtpu {found['libtpu']} (jax {found.get('jax') or '?'})"


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def mismatch(found: dict[str, str], release: tuple[int, int] | None = None) -> str | None:
    """What to know when the compiler that answered is not the one torch_xla ``release``'s runtime loads
    (default: the installed torch_xla), or None when they are the same (or the release is not known).

    A libtpu that differs only in its fourth number (Colab's 0.0.21.1 for torch_xla 2.9's 0.0.21) is the
    same compiler."""
    rt = runtime(release)
    libtpu = found.get("libtpu", "")
    if rt is None or not libtpu or _release(libtpu)[:3] == _release(rt.libtpu)[:3]:
        return None
    return (f"compiled by libtpu {libtpu}; {rt.name}'s runtime runs libtpu {rt.libtpu}, whose answer can differ "
            f"(its answer: libtpu=={rt.libtpu} with jax=={rt.jax} where the estimate runs; on a TPU VM, "
            f"torch_xla's runtime loads that same libtpu)")
