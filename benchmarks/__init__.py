"""Benchmarks of torch_bn_grad, beside ``tests/``: not part of the installed package.

* ``ops.py``: the operator table and plot (``python -m torch_bn_grad.bench``, or
  ``python benchmarks/ops.py`` in a checkout); ``--model`` runs ``models.py``.
* ``models.py``: a whole ResNet (``resnets.py``) with our BatchNorm against torch's.
* ``call_overhead.py``: the per-call cost of a tiny BatchNorm2d.
* ``allocators.py``: ``examples/train.py`` under each memory allocator.
"""
