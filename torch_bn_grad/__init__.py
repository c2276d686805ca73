"""torch_bn_grad: fused, exact and fast batch-normalization operators for PyTorch."""
from torch_bn_grad import _C  # noqa: F401  (loads the library and registers the operators)
