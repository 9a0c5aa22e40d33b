"""What several ``retr-train`` commands take alike: a run (or an export, or ``hf-hub:ORG/NAME``) checked when the
command line is parsed, and the switch that skips checking a feature set's rows against their checksums."""
from __future__ import annotations

import click

from retr.common.cli import InputPath
from retr.trainers.runs.hub import is_hub_name
from retr.trainers.runs.layout import CONFIG

#: a trained run's folder (or an export's), or an export on the Hugging Face Hub named hf-hub:ORG/NAME[@REV]
RUN = InputPath("folder", "a run folder or an export", takes=is_hub_name, holds=CONFIG)

#: ``--no-verify``: the feature set's rows are not compared with their checksums before the work
no_verify_option = click.option(
    "--no-verify", is_flag=True,
    help="Do not compare the feature set's rows with the checksums stored when they were written (done once per "
         "state of its files and remembered, see `retr-pipeline verify`).")

#: a feature set a command reads (``--features``)
FEATURES = InputPath("file", "a feature-set .h5 file")
#: a manifest a command reads (``--manifest``)
MANIFEST = InputPath("file", "a JSON Lines manifest")
#: the folder a manifest's image paths are relative to (``--image-root``)
IMAGE_ROOT = InputPath("folder", "the folder the manifest's image paths are relative to")
