"""Benchmarks of torch_bn_grad, beside ``tests/``: not part of the installed package.

* ``ops.py``: the operator table and plot (``python -m torch_bn_grad.bench``, or
  ``python benchmarks/ops.py`` in a checkout); ``--model`` runs ``models.py``,
  ``--processes N`` runs the table (or the model table) in N processes
  (``processes.py``).
* ``models.py``: a whole ResNet (``resnets.py``) with our BatchNorm against torch's.
* ``profile_model.py``: a ResNet step under torch.profiler; ``--breakdown`` by
  kind of operator with Amdahl's bound (``step_breakdown.py``).
* ``speedup_plot.py``: the speedup plot both tables draw (``--plot``).
* ``call_overhead.py``: the per-call cost of a tiny BatchNorm2d;
  ``fused_overhead.py``: the same for the fused BatchNormAct2d. Both time with
  ``_per_call.py``.
* ``fused.py``: fused BatchNorm + add + ReLU against torch's separate operators.
* ``allocators.py``: ``examples/speed.py`` under each memory allocator.
"""
