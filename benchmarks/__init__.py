"""Benchmarks of torch_bn_grad that need a checkout, beside ``tests/``: not part
of the installed package. The tables behind the README's figures
(``python -m torch_bn_grad.bench``: operators, ``--model``, ``--processes``)
ship inside the package, in ``torch_bn_grad/bench/``; these tools import
what they share with them from there.

* ``profile_model.py``: a ResNet step under torch.profiler; ``--breakdown`` by
  kind of operator with Amdahl's bound (``step_breakdown.py``).
* ``call_overhead.py``: the per-call cost of a tiny BatchNorm2d;
  ``fused_overhead.py``: the same for the fused BatchNormAct2d;
  ``small_layers.py``: small layers' module steps. They time with
  ``_per_call.py``.
* ``host_cost.py``: host time and kernel launches per call on the GPU.
* ``fused.py``: fused BatchNorm + add + ReLU against torch's separate operators.
* ``masked.py``: masked batch norm against unmasked and the gather workaround.
* ``allocators.py``: ``examples/speed.py`` under each memory allocator.
* ``results/``: recorded outputs per device (docs/performance.md).
"""
