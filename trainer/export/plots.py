"""The plots an export ships next to its model card (the card embeds each by its file name): per-position
acceptance (`PLOT_FILE`) and the confidence head's reliability before and after calibration
(`CALIBRATION_PLOT_FILE`)."""

from __future__ import annotations

from pathlib import Path

from trainer.evaluation.results import AcceptanceResults

PLOT_FILE = "acceptance_per_position.png"
CALIBRATION_PLOT_FILE = "confidence_reliability.png"


def _figure(panels: int, height: float = 4.2):
    """A Figure on an Agg canvas via matplotlib's object API (no pyplot): no GUI backend, no global state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4 * panels, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, panels, squeeze=False)[0]


def plot_acceptance(results: list[AcceptanceResults], path: Path) -> None:
    """pos_k against k, one line per subset, one panel per results file."""
    fig, axes = _figure(len(results))
    for ax, r in zip(axes, results):
        xs = list(range(r.block_size))
        for s in r.subsets:
            ax.plot(xs, [100 * p for p in s.pos], marker="o", linewidth=1.5,
                    label=f"{s.name} ({s.acceptance_length:.2f})")
        ax.set_xticks(xs, [f"pos_{k}" for k in xs])
        ax.set_ylim(0, 100)
        ax.set_ylabel("steps accepting ≥ k+1 drafts (%)")
        ax.set_title(r.title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="subset (acceptance length)", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})


def plot_reliability(calibration: dict, path: Path) -> None:
    """Observed against predicted acceptance per position, before and after the calibration fold (one panel
    each, one line per position over the non-empty bins, the diagonal is perfect calibration). `calibration`
    is a `trainer/train/calibration.py` record (`CALIBRATION_FILE`)."""
    fig, axes = _figure(2, height=4.6)
    for ax, when in zip(axes, ("before", "after")):
        ax.plot([0, 1], [0, 1], linestyle="--", color="0.6", linewidth=1)
        for k, bins in enumerate(calibration[f"reliability_{when}"]):
            filled = [b for b in bins if b["count"]]
            if filled:
                ax.plot([b["mean_predicted"] for b in filled], [b["mean_observed"] for b in filled], marker="o",
                        markersize=4, linewidth=1.2, label=f"pos_{k}")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("predicted acceptance, sigmoid(confidence)")
        ax.set_ylabel("observed acceptance (confidence target)")
        ax.set_title(f"{when} calibration (ECE {calibration[f'ece_{when}']:.3f})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="position", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})
