"""A CPU training step's operator self time by kind (convolution, batch norm,
activation, addition, other), and Amdahl's bound on what a faster batch norm
can gain: if the operators a conversion replaces took no time at all, the
step would take the rest, so

    speedup <= step / (step - replaced).

``convert_batchnorm`` replaces batch norm; ``convert_batchnorm(fuse=True)``
replaces batch norm, the activations and the residual additions. The
"addition" kind counts every ``aten::add``/``add_``, the optimizer's update
and autograd's gradient sums included, so the fused bound is generous. In a
compiled step (``--compile``) inductor's kernels count by their names: batch
norm where one holds it (with whatever activation or addition it fused),
activation where one holds an activation, else other.
Used by ``benchmarks/profile_model.py --breakdown``.
"""

from __future__ import annotations

from typing import Iterable

KINDS = ("convolution", "batch norm", "activation", "addition", "other")
# The kinds each conversion replaces.
REPLACED = {"ours": ("batch norm",), "fused": ("batch norm", "activation", "addition")}

_ACTIVATIONS = ("relu", "threshold_backward", "clamp_min", "silu", "hardswish", "sigmoid")
_ADDITIONS = ("aten::add", "aten::add_", "AddBackward0")
# Inductor's CPU kernels, as torch.profiler names them (config.cpp.enable_kernel_profile).
_INDUCTOR_KERNEL = "cpp_fused_"


def kind_of(name: str) -> str:
    """The kind of a profiler event (an operator, an autograd node, or a kernel
    inductor generated and named by the operators it fused) by its name."""
    lower = name.lower()
    if name.startswith("torch_bn_grad::") or "batch_norm" in lower or "batchnorm" in lower:
        return "batch norm"
    if _INDUCTOR_KERNEL in lower:
        # Never the convolution itself (an external call): a name holding
        # convolution_backward is the elementwise work inductor fused around it.
        return "activation" if any(a in lower for a in _ACTIVATIONS) else "other"
    if "conv" in lower:
        return "convolution"
    if any(a in lower for a in _ACTIVATIONS):
        return "activation"
    if name in _ADDITIONS:
        return "addition"
    return "other"


def by_kind(events: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Self times summed per kind, from (name, self time) pairs; every kind present."""
    times = dict.fromkeys(KINDS, 0.0)
    for name, self_time in events:
        times[kind_of(name)] += self_time
    return times


def share(times: dict[str, float], kinds: Iterable[str]) -> float:
    """The fraction of the step's self time spent in `kinds`."""
    total = sum(times.values())
    return sum(times[k] for k in kinds) / total if total > 0 else 0.0


def bound(times: dict[str, float], kinds: Iterable[str]) -> float:
    """Amdahl's bound: the step's speedup if the operators of `kinds` took no time."""
    return 1.0 / (1.0 - share(times, kinds))


def report(times: dict[str, dict[str, float]], unit: float = 1e3) -> list[str]:
    """The table (one column per model, milliseconds when times are in microseconds)
    and, from the first model's (native's) times, each conversion's bound."""
    names = list(times)
    lines = [f"{'':12s}" + "".join(f"{n:>10s}" for n in names)]
    for kind in KINDS + ("total",):
        row = [sum(times[n].values()) if kind == "total" else times[n][kind] for n in names]
        lines.append(f"{kind:12s}" + "".join(f"{v / unit:10.1f}" for v in row))
    base = times[names[0]]
    for conversion, kinds in REPLACED.items():
        line = (f"{conversion}: replaces {', '.join(kinds)}: {100 * share(base, kinds):.1f}% of "
                f"{names[0]}'s step, so its step is at most {bound(base, kinds):.3f}x faster")
        if conversion in times:
            line += f" (profiled: {sum(base.values()) / sum(times[conversion].values()):.3f}x)"
        lines.append(line)
    return lines
