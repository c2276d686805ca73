"""torch.compile: the operators' lowering in inductor (``lowering.py``, the fused
activations' in ``inductor_act.py``) and its installation in inductor's tables
(``inductor.py``)."""
