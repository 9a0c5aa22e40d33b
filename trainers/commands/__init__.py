"""``retr-train``: fit a matching model from cached features, evaluate runs.

Each model and tool registers its command here; ``retr-train COMMAND --help`` shows an example of each.
"""
from __future__ import annotations

import click

from retr.common.cli import flags_in_errors, log_to_stderr, run
from retr.common.version import __version__
from retr.trainers.commands.eval_clip import eval_clip_command
from retr.trainers.commands.eval_sims import eval_sims_command
from retr.trainers.commands.evaluate import eval_command, table_command
from retr.trainers.commands.export import export_command
from retr.trainers.commands.import_checkpoint import (import_scan_command, import_vse_infinity_command,
                                                      import_vsepp_command)
from retr.trainers.commands.index import index_command
from retr.trainers.commands.plot import plot_command
from retr.trainers.commands.push import push_command
from retr.trainers.commands.reproduce import recipes_command, reproduce_command
from retr.trainers.commands.search import search_command
from retr.trainers.commands.serve import serve_command
from retr.trainers.commands.show import show_command
from retr.trainers.commands.train import training_command
from retr.trainers.models import get_spec, list_models


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
    log_to_stderr()


def _register() -> None:
    """One training command per registered model (generated from its spec), then the tools."""
    for name in list_models():
        cli.add_command(training_command(get_spec(name)))
    for command in (eval_command, eval_clip_command, eval_sims_command, table_command, import_scan_command,
                    import_vsepp_command, import_vse_infinity_command,
                    reproduce_command, recipes_command, search_command, index_command, serve_command, plot_command,
                    show_command, export_command, push_command):
        cli.add_command(command)
    flags_in_errors(cli)  # library errors name parameters; print them with these commands' flags


_register()


def main() -> None:
    """Console-script entry point."""
    run(cli)
