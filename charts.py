"""Charts the library draws itself (the demo's), and the matplotlib set-up benchmarks/charts.py shares.

matplotlib is optional (the `dev` and `bench` extras install it): without it `pyplot()` is None and nothing is
drawn; the caller says so instead of failing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def pyplot() -> Any | None:
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Path, footer: str) -> Path:
    """A footer (what was measured, where), then the PNG at `path`."""
    fig.text(0.01, 0.01, footer, fontsize=6.5, color="#444444", va="bottom", ha="left", wrap=True)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def demo_chart(batches: Sequence[dict[str, Any]], path: Path, footer: str) -> Path | None:
    """Batch seconds (bars) and cache hit rate (line, right axis) per batch of `dbidx demo`, as a PNG at `path`;
    None without matplotlib. Each batch needs `batch`, `seconds`, `hit_rate` and `via` (batch / streaming)."""
    plt = pyplot()
    if plt is None:
        return None
    numbers = [b["batch"] for b in batches]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    colors = ["#8fb3d9" if b["via"] == "batch" else "#e0a458" for b in batches]
    ax.bar(numbers, [b["seconds"] for b in batches], color=colors, label="upsert seconds (orange: via streaming)")
    ax.set_xlabel("batch (0: initial load)")
    ax.set_ylabel("seconds")
    ax.set_xticks(numbers)
    rate = ax.twinx()
    rate.plot(numbers, [100 * b["hit_rate"] for b in batches], color="#2d6a4f", marker="o", label="cache hit rate")
    rate.set_ylabel("cache hit rate, %")
    rate.set_ylim(0, 105)
    handles = ax.get_legend_handles_labels()[0] + rate.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize=8)
    ax.set_title("dbidx demo: time and cache hit rate per batch")
    return save_figure(plt, fig, path, footer)
