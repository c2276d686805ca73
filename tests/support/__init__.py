"""What the tests share: the float64 references, sample inputs and models,
and the runners for per-ISA subprocesses, spawned ranks, ONNX exports and
compiled steps. Tests import them as ``support.<module>`` (``tests/`` is on
sys.path through ``tests/conftest.py``, pytest's prepend import mode)."""
