"""Hard-link the Python-independent wheels one virtual environment holds into another.

``make test-colab`` builds ``.venv-colab`` (Python 3.13, torch 2.9.0) next to ``.venv``
(Python 3.12, torch 2.8.0). The two torch builds need mostly the same nvidia-* wheels
(about 3 GB unpacked): binaries tagged ``py3-none``, the same files for any Python. Instead
of unpacking them twice, their files are hard-linked from ``.venv``: no extra disk, a few
seconds. pip then sees them installed and replaces only those whose version the second
torch needs differently (removing a link never touches the first environment's file).

Usage: python share_wheels.py SRC_SITE_PACKAGES DST_SITE_PACKAGES
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys

SHARED = re.compile(r"^nvidia-.*$", re.IGNORECASE)


def python_independent(dist: md.Distribution) -> bool:
    """True when every tag of the wheel the distribution came from is ``py3-none-*`` (no Python ABI)."""
    wheel = dist.read_text("WHEEL") or ""
    tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]
    return bool(tags) and all(t.startswith("py3-none-") for t in tags)


def link_tree(src_site: str, dst_site: str) -> tuple[int, int]:
    """Hard-link every file of the shared distributions; returns (distributions, files)."""
    dists = files = 0
    for dist in md.distributions(path=[src_site]):
        name = dist.metadata["Name"] or ""
        if not SHARED.match(name) or not python_independent(dist):
            continue
        dists += 1
        for rel in dist.files or ():
            src = os.path.normpath(os.path.join(src_site, str(rel)))
            if not src.startswith(os.path.abspath(src_site) + os.sep) or not os.path.isfile(src):
                continue  # scripts in bin/ and the like: not needed
            dst = os.path.join(dst_site, os.path.relpath(src, src_site))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if not os.path.exists(dst):
                os.link(src, dst)
                files += 1
    return dists, files


def main() -> int:
    """Link, or exit non-zero with what is missing."""
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    src, dst = (os.path.abspath(p) for p in sys.argv[1:3])
    dists, files = link_tree(src, dst)
    if dists == 0:
        print(f"share_wheels: no nvidia-* wheel found in {src}; build .venv first (make install)", file=sys.stderr)
        return 1
    print(f"share_wheels: linked {dists} distributions ({files} files) from {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
