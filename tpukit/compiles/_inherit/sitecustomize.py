"""Run at the start of every Python process that a tpukit process starts (``!python train.py``
from a notebook, a Ray worker of a local cluster, ``subprocess``): tpukit puts this folder on
the children's ``PYTHONPATH`` when it turns compile tracing on.

A child inherits its parent's environment, so its torch_xla would append its compile analyses
to the parent's trace file (``PT_XLA_DEBUG_FILE``) and the notebook would show a script's
compiles as its own. When that variable names another process's tpukit trace file, this drops
it (and ``PT_XLA_DEBUG_LEVEL``) before torch_xla can read them; ``tpukit.setup()`` in the child
then makes the child's own. Then the next ``sitecustomize`` on the path, if any, runs as usual.

Standard library only, and never imports tpukit: the child may be any Python.
"""

import os
import re
import sys

# The name of a tpukit trace file; the same pattern as tpukit.compiles.config.TRACE_NAME (a test checks).
TRACE_NAME = r"tpukit-[^/\\]*[/\\]compiles-(\d+)\.log$"


def drop_inherited_trace(environ=os.environ, pid=None):
    """Remove the compile-trace settings of another process's tpukit trace file from ``environ``;
    True when they were removed."""
    m = re.search(TRACE_NAME, environ.get("PT_XLA_DEBUG_FILE", ""))
    if not m or int(m.group(1)) == (os.getpid() if pid is None else pid):
        return False
    environ.pop("PT_XLA_DEBUG_FILE", None)
    environ.pop("PT_XLA_DEBUG_LEVEL", None)
    return True


def _chain():
    """Run the ``sitecustomize`` this one shadows (the next one on ``sys.path``), as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


drop_inherited_trace()
_chain()
