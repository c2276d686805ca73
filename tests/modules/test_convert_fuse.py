"""convert_batchnorm(model, fuse=True): which BatchNorm + activation (+ residual)
sites are fused, that a fused model computes what the unfused converted model
computes (outputs, gradients, running statistics; float64), that nothing that
cannot be fused is left silently (the warning), and that fused models
compile (fullgraph, no graph breaks) and export. timm models end to end.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._dynamo.utils import counters

import torch_bn_grad
from torch_bn_grad import nn as bn_nn
from torch_bn_grad.bench import resnets as _models

try:
    import timm
    import torchvision
except Exception as exc:  # noqa: BLE001 (any import failure: version mismatch, missing package)
    timm = torchvision = None
    SKIP = f"timm/torchvision do not import here ({type(exc).__name__}: {exc})"
else:
    SKIP = ""
needs_timm = pytest.mark.skipif(timm is None, reason=SKIP)


def _fused_count(model: nn.Module) -> int:
    return sum(isinstance(m, bn_nn.BatchNormActBase) for m in model.modules())


def _convert(model: nn.Module, **kwargs) -> tuple[nn.Module, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch_bn_grad.convert_batchnorm(model, fuse=True, **kwargs)
    return out, [str(w.message) for w in caught if "fuse=True" in str(w.message)]


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9 + 1e-9 * scale, msg=lambda m: f"{what}: {m}")


def _assert_same(ref: nn.Module, new: nn.Module, x: torch.Tensor, steps: int = 2) -> None:
    """Training steps then eval: outputs, input and parameter gradients, buffers."""
    for mode in ["train"] * steps + ["eval"]:
        getattr(ref, mode)(), getattr(new, mode)()
        xr, xn = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref.zero_grad(set_to_none=True), new.zero_grad(set_to_none=True)
        yr, yn = ref(xr), new(xn)
        _close(yn, yr, f"{mode} output")
        dy = torch.randn_like(yr)
        yr.backward(dy), yn.backward(dy)
        _close(xn.grad, xr.grad, f"{mode} input gradient")
        inner = getattr(new, "_orig_mod", new)  # a torch.compile'd module's names are its module's
        new_params = dict(inner.named_parameters())
        for name, p in ref.named_parameters():
            if p.grad is not None:
                _close(new_params[name].grad, p.grad, f"{mode} gradient of {name}")
        new_buffers = dict(inner.named_buffers())
        for name, b in ref.named_buffers():
            _close(new_buffers[name], b, f"{mode} buffer {name}")
        x = x * 1.5 + 0.25


class FunctionalBlock(nn.Module):
    """A torchvision-style BasicBlock written with F.relu, `out += identity` and a downsample."""

    def __init__(self, c_in: int, c: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.downsample = nn.Sequential(nn.Conv2d(c_in, c, 1, stride, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        out += self.downsample(x)
        return F.relu(out)


class Variants(nn.Module):
    """Every supported activation spelling, and the BN as the second operand of the add."""

    def __init__(self) -> None:
        super().__init__()
        self.bns = nn.ModuleList(nn.BatchNorm2d(3) for _ in range(6))
        self.silu = nn.SiLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu_(self.bns[0](x))
        x = self.bns[1](x).relu()
        x = F.leaky_relu(self.bns[2](x), 0.2)
        x = F.silu(x + self.bns[3](x))
        x = self.silu(self.bns[4](x))
        return nn.functional.leaky_relu(torch.add(self.bns[5](x), x), negative_slope=0.3, inplace=True)


def _check_fused(model: nn.Module, x: torch.Tensor, expect_fused: int, graph_module: bool) -> nn.Module:
    model = model.double()
    ref = torch_bn_grad.convert_batchnorm(copy.deepcopy(model))
    fused, warned = _convert(copy.deepcopy(model))
    assert not warned, warned
    assert _fused_count(fused) == expect_fused
    assert isinstance(fused, fx.GraphModule) == graph_module
    assert type(fused).__name__ == type(model).__name__
    assert list(fused.state_dict()) == list(model.state_dict())
    _assert_same(ref, fused, x.double())
    return fused


def test_project_resnets():
    x = torch.randn(2, 3, 16, 16)
    fused = _check_fused(_models.resnet18(10), x, 17, True)  # stem + 2 per basic block
    _check_fused(_models.resnet50(10), x, 49, True)  # stem + 3 per bottleneck
    # The containers on the way to a fused module keep every submodule but not their forward.
    with pytest.raises(RuntimeError, match="call the GraphModule"):
        fused.features(x.double())
    again, warned = _convert(fused)  # converting twice changes nothing
    assert again is fused and not warned and _fused_count(again) == 17
    copied = copy.deepcopy(fused)
    assert list(copied.state_dict()) == list(fused.state_dict())
    torch.testing.assert_close(copied.eval()(x.double()), fused.eval()(x.double()))


def test_functional_block_and_spellings():
    _check_fused(nn.Sequential(FunctionalBlock(3, 4, 2), FunctionalBlock(4, 4)), torch.randn(3, 3, 8, 8), 4, True)
    fused = _check_fused(Variants(), torch.randn(3, 3, 4, 4), 6, True)
    activations = [m.activation for m in fused.modules() if isinstance(m, bn_nn.BatchNormActBase)]
    assert sorted(activations) == ["leaky_relu", "leaky_relu", "relu", "relu", "silu", "silu"]


@pytest.mark.skipif(torchvision is None, reason=SKIP)
def test_torchvision_blocks():
    from torchvision.models.resnet import BasicBlock, Bottleneck

    down = lambda c_in, c: nn.Sequential(nn.Conv2d(c_in, c, 1, 2, bias=False), nn.BatchNorm2d(c))  # noqa: E731
    model = nn.Sequential(BasicBlock(4, 8, 2, down(4, 8)), BasicBlock(8, 8), Bottleneck(8, 2),
                          Bottleneck(8, 4, 2, down(8, 16)))
    _check_fused(model, torch.randn(2, 4, 8, 8), 2 + 2 + 3 + 3, True)
    _check_fused(torchvision.models.resnet18(num_classes=5), torch.randn(2, 3, 32, 32), 17, True)


def test_sequential_pairs_fuse_in_place():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4),
                          nn.LeakyReLU(0.2, inplace=True), nn.BatchNorm2d(4))
    fused = _check_fused(model, torch.randn(2, 3, 6, 6), 2, False)
    assert type(fused) is nn.Sequential
    assert type(fused[1]) is bn_nn.BatchNormAct2d and type(fused[2]) is nn.Identity
    assert fused[4].negative_slope == 0.2 and type(fused[6]) is bn_nn.BatchNorm2d
    weight = model[1].weight
    same = torch_bn_grad.convert_batchnorm(model, fuse=True)
    assert same is model and model[1].weight is weight  # in place, sharing the tensors
    assert torch_bn_grad.convert_batchnorm(model, fuse=True) is model  # twice: nothing changes


def test_memory_saving_where_the_activation_allows():
    model = nn.Sequential(nn.BatchNorm2d(3), nn.LeakyReLU(0.1), nn.BatchNorm2d(3), nn.ReLU())
    fused, _ = _convert(copy.deepcopy(model), memory_saving=True)
    assert [fused[0].memory_saving, fused[2].memory_saving] == [True, False]
    with pytest.raises(ValueError, match="needs fuse=True"):
        torch_bn_grad.convert_batchnorm(model, memory_saving=True)


class Unfusable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used_twice = nn.BatchNorm2d(3)
        self.gelu = nn.BatchNorm2d(3)
        self.shared = nn.BatchNorm2d(3)
        self.hooked = nn.BatchNorm2d(3)
        self.hooked.register_forward_hook(lambda m, i, o: o * 2)
        self.plain = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.used_twice(x)
        x = F.relu(y) + y
        x = F.gelu(self.gelu(x))
        x = torch.relu(self.shared(x))
        x = torch.relu(self.shared(x))
        x = F.silu(self.hooked(x))
        return self.plain(x) * 2


def test_unfusable_sites_are_named_and_compute_as_before():
    model = Unfusable().double()
    ref = torch_bn_grad.convert_batchnorm(copy.deepcopy(model))
    fused, warned = _convert(copy.deepcopy(model))
    assert len(warned) == 1 and _fused_count(fused) == 0 and not isinstance(fused, fx.GraphModule)
    message = warned[0]
    assert "4 BatchNorm(s) left unfused" in message
    assert "other uses than the activation): used_twice" not in message  # the reason, then the names
    for reason, name in [("its output has other uses than the activation", "used_twice"),
                         ("the activation (gelu) is not fusable", "gelu"),
                         ("called more than once", "shared"), ("has hooks", "hooked")]:
        line = next(line for line in message.splitlines() if reason in line)
        assert line.rstrip().endswith(name), message
    assert "plain" not in message  # no activation after it: not a site
    _assert_same(ref, fused, torch.randn(2, 3, 4, 4, dtype=torch.float64))


class NegativeSlopes(nn.Module):
    """LeakyReLU with a negative slope, as a module (in a Sequential) and as a call."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.LeakyReLU(-0.1))
        self.bn = nn.BatchNorm2d(4)
        self.tail = nn.Sequential(nn.BatchNorm2d(4), nn.LeakyReLU(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.leaky_relu(self.bn(self.stem(x)), -0.2)
        return self.tail(x)


def test_negative_slope_stays_unfused_named_and_computes_as_the_original():
    # The fused kernels read leaky_relu's derivative from the output's sign, which a
    # negative slope flips: those sites stay unfused (and run), the others fuse.
    model = NegativeSlopes().double()
    fused, warned = _convert(copy.deepcopy(model))
    assert type(fused.stem[1]) is bn_nn.BatchNorm2d and type(fused.stem[2]) is nn.LeakyReLU
    assert type(fused.bn) is bn_nn.BatchNorm2d and type(fused.tail[0]) is bn_nn.BatchNormAct2d
    assert len(warned) == 1 and "2 BatchNorm(s) left unfused" in warned[0], warned
    for slope, name in [(-0.1, "stem.1"), (-0.2, "bn")]:
        line = next(line for line in warned[0].splitlines() if f"got {slope}" in line)
        assert "(leaky_relu): negative_slope must be finite and >= 0" in line, warned[0]
        assert line.rstrip().endswith(f": {name}"), warned[0]
    _assert_same(model, fused, torch.randn(2, 3, 5, 5, dtype=torch.float64))


@needs_timm
def test_timm_negative_slope_stays_unfused():
    # inplace=False: torch has no in-place leaky_relu backward for a negative slope.
    model = nn.Sequential(timm.layers.BatchNormAct2d(4, act_layer=nn.LeakyReLU, act_kwargs={"negative_slope": -0.1},
                                                     inplace=False),
                          timm.layers.BatchNormAct2d(4, act_layer=nn.LeakyReLU)).double()
    fused, warned = _convert(copy.deepcopy(model))
    assert not isinstance(fused[0], bn_nn.BatchNormActBase) and isinstance(fused[1], bn_nn.BatchNormActBase)
    assert len(warned) == 1 and "its act LeakyReLU: negative_slope must be finite and >= 0" in warned[0], warned
    _assert_same(model, fused, torch.randn(2, 4, 3, 3, dtype=torch.float64))


class TrainingBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.tail = nn.Sequential(nn.BatchNorm2d(3), nn.SiLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(x))
        if self.training:
            x = x * 2
        return self.tail(x)


def test_untraceable_module_children_are_still_fused():
    model = TrainingBranch().double()
    ref = torch_bn_grad.convert_batchnorm(copy.deepcopy(model))
    fused, warned = _convert(copy.deepcopy(model))
    assert type(fused) is TrainingBranch and type(fused.tail[0]) is bn_nn.BatchNormAct2d
    assert len(warned) == 1 and "depends on self.training): bn" in warned[0]
    _assert_same(ref, fused, torch.randn(2, 3, 4, 4, dtype=torch.float64))


def test_compile_fullgraph_and_export():
    model = nn.Sequential(FunctionalBlock(3, 4, 2), FunctionalBlock(4, 4))
    if torchvision is not None:
        from torchvision.models.resnet import Bottleneck

        model.append(Bottleneck(4, 1))
    model = model.double()
    fused, _ = _convert(copy.deepcopy(model))
    assert _fused_count(fused) == (7 if torchvision is not None else 4)
    eager = copy.deepcopy(fused)
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    counters.clear()
    _assert_same(eager, compiled, torch.randn(2, 3, 8, 8, dtype=torch.float64))
    assert sum(counters["graph_break"].values()) == 0
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    for mode in ("eval", "train"):
        program = torch.export.export(copy.deepcopy(eager).train(mode == "train"), (x,))
        torch.testing.assert_close(program.module()(x), copy.deepcopy(eager).train(mode == "train")(x))


@needs_timm
@pytest.mark.parametrize("name,fused_count", [("efficientnet_b0", 49), ("mobilenetv3_small_100", 16)])
def test_timm_models_end_to_end(name, fused_count):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=7).double()
    fused, warned = _convert(copy.deepcopy(model))
    assert _fused_count(fused) == fused_count and type(fused) is type(model)
    norm_act = timm.layers.BatchNormAct2d
    assert all(isinstance(m, (norm_act, bn_nn.BatchNormBase)) for m in fused.modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm))
    if name == "mobilenetv3_small_100":  # Hardswish activations stay unfused, named
        assert len(warned) == 1 and "its act Hardswish is not one of" in warned[0]
    else:
        assert not warned
    _assert_same(model, fused, torch.randn(2, 3, 48, 48, dtype=torch.float64), steps=1)


@needs_timm
def test_timm_fused_model_pickles():
    model = timm.create_model("mobilenetv3_small_100", pretrained=False, num_classes=3).eval()
    fused, _ = _convert(copy.deepcopy(model))  # fused and unfused (Hardswish) derived classes of a dotted module
    again = pickle.loads(pickle.dumps(fused))
    assert type(again.blocks[0][0].bn1) is type(fused.blocks[0][0].bn1) and type(again.bn1) is type(fused.bn1)
    assert isinstance(again.blocks[0][0].bn1, bn_nn.BatchNormActBase) and not isinstance(again.bn1, bn_nn.BatchNormActBase)
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(again(x), model(x))
