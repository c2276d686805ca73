"""torch_bn_grad.functional.batch_norm against torch.nn.functional.batch_norm."""

from __future__ import annotations

import pytest
import torch

from torch_bn_grad import functional as BF


@pytest.mark.parametrize("shape", [(8, 3), (4, 3, 5), (2, 3, 4, 5), (2, 3, 2, 3, 4)])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("momentum", [0.1, 0.5])
def test_matches_torch(shape, training, momentum):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1
    w, b = torch.rand(3, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    rm, rv = torch.randn(3, generator=g, dtype=torch.float64), torch.rand(3, generator=g, dtype=torch.float64) + 1
    rm2, rv2 = rm.clone(), rv.clone()
    ours = BF.batch_norm(x, rm, rv, w, b, training, momentum, 1e-5)
    ref = torch.nn.functional.batch_norm(x, rm2, rv2, w, b, training, momentum, 1e-5)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(rm, rm2)
    torch.testing.assert_close(rv, rv2)


def test_training_without_running_stats():
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    torch.testing.assert_close(BF.batch_norm(x, None, None, training=True),
                               torch.nn.functional.batch_norm(x, None, None, training=True))


def test_errors_match_torch():
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        BF.batch_norm(torch.randn(1, 3), None, None, training=True)
    with pytest.raises(ValueError, match="eps must be positive"):
        BF.batch_norm(torch.randn(4, 3), None, None, training=True, eps=0.0)
    with pytest.raises(ValueError, match="running_mean"):
        BF.batch_norm(torch.randn(4, 3), None, None, training=False)
