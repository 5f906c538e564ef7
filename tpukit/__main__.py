"""Command line: ``python -m tpukit doctor [--json]``.

``doctor`` starts the runtime in this process only, prints the same report as
``tpukit.setup()`` and exits non-zero when a problem blocks use.
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import TpukitError


def doctor(as_json: bool = False, device: str = "auto", cpu_devices: int | None = None) -> int:
    """Print the runtime report; return 0 when usable, 1 when something blocks use."""
    from . import environment, runtime

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


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tpukit`` and the ``tpukit`` script."""
    parser = argparse.ArgumentParser(prog="tpukit", description="tpukit command line")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="report devices, versions and problems without training anything")
    d.add_argument("--json", action="store_true", help="print machine-readable JSON")
    d.add_argument("--device", default="auto", choices=["auto", "tpu", "cpu"])
    d.add_argument("--cpu-devices", type=int, default=None, help="number of virtual XLA:CPU devices")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor(as_json=args.json, device=args.device, cpu_devices=args.cpu_devices)
    return 2


if __name__ == "__main__":
    sys.exit(main())
