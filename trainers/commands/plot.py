"""``retr-train plot``: training curves of runs into a PNG (:mod:`retr.trainers.reporting.plot`)."""
from __future__ import annotations

import click

from retr.common.cli import InputPath, OutputPath

from retr.trainers.reporting.plot import plot_runs
from retr.trainers.runs.layout import METRICS


@click.command("plot")
@click.argument("runs", nargs=-1, required=True, type=InputPath("folder", "a training run's folder", holds=METRICS))
@click.option("--out", default="curves.png", show_default=True, type=OutputPath("file"),
              help="The PNG to write.")
def plot_command(runs, out) -> None:
    """Draw the training loss and the validation R@1 and rSum of one or several runs into a PNG (the report's
    curves).

    \b
    Example:
      retr-train plot runs/vsepp-s0 runs/vsepp-s1 --out curves.png
    """
    click.echo(f"curves of {len(runs)} run(s) written to {plot_runs(list(runs), out)}")
