"""``retr-pipeline``: the group and its entry point; one thin module per command or group (docs/DESIGN.md, "Layout")."""
from __future__ import annotations

import click

from retr.common.cli import flags_in_errors, log_to_stderr, run
from retr.common.version import __version__
# one line per command module, alphabetical by module
from retr.pipeline.commands.concepts import build_concepts_command
from retr.pipeline.commands.extract import extract_command, extract_preset_command
from retr.pipeline.commands.fetch import (fetch_data_command, fetch_parser_models_command, fetch_weights_command,
                                          fetch_word_vectors_command)
from retr.pipeline.commands.imports import import_npz_command, import_scan_command, import_tsv_command
from retr.pipeline.commands.labels import labels_group
from retr.pipeline.commands.manifest import manifest_group
from retr.pipeline.commands.parse_trees import parse_trees_command, show_tree_command
from retr.pipeline.commands.store import index_command, inspect_command, verify_command
from retr.pipeline.commands.synth import synth_command


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="retr-pipeline")
def cli() -> None:
    """retr's offline pipeline: manifests, label files, feature extraction, referral trees, feature-set checks.

    \b
    Example:
      retr-pipeline synth --out data/synthetic --images 240
      retr-pipeline inspect data/synthetic/features/resnet152-grid.h5
    """
    log_to_stderr()


def _register() -> None:
    for command in (manifest_group, labels_group, synth_command, verify_command, inspect_command,
                    index_command, parse_trees_command, show_tree_command, fetch_parser_models_command,
                    extract_command, extract_preset_command, build_concepts_command,
                    import_scan_command, import_tsv_command, import_npz_command, fetch_weights_command,
                    fetch_data_command, fetch_word_vectors_command):
        cli.add_command(command)
    flags_in_errors(cli)  # library errors name parameters; print them with these commands' flags


_register()


def main() -> None:
    """Console-script entry point."""
    run(cli)
