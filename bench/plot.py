"""The PNG: aggregate and per-stream decode tok/s against width, one line per server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot(results: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for name, peer in results["peers"].items():
        if "decode" not in peer:
            continue
        widths = [row["width"] for row in peer["decode"]]
        for ax, key in zip(axes, ("aggregate_tok_s", "per_stream_decode_tok_s")):
            ax.plot(widths, [row[key] for row in peer["decode"]], marker="o", label=name)
    for ax, title in zip(axes, ("aggregate tok/s", "mean per-stream decode tok/s")):
        ax.set_title(title)
        ax.set_xlabel("concurrent streams (width)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(results["plan"]["widths"], [str(w) for w in results["plan"]["widths"]])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend()
    m = results["machine"]
    fig.suptitle(f"{results['model']} | {m['cpu']}, {m['cores']} cores | {results['created']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
