"""``retr-train``: fit a matching model from cached features, evaluate runs.

Each model and tool registers its command here; ``retr-train COMMAND --help`` shows an example of each.
"""
from __future__ import annotations

import click

from retr.common.cli import run
from retr.common.version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="retr-train")
def cli() -> None:
    """retr's trainer: fit image–text matching models from cached tensors and evaluate them.

    \b
    Example:
      retr-train scan --features data/f30k/features/butd-regions.h5 --manifest data/f30k/manifest.jsonl \\
          --preset f30k --out runs/scan-f30k
      retr-train eval runs/scan-f30k --protocol f30k-1k
    """


def _register() -> None:
    # One line per command module, as they land.
    from retr.trainers.commands import scan_command, vsepp_command
    from retr.trainers.eval_commands import eval_command, table_command
    from retr.trainers.scan_import import import_scan_command
    from retr.trainers.seam_sman_commands import seam_command, sman_command
    from retr.trainers.smfea_inputs import smfea_command
    from retr.trainers.jgcar_command import jgcar_command

    commands: list[click.Command] = [scan_command, vsepp_command, eval_command, table_command, import_scan_command,
                                     sman_command, seam_command, smfea_command, jgcar_command]
    for command in commands:
        cli.add_command(command)


_register()


def main() -> None:
    """Console-script entry point."""
    run(cli)
