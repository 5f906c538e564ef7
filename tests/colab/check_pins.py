"""Check that this environment holds Colab's pins, and that installing tpukit the
way the notebooks' install cell does would change none of them.

Usage:
  python check_pins.py PINS                 every pinned package is installed at its pin
  python check_pins.py PINS --install SPEC  ``pip install --dry-run SPEC`` changes no pinned package
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys


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


def dry_run_changes(pins: dict[str, str], spec: str) -> list[str]:
    """Pinned packages that ``pip install --dry-run SPEC`` would install, upgrade or downgrade."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", spec],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return [f"pip install --dry-run {spec} failed: {proc.stderr.strip()[-400:]}"]
    report = json.loads(proc.stdout)
    out = []
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        name = normalize(meta.get("name", ""))
        if name in pins:
            out.append(f"{name}: would become {meta.get('version')} (pinned {pins[name]})")
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
    else:
        problems, what = installed_mismatches(pins), "this environment"
    if problems:
        print(f"check_pins: {what} does not keep Colab's pins:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"check_pins: {what} keeps all {len(pins)} of Colab's pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
