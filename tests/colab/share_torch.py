"""Hard-link the torch + torch_xla install of one virtual environment into another.

``make test-colab`` builds a second environment with Colab's notebook stack. The
torch / torch_xla pair (about 7 GB with its nvidia-* wheels) is the same in both,
so instead of a second download and unpack its files are hard-linked from
``.venv``: no extra disk, a few seconds. pip then sees the pair as installed.

Usage: python share_torch.py SRC_SITE_PACKAGES DST_SITE_PACKAGES
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys

SHARED = re.compile(r"^(torch|torch[-_]xla|triton|nvidia-.*)$", re.IGNORECASE)


def link_tree(src_site: str, dst_site: str) -> tuple[int, int]:
    """Hard-link every file of the shared distributions; returns (distributions, files)."""
    dists = files = 0
    for dist in md.distributions(path=[src_site]):
        name = dist.metadata["Name"] or ""
        if not SHARED.match(name):
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
    if dists < 2:
        print(f"share_torch: no torch / torch_xla install found in {src}; build .venv first (make install)",
              file=sys.stderr)
        return 1
    print(f"share_torch: linked {dists} distributions ({files} files) from {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
