"""``retr-train export``: a trained run as a self-contained model folder (:mod:`retr.trainers.reporting.export`)."""
from __future__ import annotations

import click

from retr.common.cli import OutputPath, quiet_option
from retr.trainers.commands.options import RUN
from retr.trainers.reporting.export import export_run


@click.command("export")
@click.argument("run", type=RUN)
@click.option("--out", required=True, type=OutputPath("folder"), help="A new (or empty) folder for the export.")
@click.option("--checkpoint", default="best", show_default=True, help="best, last, or a file in the run.")
@click.option("--trust-checkpoint", is_flag=True,
              help="Read a checkpoint that holds Python objects besides tensors (only for files you trust).")
@quiet_option
def export_command(run, out, checkpoint, trust_checkpoint, quiet) -> None:
    """Export a trained run as a pickle-free model folder to share: model.safetensors, config.json (the model,
    its settings, the features it expects), vocab.json and a README.md model card (the Hugging Face Hub's
    format: the run's evaluation table, the features it needs, how to load it). Every command that takes a run
    takes the folder (give --features and --manifest), and retr.load_model(FOLDER) loads it.

    \b
    Example:
      retr-train export runs/scan-f30k --out exports/scan-f30k
      retr-train eval exports/scan-f30k --features data/f30k/features/butd-regions.h5 \\
          --manifest data/f30k/manifest.jsonl --protocol f30k-1k
    """
    folder = export_run(run, out, checkpoint, trust_checkpoint)
    click.echo(f"exported {run} to {folder}: model.safetensors, config.json, vocab.json, README.md")
