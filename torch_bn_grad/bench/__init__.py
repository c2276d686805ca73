"""The benchmarks behind the README's figures, shipped with the package so that
``python -m torch_bn_grad.bench [...]`` runs from any install (wheel, plain or
editable), without the source tree.

* ``ops.py``: the operator table and its plot, and the command line
  (``--model`` runs ``models.py``, ``--processes N`` runs the table, or the
  model table, in N fresh processes: ``processes.py``).
* ``models.py``: a whole model with our BatchNorm against torch's: the
  project's ResNets (``resnets.py``) or timm's (``timm_models.py``).
* ``speedup_plot.py``: the speedup plot both tables draw (``--plot``).

The checkout's ``benchmarks/`` holds the tools that need a checkout (profiling,
allocators, per-call costs) and the recorded results; they import these modules.
"""

from __future__ import annotations

from typing import Optional


def main(argv: Optional[list[str]] = None) -> None:
    """Command-line entry point: :func:`torch_bn_grad.bench.ops.main`."""
    from torch_bn_grad.bench import ops

    ops.main(argv)
