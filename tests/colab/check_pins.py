"""Check that this environment holds Colab's pins, and that installing tpukit the
way the notebooks' install cells do would change none of them.

Usage:
  python check_pins.py PINS                      every pinned package is installed at its pin
  python check_pins.py PINS --install SPEC       ``pip install --dry-run SPEC`` changes no pinned package
  python check_pins.py PINS --notebooks NB...    the same for every ``%pip install`` / ``!pip install`` line
                                                 of each notebook, with tpukit's ``git+`` URL read as this
                                                 checkout
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout the notebooks' git+ URL stands for
# Packages Colab's TPU runtime does not have and an install cell must not add: its front end is
# classic Notebook 6.5.7, and JupyterLab would pull in a second front end and its server extensions.
NOT_ON_COLAB = {"jupyterlab": "Colab's front end is Notebook 6.5.7; tpukit[notebooks] is for local installs"}
_INSTALL = re.compile(r"^\s*[%!]\s*pip3?\s+install\s+(.*)$")
_GIT_SPEC = re.compile(r"^tpukit(\[[\w,\s-]+\])?\s*@\s*git\+https://github\.com/tpukit/tpukit(?:\.git)?(?:@\S+)?$")
_QUIET = {"-q", "-qq", "--quiet", "--progress-bar=off"}


def read_pins(path: str) -> dict[str, str]:
    """``{normalized name: version}`` of the ``name==version`` lines of a requirements file."""
    pins = {}
    for line in open(path):
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)==([^\s#;]+)", line)
        if m:
            pins[normalize(m.group(1))] = m.group(2)
    return pins


def normalize(name: str) -> str:
    """PEP 503 name normalization."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_mismatches(pins: dict[str, str]) -> list[str]:
    """Pinned packages missing or at another version in this environment."""
    out = []
    for name, want in pins.items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            out.append(f"{name}: not installed (pinned {want})")
            continue
        if have != want:
            out.append(f"{name}: {have} installed, pinned {want}")
    return out


def install_lines(source: str) -> list[str]:
    """The ``%pip install ...`` / ``!pip install ...`` lines of a notebook cell's source."""
    return [line.strip() for line in source.splitlines() if _INSTALL.match(line)]


def install_args(line: str, root: Path = ROOT) -> list[str]:
    """The arguments of a notebook's install line as ``pip install`` takes them here: quiet flags dropped,
    tpukit's ``git+https://github.com/tpukit/tpukit`` URL replaced by the checkout ``root`` (same extras).

    Raises ValueError for a line that is not a pip install line.
    """
    m = _INSTALL.match(line)
    if not m:
        raise ValueError(f"not a pip install line: {line!r}; expected '%pip install ...' or '!pip install ...'")
    args = []
    for arg in shlex.split(m.group(1)):
        if arg in _QUIET:
            continue
        git = _GIT_SPEC.match(arg)
        args.append(f"{root}{(git.group(1) or '').replace(' ', '')}" if git else arg)
    return args


def notebook_install_lines(path: str | Path) -> list[tuple[int, str]]:
    """``(code cell number, line)`` of every install line in a notebook (code cells counted from 1)."""
    cells = [c for c in json.loads(Path(path).read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
    return [(i, line) for i, cell in enumerate(cells, 1)
            for line in install_lines("".join(cell["source"]))]


def dry_run_report(args: str | list[str]) -> tuple[list[dict], str]:
    """What ``pip install --dry-run ARGS`` would install here: its report's ``install`` items, and pip's
    error text when it fails (an empty list then)."""
    args = [args] if isinstance(args, str) else list(args)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", *args],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return [], f"pip install --dry-run {shlex.join(args)} failed: {proc.stderr.strip()[-400:]}"
    return json.loads(proc.stdout).get("install", []), ""


def dry_run_changes(pins: dict[str, str], args: str | list[str]) -> list[str]:
    """Pinned packages that ``pip install --dry-run ARGS`` would install, upgrade or downgrade, and the
    packages Colab does not have that it would add (``NOT_ON_COLAB``)."""
    items, error = dry_run_report(args)
    if error:
        return [error]
    out = []
    for item in items:
        meta = item.get("metadata", {})
        name = normalize(meta.get("name", ""))
        if name in pins:
            out.append(f"{name}: would become {meta.get('version')} (pinned {pins[name]})")
        elif name in NOT_ON_COLAB:
            out.append(f"{name}: would be added ({NOT_ON_COLAB[name]})")
    return out


def notebook_changes(pins: dict[str, str], paths: list[str | Path], root: Path = ROOT) -> list[str]:
    """``dry_run_changes`` for every install line of the notebooks, each distinct line run once;
    a notebook without an install line is a problem too (it would not run where tpukit is missing)."""
    out, seen = [], {}
    for path in paths:
        lines = notebook_install_lines(path)
        if not lines:
            out.append(f"{Path(path).name}: no '%pip install' line (it must install what it needs)")
        for cell, line in lines:
            args = tuple(install_args(line, root))
            if args not in seen:
                seen[args] = dry_run_changes(pins, list(args))
            out += [f"{Path(path).name} code cell {cell} ({line}): {p}" for p in seen[args]]
    return out


def main() -> int:
    """Exit non-zero, listing what differs, when a pin is not held."""
    args = sys.argv[1:]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    pins = read_pins(args[0])
    if len(args) == 3 and args[1] == "--install":
        problems, what = dry_run_changes(pins, args[2]), f"installing {args[2]!r}"
    elif len(args) >= 3 and args[1] == "--notebooks":
        problems, what = notebook_changes(pins, args[2:]), f"the install cells of {len(args) - 2} notebook(s)"
    else:
        problems, what = installed_mismatches(pins), "this environment"
    if problems:
        print(f"check_pins: {what} does not keep Colab's pins:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"check_pins: {what} keeps all {len(pins)} of Colab's pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
