"""The figures of ``hpf train --plot``: the loss curve and the per-step time breakdown.

matplotlib is an optional extra, imported only inside these functions; Figure (not pyplot)
needs no GUI backend, so they are safe in any process.
"""
from __future__ import annotations

import statistics
from pathlib import Path

__all__ = ["breakdown", "comm_share", "loss_figure", "breakdown_figure", "save_plots", "missing_matplotlib"]

MAX_LABELLED_CUTS = 3  # clipped bars labelled with their value; more are counted in the title


def breakdown(r: dict) -> tuple[float, float, float]:
    """(compute, exposed communication, optimizer) seconds of one step."""
    return r["step_s"] - r["comm_wait_s"] - r["optimizer_s"], r["comm_wait_s"], r["optimizer_s"]


def comm_share(records: list[dict]) -> float:
    """Waiting on communication, hpf's one definition (the progress line, the summary, the docs):
    exposed communication, the seconds the compute thread waits on collectives (``comm_wait_s``),
    as a share of the step time, both the median over ``records`` (one step's: its own). A
    compile step is a step, its compile time compute; like any slow step it moves no median."""
    return statistics.median(r["comm_wait_s"] for r in records) / statistics.median(r["step_s"] for r in records)


def loss_figure(records: list[dict], title: str = "training loss"):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.subplots()
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train")
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if evals:  # hpf train --eval-every: the held-out loss on the same axes
        ax.plot(*zip(*evals), marker="o", label="held-out")
        ax.legend()
    ax.set(xlabel="step", ylabel="loss (global mean)", title=title)
    ax.grid(alpha=0.3)
    return fig


def breakdown_figure(records: list[dict]):
    """Stacked compute / exposed comm / optimizer per step. The y-axis stops at twice the median
    step, so warm-up steps do not squash the rest; every step cut there is said in the title and
    the largest are labelled at the top with their full time."""
    from matplotlib.figure import Figure

    steps = [r["step"] for r in records]
    ms = [1e3 * r["step_s"] for r in records]
    cap = 2 * statistics.median(ms)
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.subplots()
    parts = [[1e3 * x for x in series] for series in zip(*map(breakdown, records))]
    ax.stackplot(steps, *parts, labels=["compute", "exposed communication", "optimizer"])
    ax.set_ylim(0, cap)
    cut = sorted((i for i, t in enumerate(ms) if t > cap), key=lambda i: -ms[i])
    title = "step time breakdown (rank 0)"
    if cut:
        title += f"\n{len(cut)} step{'s' if len(cut) > 1 else ''} above {cap:.0f} ms cut off (labelled at the top)"
        for i in cut[:MAX_LABELLED_CUTS]:
            ax.annotate(f"step {steps[i]}: {ms[i]:.0f} ms", xy=(steps[i], cap), xytext=(4, -12),
                        textcoords="offset points", fontsize=8, arrowprops={"arrowstyle": "-|>"})
    ax.set(xlabel="step", ylabel="ms", title=title)
    ax.legend(loc="upper right")
    return fig


def save_plots(records: list[dict], out: Path, title: str = "training loss") -> list[Path]:
    """Write loss.png (titled ``title``) and step_breakdown.png into ``out``; return their paths."""
    paths = [out / "loss.png", out / "step_breakdown.png"]
    for fig, path in zip((loss_figure(records, title), breakdown_figure(records)), paths):
        fig.savefig(path, dpi=120)
    return paths


def missing_matplotlib(option: str) -> str | None:
    """None when matplotlib imports; else the one warning line every ``--plot`` prints before it
    goes on without the plots (they are an extra; the run's results are not)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (f"hpf: warning: {option} skipped: matplotlib is not installed (pip install matplotlib, or "
                "pip install -e '.[plot]'); the rest goes on")
    return None
