"""Fused and plain batch norm against float64 autograd of the unfused
composition, on every ISA copy of the CPU kernels, at one and at two threads.

A test names its cases (``(shape, dtype, activation or None, memory_saving,
residual)`` tuples, as Python source) and calls ``check_cases``: each ISA
copy runs them in its own process (``isa_runs``); the forward's output,
statistics and frozen output and every gradient must be within about one
rounding of the output's dtype of the reference (computed once, for the
two-thread run), and bitwise equal at one and at two threads.
"""

from __future__ import annotations

from .isa_runs import run_on_every_isa

_SCRIPT = r"""
import json, torch, torch.nn.functional as F, torch_bn_grad
g = torch.Generator().manual_seed(5)
cases = CASES

def run(shape, dtype, act, memory_saving, residual, check):
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 3).to(dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    r = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) if residual else None
    C = shape[1]
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    gamma = (torch.rand(C, generator=g, dtype=torch.float64) + 0.5).to(pdt)
    beta = torch.randn(C, generator=g, dtype=torch.float64).to(pdt)
    xg, gg, bg = x.clone().requires_grad_(), gamma.clone().requires_grad_(), beta.clone().requires_grad_()
    rg = r.clone().requires_grad_() if r is not None else None
    if act is None:
        out, mean, var = torch_bn_grad.batch_norm_forward(xg, gg, bg, epsilon=1e-5)
        frozen, _, _ = torch_bn_grad.batch_norm_forward(x, gamma, beta, mean.detach(), var.detach(), epsilon=1e-5)
    else:
        out, mean, var = torch_bn_grad.batch_norm_act_forward(xg, gg, bg, residual=rg, epsilon=1e-5, activation=act,
                                                              negative_slope=0.1, memory_saving=memory_saving)
        frozen = None
    wrt = [t for t in (xg, gg, bg, rg) if t is not None]
    grads = torch.autograd.grad(out, wrt, dy)
    bits = [out.detach(), mean.detach(), var.detach(), *grads] + ([frozen] if frozen is not None else [])
    if not check:  # the other thread count's run: its bits only
        return None, bits
    xd, gd, bd = x.double().requires_grad_(), gamma.double().requires_grad_(), beta.double().requires_grad_()
    rd = r.double().requires_grad_() if r is not None else None
    ref = F.batch_norm(xd, None, None, gd, bd, training=True, eps=1e-5)
    if rd is not None:
        ref = ref + rd
    if act == "relu":
        ref = F.relu(ref)
    elif act == "leaky_relu":
        ref = F.leaky_relu(ref, 0.1)
    elif act == "silu":
        ref = F.silu(ref)
    ref_grads = torch.autograd.grad(ref, [t for t in (xd, gd, bd, rd) if t is not None], dy.double())
    dims = [d for d in range(x.dim()) if d != 1]
    ref_mean, ref_var = x.double().mean(dims), x.double().var(dims, unbiased=False)
    def err(a, b):
        return ((a.double() - b) / (b.abs() + 1)).abs().max().item()
    result = {"case": f"{shape} {dtype} {act} memory_saving={memory_saving} residual={residual}",
              "dst": err(out.detach(), ref.detach()), "mean": err(mean, ref_mean), "var": err(var, ref_var),
              "dx": err(grads[0], ref_grads[0]), "dgamma": err(grads[1], ref_grads[1]),
              "dbeta": err(grads[2], ref_grads[2])}
    if frozen is not None:
        ref_frozen = F.batch_norm(x.double(), mean.detach().double(), var.detach().double(), gamma.double(),
                                  beta.double(), training=False, eps=1e-5)
        result["frozen"] = err(frozen, ref_frozen)
    if r is not None:
        result["dresidual"] = err(grads[3], ref_grads[3])
    return result, bits

errors, same_bits = [], []
for case in cases:
    state = g.get_state()
    torch.set_num_threads(2)
    result, two = run(*case, check=True)
    g.set_state(state)
    torch.set_num_threads(1)
    _, one = run(*case, check=False)
    errors.append(result)
    same_bits.append(all(torch.equal(a, b) for a, b in zip(one, two)))
print(json.dumps({"isa": torch_bn_grad.cpu_kernel_isa(), "errors": errors, "same_bits": same_bits}))
"""


# Relative to |reference| + 1: about one rounding of the output's dtype.
_BOUNDS = {"torch.float64": 1e-12, "torch.float32": 2e-5, "torch.float16": 2e-3, "torch.bfloat16": 2 ** -7}
_PARAMETER_BOUNDS = {"torch.float64": 1e-10, "torch.float32": 1e-4, "torch.float16": 1e-3, "torch.bfloat16": 1e-3}


def check_cases(cases: str, env: dict[str, str] | None = None) -> None:
    """Runs `cases` (a Python list literal) on every ISA, with `env` added to
    the environment, and checks them."""
    for capability, run in run_on_every_isa(_SCRIPT.replace("CASES", cases, 1), env).items():
        assert all(run["same_bits"]), (capability, run["same_bits"])
        for case in run["errors"]:
            dtype = case["case"].split()[-4]
            bound, parameter_bound = _BOUNDS[dtype], _PARAMETER_BOUNDS[dtype]
            # The statistics are float32 for half-precision data: their own rounding.
            stats_bound = _BOUNDS["torch.float64" if dtype == "torch.float64" else "torch.float32"]
            for name in ("dst", "frozen", "dx", "dresidual"):
                if name in case:
                    assert case[name] < bound, (capability, name, case)
            for name in ("mean", "var"):
                assert case[name] < stats_bound, (capability, name, case)
            for name in ("dgamma", "dbeta"):
                assert case[name] < parameter_bound, (capability, name, case)
