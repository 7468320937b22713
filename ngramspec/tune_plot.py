"""Plots of a `tune.TuneReport` (matplotlib, drawn off-screen with the Agg canvas).

* `speedup_figure`: modeled speed-up against n_max (the longest draft, log scale), one line
  per type (and per ngramspec option / static cache), best over the other parameters at each
  n_max; solid for one server slot, dashed for several; the auto policy as stars.
* `pareto_figure`: acceptance rate against tokens per step for every configuration, with the
  Pareto front (no other configuration is better on both).

Figures are `matplotlib.figure.Figure` objects on their own Agg canvas: no pyplot, no global
backend switch, so plotting works headless and from any thread that owns its figure.
"""
from __future__ import annotations

import io
import os
from typing import Sequence

from ngramspec.files import atomic_write_bytes

__all__ = ["speedup_figure", "pareto_figure", "pareto_front", "save_plots", "PLOT_FILES",
           "require_matplotlib"]

PLOT_FILES = ("speedup_vs_n_max.png", "acceptance_vs_tokens_per_step.png")


def require_matplotlib() -> None:
    """Check that matplotlib is importable (before a sweep, not after it).

    Raises
    ------
    ValueError
        matplotlib is missing; the message gives the install command.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'ngramspec[tune]'") from None


def _figure(width=8.0, height=5.0):
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def speedup_figure(entries: Sequence, title: str = ""):
    """Modeled speed-up against n_max, one line per (type family, slot count).

    At each n_max the line shows the best speed-up over the family's other parameters. Settings
    with the auto policy are stars in their type's colour (label ``"<family> +auto (K slots)"``).

    Parameters
    ----------
    entries : sequence of Entry
        A `TuneReport`'s entries; chains (no single n_max) are left out.
    title : str
        Default: a title naming the held-out split.

    Returns
    -------
    matplotlib.figure.Figure
        On its own Agg canvas.

    Raises
    ------
    ValueError
        matplotlib is missing.
    """
    best: dict = {}
    for e in entries:
        c = e.config
        if c.n_max is None:
            continue
        key = (c.family, c.n_slots, c.policy)
        point = best.setdefault(key, {})
        point[c.n_max] = max(point.get(c.n_max, 0.0), e.figures["speedup"])
    fig = _figure(width=10.0)
    ax = fig.add_subplot()
    families = sorted({f for f, _, _ in best})
    from matplotlib import colormaps
    palette = colormaps["tab20"]
    colors = {f: palette(i % 20) for i, f in enumerate(families)}
    for (family, n_slots, policy) in sorted(best):
        xs = sorted(best[(family, n_slots, policy)])
        ys = [best[(family, n_slots, policy)][x] for x in xs]
        slots = f"{n_slots} slot{'s' if n_slots > 1 else ''}"
        if policy == "fixed":
            ax.plot(xs, ys, marker="o", color=colors[family],
                    linestyle="-" if n_slots == 1 else "--", label=f"{family} ({slots})")
        else:
            ax.plot(xs, ys, marker="*", markersize=11 if n_slots == 1 else 8, linestyle="none",
                    color=colors[family], label=f"{family} +{policy} ({slots})")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    from matplotlib.ticker import ScalarFormatter
    ax.xaxis.set_major_formatter(ScalarFormatter())      # 4, 8, 16 rather than 2^2, 2^3, 2^4
    ax.set_xlabel("n_max: longest draft (tokens)")
    ax.set_ylabel("modeled speed-up over plain decoding (x)")
    ax.set_title(title or "Best modeled speed-up per n_max (held-out split)")
    ax.grid(True, alpha=0.3)
    # one legend entry per family (colour), per slot count (line style) and for the auto policy
    # (star); the lines themselves keep their full labels
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=colors[f], marker="o", label=f) for f in families]
    handles += [Line2D([], [], color="grey", linestyle="-" if k == 1 else "--",
                       label=f"{k} slot{'s' if k > 1 else ''}")
                for k in sorted({k for _, k, _ in best})]
    if any(p != "fixed" for _, _, p in best):
        handles.append(Line2D([], [], color="grey", marker="*", markersize=11, linestyle="none",
                              label="auto policy (large: 1 slot)"))
    ax.legend(handles=handles, fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def pareto_front(points: Sequence[tuple]) -> list:
    """The points (x, y) that no other point beats on both coordinates.

    Parameters
    ----------
    points : sequence of (float, float)

    Returns
    -------
    list of int
        Their indices, in increasing x (ties kept once).
    """
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1], i))
    front, best_y = [], float("-inf")
    for i in order:
        if points[i][1] > best_y:
            front.append(i)
            best_y = points[i][1]
    return front[::-1]


def pareto_figure(entries: Sequence, title: str = ""):
    """Acceptance rate against tokens per step, every configuration, Pareto front drawn.

    Parameters
    ----------
    entries : sequence of Entry
    title : str
        Default: a title naming the held-out split.

    Returns
    -------
    matplotlib.figure.Figure
        As `speedup_figure`'s.
    """
    fig = _figure()
    ax = fig.add_subplot()
    points = [(e.figures["tokens_per_step"], e.figures["acc_rate"]) for e in entries]
    by_type: dict = {}
    for e, p in zip(entries, points):
        kind = e.config.spec_type if len(e.config.types) == 1 else "chains"
        by_type.setdefault(kind, []).append(p)
    for i, (kind, pts) in enumerate(sorted(by_type.items())):
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, alpha=0.6, color=f"C{i % 10}",
                   label=kind)
    front = pareto_front(points)
    ax.plot([points[i][0] for i in front], [points[i][1] for i in front], color="black",
            drawstyle="steps-post", linewidth=1.2, marker="D", markersize=4, label="Pareto front")
    ax.set_xlabel("tokens per verification step")
    ax.set_ylabel("acceptance rate (accepted / drafted tokens)")
    ax.set_title(title or "Acceptance against tokens per step (held-out split)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small")
    fig.tight_layout()
    return fig


def save_plots(entries: Sequence, directory: str, cost_model: str = "") -> list:
    """Write both figures as PNG files (`PLOT_FILES`) into `directory`.

    Parameters
    ----------
    entries : sequence of Entry
    directory : str
        An existing folder.
    cost_model : str
        Named in the titles when given.

    Returns
    -------
    list of str
        The files' paths.
    """
    where = f"held-out split, cost model {cost_model}" if cost_model else "held-out split"
    titles = (f"Best modeled speed-up per n_max ({where})",
              f"Acceptance against tokens per step ({where})")
    paths = []
    for name, make, title in zip(PLOT_FILES, (speedup_figure, pareto_figure), titles):
        path = os.path.join(directory, name)
        png = io.BytesIO()
        make(entries, title).savefig(png, format="png")
        atomic_write_bytes(path, png.getvalue())
        paths.append(path)
    return paths
