"""Other tools' view of this library: the ONNX exporters (``onnx.py``) and FX
quantization (``quantization.py``)."""
