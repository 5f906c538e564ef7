"""More than one process or host: the notebook-safe launcher and the slice runner.

* :mod:`.remote`: what both share: the Message a remote process sends back, fd-level capture,
  ``[rank N]`` / ``[host N]`` prefixing, tracebacks from the user's code, record forwarding.
* :mod:`.launcher`: :func:`launch`, multi-process (``xmp.spawn``-style) code from a notebook: the
  plan, the refusals, the supervision; :mod:`._replica`: what runs in each replica process.
* :mod:`.hosts`: the hosts of a TPU slice: what each is told (:func:`hosts.current`,
  :func:`hosts.process_group`), its records tagged with ``.host``, the task that runs on each.
* :mod:`.raycluster`: the Ray cluster: a connection, a whole idle slice, its reservation and release.
* :mod:`.pod`: :func:`run_on_slice`: checks, a task per host, the hosts' supervision.
* :mod:`.localslice`: :class:`LocalSlice`, a slice simulated by a local multi-node Ray cluster.

Ray is imported only inside functions (the ``pod`` extra).
"""

from . import hosts
from .launcher import launch
from .localslice import LocalSlice
from .pod import run_on_slice

__all__ = ["launch", "run_on_slice", "LocalSlice", "hosts"]
