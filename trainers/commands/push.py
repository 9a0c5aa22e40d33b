"""``retr-train push``: a run (exported first) or an export uploaded to the Hugging Face Hub
(:mod:`retr.trainers.runs.hub`)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import click

from retr.common.cli import quiet_option
from retr.trainers.commands.options import RUN
from retr.common.downloads import is_offline
from retr.common.errors import UserError
from retr.trainers.reporting.export import export_run
from retr.trainers.runs.checkpoint import is_export, read_config
from retr.trainers.runs.hub import HUB_PREFIX, hub_token, parse_hub_name, push_export


@click.command("push")
@click.argument("run", type=RUN)
@click.option("--repo", required=True, help="The Hub model repository, ORG/NAME (created if absent).")
@click.option("--private", is_flag=True, help="Create the repository private.")
@click.option("--checkpoint", default="best", show_default=True, help="A run's checkpoint to export: best, last, …")
@click.option("--trust-checkpoint", is_flag=True,
              help="Read a checkpoint that holds Python objects besides tensors (only for files you trust).")
@quiet_option
def push_command(run, repo, private, checkpoint, trust_checkpoint, quiet) -> None:
    """Upload a trained model to the Hugging Face Hub, so that anyone can load it as hf-hub:ORG/NAME: a run is
    exported first (retr-train export), an export goes as it is. Needs a token with write access (HF_TOKEN or
    `hf auth login`) and the hub extra.

    \b
    Example:
      retr-train push runs/scan-f30k --repo my-lab/scan-f30k
      retr-train eval hf-hub:my-lab/scan-f30k --features data/f30k/features/butd-regions.h5 \\
          --manifest data/f30k/manifest.jsonl --protocol f30k-1k
    """
    parse_hub_name(HUB_PREFIX + repo)
    if is_offline():
        raise UserError(f"pushing to {repo} needs the network (RETR_OFFLINE is set)")
    read_config(run)                                    # a run or an export, before the token is asked for
    token = hub_token()
    if is_export(run):
        url = push_export(run, repo, private, token)
    else:
        with tempfile.TemporaryDirectory(prefix="retr-push-") as tmp:
            folder = export_run(run, Path(tmp) / "export", checkpoint, trust_checkpoint)
            url = push_export(folder, repo, private, token)
    click.echo(f"pushed {run} to {url} (load it as {HUB_PREFIX}{repo})")
