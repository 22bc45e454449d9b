"""`kvpool plan --png`: the sweeps drawn, one panel per swept tier (matplotlib, imported on
use: an image without it still plans)."""

from __future__ import annotations

from pathlib import Path

from kvpool_cli.plan import Sweep, gib


def chart(curves: list[Sweep], path: Path, title: str) -> None:
    """Per swept tier: the hit ratio and each source's share against the size (log scale),
    the infinite-cache bound, the knee."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(8 * len(curves), 5), squeeze=False)
    for ax, curve in zip(axes[0], curves, strict=True):
        points = curve.points
        sizes = [s / (1 << 30) for s, _ in points]
        ax.plot(sizes, [r.hit_ratio for _, r in points], marker="o", color="#1f77b4",
                label="hit ratio (all caches)")
        for src in points[0][1].served:
            share = [r.served.get(src, 0) / (r.prompt_tokens or 1) for _, r in points]
            if any(share):
                label = "vLLM prefix cache" if src == "engine" else f"{src} tier"
                ax.plot(sizes, share, marker=".", linestyle="--", label=label)
        bound = points[0][1].bound
        ax.axhline(bound, color="#444444", linestyle=":",
                   label=f"bound (infinite shared) {bound:.1%}")
        ax.axvline(curve.knee / (1 << 30), color="#d62728", alpha=0.5,
                   label=f"knee: {gib(curve.knee)}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [gib(size) for size, _ in points])
        ax.minorticks_off()
        per = " per engine" if curve.tier in ("cpu", "engine") else ""
        ax.set_xlabel(f"{curve.tier} size{per}")
        ax.set_ylabel("share of prompt tokens")
        ax.set_ylim(0, max(bound, max(r.hit_ratio for _, r in points)) * 1.15 or 1)
        ax.legend(loc="best", fontsize="small")
    fig.suptitle(f"kvpool plan: {title}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
