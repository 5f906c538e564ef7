"""Command line: ``python -m tpukit doctor [--json]``.

``doctor`` starts the runtime in this process only, prints the same report as
``tpukit.setup()`` and exits non-zero when a problem blocks use.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from . import environment, runtime
from .errors import TpukitError


def doctor(as_json: bool = False, device: str = "auto", cpu_devices: int | None = None) -> int:
    """Print the runtime report; return 0 when usable, 1 when something blocks use."""
    env = environment.inspect()
    try:
        rt = runtime.setup(device=device, cpu_devices=cpu_devices)
    except TpukitError as exc:
        if as_json:
            print(json.dumps({"ok": False, "error": str(exc), "error_type": type(exc).__name__,
                              "platform": env.platform, "versions": env.versions,
                              "tpu_signals": list(env.tpu_signals)}, indent=2))
        else:
            print(f"tpukit doctor: {env.platform}, versions {env.versions}")
            print(f"  blocking problem: {exc}")
        return 1
    if as_json:
        print(json.dumps({"ok": True, **rt.to_dict()}, indent=2, default=str))
    else:
        print(rt.report())
    return 0


BADGE_RE = re.compile(r"https://colab\.research\.google\.com/github/[^)\s\"]+?/blob/[^/]+/notebooks/([\w.-]+\.ipynb)")


def repository_url(pyproject: Path | None = None) -> str:
    """The repository URL from pyproject.toml ([project.urls] Repository), the one place it lives."""
    import tomllib

    pyproject = pyproject or Path(__file__).resolve().parents[1] / "pyproject.toml"
    with open(pyproject, "rb") as f:
        return tomllib.load(f)["project"]["urls"]["Repository"].rstrip("/")


def colab_url(repo_url: str, notebook: str, branch: str = "main") -> str:
    """The Open-in-Colab link of ``notebooks/<notebook>`` in a GitHub repository."""
    path = repo_url.split("github.com/", 1)[-1]
    return f"https://colab.research.google.com/github/{path}/blob/{branch}/notebooks/{notebook}"


def badges(folder: Path, repo_url: str | None = None) -> list[Path]:
    """Rewrite every Open-in-Colab link in ``folder``'s notebooks from the repository URL; return changed files."""
    repo_url = repo_url or repository_url()
    changed = []
    for nb in sorted(Path(folder).glob("*.ipynb")):
        data = json.loads(nb.read_text())
        dirty = False
        for cell in data.get("cells", []):
            if cell.get("cell_type") != "markdown":
                continue
            src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            new = BADGE_RE.sub(lambda m: colab_url(repo_url, nb.name), src)
            if new != src:
                cell["source"] = new.splitlines(keepends=True)
                dirty = True
        if dirty:
            nb.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
            changed.append(nb)
    return changed


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tpukit`` and the ``tpukit`` script."""
    parser = argparse.ArgumentParser(prog="tpukit", description="tpukit command line")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="report devices, versions and problems without training anything")
    d.add_argument("--json", action="store_true", help="print machine-readable JSON")
    d.add_argument("--device", default="auto", choices=["auto", "tpu", "cpu"])
    d.add_argument("--cpu-devices", type=int, default=None, help="number of virtual XLA:CPU devices")
    b = sub.add_parser("badges", help="rewrite the notebooks' Open-in-Colab links from pyproject's Repository URL")
    b.add_argument("folder", nargs="?", default="notebooks")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor(as_json=args.json, device=args.device, cpu_devices=args.cpu_devices)
    if args.command == "badges":
        for nb in badges(Path(args.folder)):
            print(f"updated {nb}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
