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

:func:`resolve` turns a name into the :class:`Compiler` that answers:
``None`` (the installed torch_xla's release's; ``tpukit.setup(compiler=...)`` and ``$TPUKIT_COMPILER`` are
read before, at the edge: :func:`tpukit.tpu.ask.resolve`), ``"torch_xla 2.8"``, ``"libtpu 0.0.17"``,
``"newest"`` (the newest ``jax[tpu]`` on the package index) or ``"installed"`` (the
jax and libtpu installed where tpukit runs). Each pair runs in its own environment
(:mod:`.venvs`) unless it is the one installed here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..._xla import versions as _torch_xla
from ...errors import TpukitError
from . import venvs
from .installed import versions as _installed


@dataclass(frozen=True)
class Pin:
    """The TPU compiler a torch_xla release's runtime runs (its pin): its libtpu, and the jax release that drives it."""

    torch_xla: tuple[int, int]
    libtpu: str
    jax: str
    source: str

    @property
    def name(self) -> str:
        """``"torch_xla 2.8"``."""
        return "torch_xla " + ".".join(map(str, self.torch_xla))


_SETUP = "pytorch/xla setup.py of the release (_libtpu_version, the tpu extra)"
RUNTIMES: dict[tuple[int, int], Pin] = {r.torch_xla: r for r in (
    Pin((2, 6), "0.0.7.1", "0.4.38", _SETUP),
    Pin((2, 7), "0.0.11.1", "0.5.3", _SETUP),
    Pin((2, 8), "0.0.17", "0.7.2", _SETUP + "; Kaggle's TPU image (Kaggle/docker-python tpu/Dockerfile)"),
    Pin((2, 9), "0.0.21.1", "0.7.2", _SETUP + " (0.0.21); Colab's TPU runtime ships 0.0.21.1 with jax 0.7.2"),
)}


def pin(release: tuple[int, int] | None = None) -> Pin | None:
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
    rt = pin(release)
    libtpu = found.get("libtpu", "")
    if rt is None or not libtpu or _release(libtpu)[:3] == _release(rt.libtpu)[:3]:
        return None
    return (f"compiled by libtpu {libtpu}; {rt.name}'s runtime runs libtpu {rt.libtpu}, whose answer can differ "
            f"(compiler=None or '{rt.name}' asks that one; on a TPU VM, torch_xla's runtime loads it)")


NEWEST, INSTALLED = "newest", "installed"


class CompilerError(TpukitError, ValueError):
    """An unknown TPU compiler name (the message lists the known ones), or one that cannot be had here."""


@dataclass(frozen=True)
class Compiler:
    """The TPU compiler that answers an estimate: a libtpu, the jax (and jaxlib) that drive it, and the name it
    was asked by (``"torch_xla 2.8"``, ``"libtpu 0.0.17"``, ``"newest"``, ``"installed"``)."""

    name: str
    libtpu: str
    jax: str
    jaxlib: str = ""  # "": the same as jax
    source: str = ""

    def versions(self) -> dict[str, str]:
        """``{"jax": ..., "jaxlib": ..., "libtpu": ...}``: what its environment has, part of every cache key."""
        return {"jax": self.jax, "jaxlib": self.jaxlib or self.jax, "libtpu": self.libtpu}

    @property
    def label(self) -> str:
        """``"torch_xla 2.8's compiler, libtpu 0.0.17 (jax 0.7.2)"``: the name and the pair."""
        return f"{role(self.name)}, {describe(self.versions())}" if role(self.name) else describe(self.versions())

    def __str__(self) -> str:
        return self.label


def role(name: str) -> str:
    """What a compiler's name says of it, for a text: ``"torch_xla 2.8's compiler"``, ``"the newest compiler"``,
    ``"the installed compiler"``; ``""`` for a name that is only its libtpu."""
    if name.startswith("torch_xla"):
        return f"{name}'s compiler"
    return f"the {name} compiler" if name in (NEWEST, INSTALLED) else ""


def known() -> str:
    """The names :func:`resolve` knows, as one sentence (for errors and docs)."""
    releases = ", ".join(f"'{r.name}'" for r in RUNTIMES.values())
    pinned = ", ".join(r.libtpu for r in RUNTIMES.values())
    return (f"{releases} (the libtpu and jax its runtime loads), 'libtpu <version>' of one of them ({pinned}; "
            f"'libtpu X jax Y' for any other pair), '{NEWEST}' (the newest jax[tpu] on the package index), "
            f"'{INSTALLED}' (the jax and libtpu installed here), or None (the installed torch_xla's)")


def _newest() -> Compiler:
    found = venvs.newest()
    return Compiler(NEWEST, found["libtpu"], found["jax"], found["jaxlib"],
                    'what pip install "jax[tpu]" installs today (the package index)')


def _here() -> Compiler:
    found = _installed()
    if not (found["jax"] and found["libtpu"]):
        raise CompilerError(f"compiler='{INSTALLED}': no jax and libtpu are installed here. Name another compiler "
                            f"(None: the installed torch_xla's), or install them: pip install \"jax[tpu]\"")
    return Compiler(INSTALLED, found["libtpu"], found["jax"], found["jaxlib"], "installed where tpukit runs")


def default() -> Compiler:
    """The compiler when none is named: the installed torch_xla's release's (:data:`RUNTIMES`), else the jax and
    libtpu installed here, else the newest."""
    rt = pin()
    if rt is not None:
        return Compiler(rt.name, rt.libtpu, rt.jax, source=rt.source)
    found = _installed()
    return _here() if found["jax"] and found["libtpu"] else _newest()


def _by_libtpu(version: str, jax: str | None, name: str) -> Compiler:
    if jax:
        return Compiler(f"libtpu {version} jax {jax}", version, jax, source="named by the caller")
    for rt in RUNTIMES.values():
        if rt.libtpu == version or _release(rt.libtpu)[:3] == _release(version)[:3] == _release(version):
            return Compiler(f"libtpu {rt.libtpu}", rt.libtpu, rt.jax, source=rt.source)
    found = _installed()
    if found["libtpu"] == version and found["jax"]:
        return Compiler(f"libtpu {version}", version, found["jax"], found["jaxlib"], "installed where tpukit runs")
    raise CompilerError(f"unknown TPU compiler {name!r}: which jax drives libtpu {version} is not known here. "
                        f"Name it as 'libtpu {version} jax <version>', or use one of {known()}.")


def resolve(name: "str | Compiler | None" = None) -> Compiler:
    """The :class:`Compiler` a name asks for (see the module doc; None: :func:`default`, the runtime's own); an
    unknown name raises :class:`CompilerError` listing the known ones. ``"newest"`` asks the package index (once
    a day). What ``tpukit.setup(compiler=...)`` named is read at the edge (:func:`tpukit.tpu.ask.resolve`)."""
    if isinstance(name, Compiler):
        return name
    if name is None:
        return default()
    if not isinstance(name, str):
        raise CompilerError(f"compiler={name!r} is not a name: use one of {known()}.")
    text = " ".join(name.strip().lower().replace("==", " ").replace("=", " ").split())
    if text == NEWEST:
        return _newest()
    if text == INSTALLED:
        return _here()
    m = re.fullmatch(r"torch[_-]?xla ?(\d+)\.(\d+)(?:\.\d+)*", text)
    if m:
        rt = RUNTIMES.get((int(m.group(1)), int(m.group(2))))
        if rt is None:
            raise CompilerError(f"unknown TPU compiler {name!r}: tpukit knows the libtpu of these torch_xla "
                                f"releases: {known()}.")
        return Compiler(rt.name, rt.libtpu, rt.jax, source=rt.source)
    m = re.fullmatch(r"libtpu ?(\d+(?:\.\d+)+)(?:[ ,+(]+jax ?(\d+(?:\.\d+)+)\)?)?", text)
    if m:
        return _by_libtpu(m.group(1), m.group(2), name)
    raise CompilerError(f"unknown TPU compiler {name!r}: use one of {known()}.")
