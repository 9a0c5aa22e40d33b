"""``retr-train plot``: training curves of one or several runs, drawn with matplotlib to a PNG.

Two panels: the per-pair training loss (``loss_mean`` of ``metrics.jsonl``'s step records) against the global
step, and the validation rSum (solid) and mean R@1 (dashed) after each epoch. Runs are overlaid, labelled by
their folder name; collapse events are marked on the loss panel.
"""
from __future__ import annotations

from pathlib import Path

import click

from retr.common.errors import UserError


def plot_runs(runs: list[str], out: str | Path) -> Path:
    """Draw ``runs``' curves into ``out`` (PNG); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from retr.trainers.training.run_log import read_metrics

    fig, (loss_ax, val_ax) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    for run in runs:
        records = read_metrics(run)
        name = Path(run).resolve().name
        steps = [r for r in records if r["type"] == "step"]
        epochs = [r for r in records if r["type"] == "epoch"]
        if not steps and not epochs:
            raise UserError(f"{run}: metrics.jsonl holds no step or epoch records yet")
        # runs written before loss_mean: the per-batch sum is what there is
        key = "loss_mean" if steps and "loss_mean" in steps[0] else "loss"
        line, = loss_ax.plot([r["step"] for r in steps], [r[key] for r in steps], label=name, linewidth=1)
        for event in (r for r in records if r.get("event") == "collapse"):
            loss_ax.axvline(event["step"], color=line.get_color(), linestyle=":", linewidth=1)
        xs = [r["epoch"] for r in epochs]
        val_ax.plot(xs, [r["val"]["rsum"] for r in epochs], marker="o", color=line.get_color(), label=f"{name} rSum")
        r1 = [(r["val"]["i2t"]["r1"] + r["val"]["t2i"]["r1"]) / 2 for r in epochs]
        val_ax.plot(xs, r1, linestyle="--", marker=".", color=line.get_color(), label=f"{name} mean R@1")
    loss_ax.set(xlabel="step", ylabel="training loss per pair", title="training loss")
    val_ax.set(xlabel="epoch", ylabel="validation (%)", title="validation rSum and mean R@1")
    for ax in (loss_ax, val_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out


@click.command("plot")
@click.argument("runs", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option("--out", default="curves.png", show_default=True, type=click.Path(dir_okay=False),
              help="The PNG to write.")
def plot_command(runs, out) -> None:
    """Draw the training loss and the validation rSum / mean R@1 of one or several runs into a PNG.

    \b
    Example:
      retr-train plot runs/vsepp-s0 runs/vsepp-s1 --out curves.png
    """
    click.echo(f"curves of {len(runs)} run(s) written to {plot_runs(list(runs), out)}")
