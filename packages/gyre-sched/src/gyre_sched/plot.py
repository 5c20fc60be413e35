"""Timeline plots of simulated runs: each cell's role over time, shaded by how busy it was.

Needs matplotlib, which is the `plot` extra (`pip install gyre-sched[plot]`); without it `timeline_png`
raises `PlotUnavailable` naming the extra, and nothing else in the package needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre_sched.protocol import Role
from gyre_sched.sim import SimResult


class PlotUnavailable(RuntimeError):
    pass


COLORS = {
    Role.ROLLOUT: "#2b7bba",
    Role.TRAINING: "#d95f02",
    Role.DRAINING: "#999999",
    Role.TO_TRAINING: "#999999",
    Role.TO_ROLLOUT: "#999999",
    Role.FAILED: "#000000",
}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable("timeline plots need matplotlib: pip install 'gyre-sched[plot]'") from exc
    return plt


def timeline_png(results: list[SimResult], path: str | Path, cells: int) -> Path:
    """Write one panel per result: a row per cell, blue = rollout, orange = training, grey = switching;
    the shade is the cell's utilization (pale = idle). Returns the path written."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 1.0 + 0.45 * cells * len(results)), squeeze=False)
    horizon = max(r.end_to_end_h for r in results)
    for ax, res in zip(axes[:, 0], results, strict=True):
        for seg in res.timeline:
            alpha = (
                0.15 + 0.85 * max(0.0, min(1.0, seg.busy))
                if seg.role in (Role.ROLLOUT, Role.TRAINING)
                else 0.9
            )
            ax.broken_barh(
                [(seg.start_s / 3600.0, (seg.end_s - seg.start_s) / 3600.0)],
                (seg.cell_id - 0.4, 0.8),
                facecolors=COLORS[seg.role],
                alpha=alpha,
                linewidth=0,
            )
        ax.set_xlim(0, horizon)
        ax.set_ylim(-0.6, cells - 0.4)
        ax.set_yticks(range(cells), [("core" if i == 0 else f"cell {i}") for i in range(cells)])
        ax.invert_yaxis()
        ax.set_title(
            f"{res.policy}{' (streaming)' if res.streaming else ''}: {res.end_to_end_h:.1f} h, "
            f"idle {res.idle_total:.0%} (rollout {res.idle_rollout:.0%}, training {res.idle_training:.0%}), "
            f"staleness {res.staleness_mean:.2f} (max {res.staleness_max:.0f}), {res.switches} switches",
            fontsize=9,
        )
    axes[-1, 0].set_xlabel("hours (blue: rollout, orange: training, grey: switching; pale: idle)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
