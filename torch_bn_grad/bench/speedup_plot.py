"""The speedup plot of the benchmarks (needs matplotlib): one labelled marker per
case on a log axis with a line at 1.0x, colour and marker shape from two of
the case's properties, cases slower than native outlined and labelled in red.
Used by the operator table (``ops.py``) and the model table (``models.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Point:
    """One case: its label, its speedup over native, and the keys of its colour and marker."""

    label: str
    speedup: float
    colour: str
    marker: str


def plot_speedups(points: list[Point], path: str, title: str, colours: dict, markers: dict) -> None:
    """Write the plot of `points` to `path`; `colours` and `markers` map the
    points' keys to matplotlib colours and marker shapes (and name the legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(9, max(3.0, 0.24 * len(points) + 1.2)))
    for i, p in enumerate(points):
        slow = p.speedup < 1
        ax.plot(p.speedup, i, linestyle="none", marker=markers.get(p.marker, "o"), markersize=6,
                color=colours.get(p.colour, "tab:gray"), markeredgecolor="tab:red" if slow else None,
                markeredgewidth=2.0 if slow else 1.0)
        ax.annotate(f"{p.speedup:.2f}x", (p.speedup, i), xytext=(6, 0), textcoords="offset points",
                    va="center", fontsize=6, color="tab:red" if slow else "black")
    ax.axvline(1.0, color="black", linewidth=1.0)
    ax.set_xscale("log")
    speedups = [p.speedup for p in points] or [1.0]
    ax.set_xlim(min(min(speedups), 1.0) / 1.3, max(max(speedups), 1.0) * 1.5)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 8.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(axis="x", which="both", alpha=0.3)
    ax.set_yticks(range(len(points)), [p.label for p in points], fontsize=6)
    for tick, p in zip(ax.get_yticklabels(), points):
        if p.speedup < 1:
            tick.set_color("tab:red")
    ax.set_ylim(len(points) - 0.5, -0.5)
    ax.set_xlabel("speedup over torch native (ratio of median times, log scale; left of 1.0x: slower)")
    ax.set_title(title)
    handles = [Line2D([], [], linestyle="none", marker="o", color=c, label=k) for k, c in colours.items()
               if any(p.colour == k for p in points)]
    handles += [Line2D([], [], linestyle="none", marker=m, color="gray", label=k) for k, m in markers.items()
                if any(p.marker == k for p in points)]
    handles.append(Line2D([], [], linestyle="none", marker="o", color="white", markeredgecolor="tab:red",
                          markeredgewidth=2.0, label="slower than native (red)"))
    handles.append(Line2D([], [], color="black", label="1.0x (same as native)"))
    ax.legend(handles=handles, fontsize=7, loc="lower right", framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
