"""The TPU compilers' own Python environments: one per jax/libtpu pair, built on first use, never the kernel's.

A compiler that is installed where tpukit runs (the same jax, jaxlib and libtpu,
read from package metadata) runs there, with ``sys.executable``. Any other pair
gets a virtual environment of its own under ``~/.cache/tpukit/compilers/<libtpu>-<jax>``
(``TPUKIT_COMPILERS`` overrides the folder), made once with ``python -m venv`` and
``uv pip install`` (``uv`` next to this Python, importable, or on the PATH; else
``pip --python``) of exactly ``jax==J jaxlib==J libtpu==L`` from the package
index: the kernel's own packages never move.

An environment is built into a temporary folder, checked (its jax, jaxlib and
libtpu are the ones asked for), stamped (``tpukit-env.json``) and renamed into
place, so a half-built one is never used; a file lock lets one process build it
while others wait for it. Without the index (offline) the build fails with a
:class:`CompilerEnvError` that has the command to run by hand.

:func:`newest` says which pair ``pip install "jax[tpu]"`` installs today
(``uv pip compile``, else ``pip install --dry-run --report``), remembered for a day.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ...errors import TpukitError, TpukitWarning
from .installed import versions as installed_versions

try:
    import fcntl
except ImportError:  # not on Linux or macOS: no lock between processes (TPUs are Linux)
    fcntl = None

log = logging.getLogger("tpukit")

ENV_VAR = "TPUKIT_COMPILERS"
STAMP = "tpukit-env.json"
# What one environment downloads: libtpu's wheel (136-143 MB for 0.0.7.1 and 0.0.21.1), jaxlib's (80-100 MB),
# numpy, scipy and ml_dtypes (about 60 MB). About 850 MB on disk once installed.
DOWNLOAD_MB = 300
NEWEST_MAX_AGE_S = 24 * 3600  # how long the answer of "which jax[tpu] is the newest" is kept
_THREAD_LOCK = threading.Lock()


class CompilerEnvError(TpukitError):
    """A TPU compiler's environment could not be built (offline, or the installer failed); has the command."""


def root() -> Path:
    """Where the compilers' environments live: ``$TPUKIT_COMPILERS``, else ``~/.cache/tpukit/compilers``."""
    return Path(os.environ.get(ENV_VAR) or Path.home() / ".cache" / "tpukit" / "compilers")


def key(found: dict[str, str]) -> str:
    """The folder name of a pair's environment: ``"0.0.17-0.7.2"`` (libtpu-jax; jaxlib added when it differs)."""
    name = f"{found['libtpu']}-{found['jax']}"
    return name + (f"-jaxlib{found['jaxlib']}" if found.get("jaxlib") and found["jaxlib"] != found["jax"] else "")


def pins(found: dict[str, str]) -> list[str]:
    """The requirements of a pair: ``["jax==0.7.2", "jaxlib==0.7.2", "libtpu==0.0.17"]``."""
    return [f"jax=={found['jax']}", f"jaxlib=={found.get('jaxlib') or found['jax']}", f"libtpu=={found['libtpu']}"]


def is_installed(found: dict[str, str]) -> bool:
    """True when this Python has exactly this jax, jaxlib and libtpu installed (the worker then runs here)."""
    here = installed_versions()
    want = {"jax": found["jax"], "jaxlib": found.get("jaxlib") or found["jax"], "libtpu": found["libtpu"]}
    return all(here[d] == v for d, v in want.items()) and importlib.util.find_spec("jax") is not None


def python(found: dict[str, str], label: str) -> str:
    """The Python that runs this pair's compiler: ``sys.executable`` when it is installed here, else its own
    environment's, built on first use (``label`` names it in the progress lines: ``"torch_xla 2.6"``)."""
    if is_installed(found):
        return sys.executable
    dest = root() / key(found)
    ready = _ready(dest, found)
    if ready:
        return ready
    with _THREAD_LOCK, _file_lock(root() / f".{key(found)}.lock"):
        return _ready(dest, found) or _adopt(dest, found) or _build(dest, found, label)


def _interpreter(env: Path) -> Path:
    return env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _ready(dest: Path, found: dict[str, str]) -> str | None:
    """The environment's Python when it was completed for ``found`` (its stamp says so) and still runs."""
    try:
        stamp = json.loads((dest / STAMP).read_text())
    except (OSError, ValueError):
        return None
    exe = _interpreter(dest)
    if stamp.get("versions") != {d: found.get(d) or found["jax"] for d in ("jax", "jaxlib", "libtpu")} \
            or not exe.exists():  # exists() follows the link: the Python it was made from is gone
        return None
    return str(exe)


def _check(exe: Path) -> dict[str, str]:
    """The jax, jaxlib and libtpu an environment's Python has (package metadata; imports none of them)."""
    code = ("import importlib.metadata as m, json\n"
            "print(json.dumps({d: m.version(d) for d in ('jax', 'jaxlib', 'libtpu')}))")
    try:
        out = subprocess.run([str(exe), "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout) if out.returncode == 0 else {}
    except (OSError, ValueError, subprocess.SubprocessError):  # not a Python that runs: not this pair
        return {}


def _stamp(env: Path, found: dict[str, str], label: str, seconds: float) -> None:
    want = {d: found.get(d) or found["jax"] for d in ("jax", "jaxlib", "libtpu")}
    (env / STAMP).write_text(json.dumps({"versions": want, "for": label, "built": time.time(),
                                         "seconds": round(seconds, 1),
                                         "python": ".".join(map(str, sys.version_info[:3]))}))


def _adopt(dest: Path, found: dict[str, str]) -> str | None:
    """An environment made by hand at ``dest`` (the command of :class:`CompilerEnvError`): stamped and used
    when it has exactly the pair; anything else found there is moved aside and rebuilt."""
    if not dest.exists():
        return None
    exe = _interpreter(dest)
    want = {d: found.get(d) or found["jax"] for d in ("jax", "jaxlib", "libtpu")}
    if exe.exists() and _check(exe) == want:
        _stamp(dest, found, "made by hand", 0.0)
        return str(exe)
    aside = dest.with_name(f".{dest.name}.stale-{os.getpid()}")
    os.replace(dest, aside)
    shutil.rmtree(aside, ignore_errors=True)
    return None


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """One builder of an environment at a time, across processes (others wait here, then find it built)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)


def uv() -> str | None:
    """The ``uv`` executable to install with: next to this Python, from the ``uv`` package, or on the PATH."""
    beside = Path(sys.executable).parent / ("uv.exe" if os.name == "nt" else "uv")
    if beside.exists():
        return str(beside)
    if importlib.util.find_spec("uv") is not None:
        try:
            import uv as _uv

            return _uv.find_uv_bin()
        except Exception:  # a broken uv package: look further
            pass
    return shutil.which("uv")


def _commands(env: Path, found: dict[str, str]) -> list[list[str]]:
    """The install commands to try, in order: uv's (fast, its own cache), then pip's (reads pip.conf)."""
    exe = str(_interpreter(env))
    tool = uv()
    out = [[tool, "pip", "install", "--python", exe, *pins(found)]] if tool else []
    return out + [[sys.executable, "-m", "pip", "--python", exe, "install", "--no-input",
                   "--disable-pip-version-check", *pins(found)]]


def by_hand(found: dict[str, str]) -> str:
    """The commands that build this pair's environment by hand (tpukit checks and uses it then)."""
    dest = root() / key(found)
    return (f"{shlex.quote(sys.executable)} -m venv --without-pip {shlex.quote(str(dest))} && "
            f"{shlex.quote(sys.executable)} -m pip --python {shlex.quote(str(_interpreter(dest)))} install "
            + " ".join(pins(found)))


def _run(cmd: list[str]) -> tuple[int, list[str]]:
    """Run an installer, its lines to the log as they come (downloads and the result at WARNING level)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PIP_PROGRESS_BAR="off"))
    lines = []
    for line in proc.stdout:
        line = line.rstrip()
        if not line:
            continue
        lines.append(line)
        loud = line.lstrip().startswith(("Downloading", "Downloaded", "Installed", "Successfully installed"))
        log.log(logging.WARNING if loud else logging.INFO, "tpukit:   %s", line.strip())
    return proc.wait(), lines


def _build(dest: Path, found: dict[str, str], label: str) -> str:
    """Build ``dest`` for ``found`` (see the module doc); the caller holds the lock."""
    start = time.perf_counter()
    warnings.warn(f"tpukit: the TPU compiler of {label} (libtpu {found['libtpu']}, jax {found['jax']}) is not "
                  f"installed here: downloading it once from the package index, about {DOWNLOAD_MB} MB (about "
                  f"850 MB on disk), into its own environment {dest} (TPUKIT_COMPILERS moves it); the kernel's own "
                  "packages do not change. This takes a minute or more.", TpukitWarning, stacklevel=2)
    log.info("tpukit: building the TPU compiler environment for %s into %s", label, dest)
    tmp = dest.with_name(f".{dest.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp)], capture_output=True,
                              text=True, timeout=300)
        if made.returncode != 0:
            raise CompilerEnvError(f"could not create a virtual environment for the TPU compiler of {label}: "
                                   f"{made.stderr.strip()[-500:]}. Build it by hand: {by_hand(found)}")
        tail: list[str] = []
        for cmd in _commands(tmp, found):
            code, lines = _run(cmd)
            if code == 0:
                break
            tail = lines[-8:]
            log.info("tpukit: %s failed (exit code %d)", Path(cmd[0]).name, code)
        else:
            raise CompilerEnvError(
                f"could not install the TPU compiler of {label} (libtpu {found['libtpu']}, jax {found['jax']}) "
                f"into its own environment: the package index may be unreachable (offline?). The installer "
                f"said: {' / '.join(tail) or 'nothing'}. Run this by hand where the index is reachable, then "
                f"ask again: {by_hand(found)}")
        want = {d: found.get(d) or found["jax"] for d in ("jax", "jaxlib", "libtpu")}
        got = _check(_interpreter(tmp))
        if got != want:
            raise CompilerEnvError(f"the TPU compiler's environment for {label} has {got or 'nothing'} installed "
                                   f"where {want} was asked for. Build it by hand: {by_hand(found)}")
        _stamp(tmp, found, label, time.perf_counter() - start)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.warning("tpukit: the TPU compiler environment for %s is ready (%.0f s): %s", label,
                time.perf_counter() - start, dest)
    return str(_interpreter(dest))


def built(found: dict[str, str]) -> bool:
    """True when this pair runs without a build: installed here, or its environment is complete."""
    return is_installed(found) or _ready(root() / key(found), found) is not None


def _resolve_newest() -> dict[str, str]:
    """Which jax, jaxlib and libtpu ``pip install "jax[tpu]"`` would install now (asks the package index)."""
    names = ("jax", "jaxlib", "libtpu")
    tool = uv()
    if tool:
        out = subprocess.run([tool, "pip", "compile", "-", "--python", sys.executable, "--quiet", "--no-header",
                              "--no-annotate"], input="jax[tpu]\n", capture_output=True, text=True, timeout=300)
        pinned = dict(line.split("==", 1) for line in out.stdout.split() if "==" in line)
        if out.returncode == 0 and all(n in pinned for n in names):
            return {n: pinned[n] for n in names}
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                          "--report", "-", "jax[tpu]"], capture_output=True, text=True, timeout=600)
    try:
        report = json.loads(out.stdout)
        pinned = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
        return {n: pinned[n] for n in names}
    except (ValueError, KeyError) as exc:
        raise CompilerEnvError(
            f"could not ask the package index which jax[tpu] is the newest ({out.stderr.strip()[-300:] or exc}): "
            f"offline? Name a compiler instead (compiler='torch_xla 2.9'), or run by hand: "
            f"{sys.executable} -m pip install --dry-run \"jax[tpu]\"") from None


def newest(max_age_s: float = NEWEST_MAX_AGE_S) -> dict[str, str]:
    """The jax, jaxlib and libtpu of the newest ``jax[tpu]`` on the package index, asked at most once a day
    (kept in ``newest.json``); offline, the last answer (a warning says so)."""
    path = root() / "newest.json"
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = None
    if kept and time.time() - kept.get("asked", 0) < max_age_s:
        return kept["versions"]
    try:
        found = _resolve_newest()
    except (CompilerEnvError, OSError, subprocess.SubprocessError):
        if kept:
            log.warning("tpukit: could not ask the package index for the newest jax[tpu]; using the answer of %s "
                        "(libtpu %s)", time.strftime("%Y-%m-%d", time.localtime(kept.get("asked", 0))),
                        kept["versions"]["libtpu"])
            return kept["versions"]
        raise
    write_json(path, {"versions": found, "asked": time.time()})
    return found


def write_json(path: Path, data: object) -> None:
    """Write ``data`` as JSON to ``path`` through a temp file beside it (its folder made if needed): the file
    is complete or absent, never half written. The kit's cache files (compiler answers, breakdowns, the
    newest compiler's versions) are written this way; raises ``OSError`` as writing does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
