"""Drop a library's useless notice from this process's standard error, C++ logging included.

XLA's C++ code logs some notices to file descriptor 2 at every compile (under SPMD, "GSPMD
sharding propagation is going to be deprecated"), which Python's ``warnings`` filters cannot
reach. :func:`filter_stderr` puts a small filtering process between the descriptor and where it
went; ``tpukit.setup()`` uses it for that notice only.
"""

from __future__ import annotations

import os
import subprocess
import sys

_FILTER = r"""
import os, re, select, sys
if os.fork(): os._exit(0)  # detach: the parent returns at once, the child filters until every writer is gone
drop, held = [m.encode() for m in sys.argv[1:]], b""
def out(data):
    while data and not any(m in data for m in drop):
        try:
            data = data[os.write(1, data):]
        except OSError:  # the stream it forwards to is gone: keep draining so writers never block
            return
while True:
    if held and (len(held) > 65536 or not select.select([0], [], [], 0.05)[0]):
        out(held)  # a line still being written after 50 ms (a prompt, a progress bar): pass it on
        held = b""
        continue
    chunk = os.read(0, 65536)
    if not chunk:
        break
    *lines, held = re.split(rb"(?<=[\r\n])", held + chunk)
    for line in lines:
        out(line)
out(held)
"""
_FILTERED: list[str] = []  # the markers this process's stderr is filtered of (set once)


def filter_stderr(*markers: str) -> bool:
    """Drop every line containing one of ``markers`` from this process's standard error (file
    descriptor 2, so C++ logging too) and pass everything else through unchanged. A small process
    does the filtering, so what a crashing process wrote last still comes out. Once per process;
    not on a terminal (the stream would stop being one). Returns True when the filter is on."""
    if _FILTERED:
        return set(markers) <= set(_FILTERED)
    try:
        if os.isatty(2):
            return False
        saved = os.dup(2)
    except OSError:
        return False
    r, w = os.pipe()
    try:  # the filter detaches (forks, its parent exits) into its own session, away from Ctrl-C
        subprocess.run([sys.executable, "-S", "-c", _FILTER, *markers], stdin=r, stdout=saved, stderr=saved,
                       close_fds=True, start_new_session=True, check=True, timeout=60)
        sys.stderr.flush()
        os.dup2(w, 2)
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        for fd in (r, w, saved):
            os.close(fd)
    _FILTERED.extend(markers)
    return True
