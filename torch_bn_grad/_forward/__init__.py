"""What the modules' and the functional API's forward run, a file a path: the
modules' choice of path and statistics (``module.py``, ``act_module.py``), what
every path normalizes with (``normalization.py``), the unmasked batch norm on the
operators (``plain.py``), the masked one (``masked.py``, its mask from
``lengths=`` in ``lengths.py``, its operators in ``masked_operators.py``, its
split stages for SyncBatchNorm in ``masked_stages.py``), and the forward
TorchScript compiles (``scripted.py``)."""
