"""The per-position acceptance plot an export ships next to its model card (the card embeds it by `PLOT_FILE`)."""

from __future__ import annotations

from pathlib import Path

from trainer.results import AcceptanceResults

PLOT_FILE = "acceptance_per_position.png"


def plot_acceptance(results: list[AcceptanceResults], path: Path) -> None:
    """pos_k against k, one line per subset, one panel per results file. Uses matplotlib's object API (no
    pyplot), so no GUI backend or global state is involved; the canvas is Agg."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4 * len(results), 4.2), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(results), squeeze=False)[0]
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
