"""PNG plots of the benchmark results, for benchmarks/README.md."""

from __future__ import annotations

from pathlib import Path

from benchmarks._common import Sample

HERE = Path(__file__).resolve().parent


def overhead_plot(
    results: dict[str, dict[int, Sample]], path: Path = HERE / "overhead.png"
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, by_size in results.items():
        sizes = sorted(by_size)
        medians = [by_size[w].median * 1e3 for w in sizes]
        low = [m - by_size[w].low * 1e3 for m, w in zip(medians, sizes, strict=True)]
        high = [by_size[w].high * 1e3 - m for m, w in zip(medians, sizes, strict=True)]
        ax.errorbar(sizes, medians, yerr=[low, high], marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([2, 4, 8], labels=["2", "4", "8"])
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("per-test overhead, ms (median, min-max)")
    ax.set_title("Trivial multi-rank test: overhead per test")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gather_plot(
    rows: list[tuple[int, Sample, Sample, float, float]], path: Path = HERE / "gather.png"
) -> Path:
    """rows: (MiB per rank, ours time, theirs time, ours peak MiB, theirs peak MiB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r[0] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    left.plot(sizes, [r[1].median for r in rows], marker="o", label="rankwise.gather_bytes")
    left.plot(sizes, [r[2].median for r in rows], marker="o", label="torch gather_object")
    left.set_ylabel("seconds (median)")
    right.plot(sizes, [r[3] for r in rows], marker="o", label="rankwise.gather_bytes")
    right.plot(sizes, [r[4] for r in rows], marker="o", label="torch gather_object")
    right.set_ylabel("peak RSS growth on dst, MiB")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("MiB per rank (4 ranks)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Gathering bytes to one rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
