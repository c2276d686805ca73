"""The rules every path reads, one home each: the activations (``activation.py``), the
dtypes and the accumulation dtype (``channels.py``), the argument checks made in
Python (``checks.py``), the running-statistics update (``running_stats.py``), and
when a call runs eagerly (``eager.py``)."""
