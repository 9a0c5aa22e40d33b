"""``retr-pipeline fetch-weights``, ``fetch-data``, ``fetch-parser-models`` and ``fetch-word-vectors``: everything
retr downloads, fetched ahead of time.

The weights (what each name means, where each lands): :mod:`retr.pipeline.weights`; the datasets:
:mod:`retr.manifests.fetch`; stanza's models: :func:`retr.parsers.backends.fetch_parser_models`. ``--offline``
and ``--mirror`` (:func:`network_options`) are shared with ``extract`` and ``extract-preset``.
"""
from __future__ import annotations

from pathlib import Path

import click

from retr.common.cli import InputPath, OutputPath, quiet_option
from retr.common.downloads import set_mirror, set_offline
from retr.common.errors import ParameterError
from retr.parsers.backends import fetch_parser_models
from retr.pipeline.weights import ensure_weights, weights_catalog, weights_items
from retr.manifests.fetch import fetch_dataset
from retr.store.word_vectors import GLOVE_SETS, resolve_vectors


# ------------------------------------------------------------------------------------------------ options

def network_options(f):
    """``--offline`` and ``--mirror``, shared by every command that may download."""
    f = click.option("--mirror", default=None, metavar="URL",
                     help="Fetch every file from URL/<file name> instead of its public host (an institutional "
                          "mirror; also RETR_MIRROR).")(f)
    return click.option("--offline", is_flag=True,
                        help="Never use the network (also RETR_OFFLINE=1): a missing file is one error line naming "
                             "the command that fetches it.")(f)


def apply_network_options(offline: bool, mirror: str | None) -> None:
    """Make ``--offline``/``--mirror`` hold for this process and its workers (through the environment)."""
    if offline:
        set_offline()
    set_mirror(mirror)


# ------------------------------------------------------------------------------------------------ weights

class NamesInHelp(click.Command):
    """``fetch-weights``: the ``{names}`` of its help text are the extractors' specs' weights
    (:meth:`retr.pipeline.weights.WeightsCatalog.describe`), filled in only when the help is shown, so that
    starting ``retr-pipeline`` imports no extractor (nor torch)."""

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        template = self.help
        self.help = template.replace("{names}", weights_catalog().describe())
        try:
            super().format_help_text(ctx, formatter)
        finally:
            self.help = template


@click.command("fetch-weights", cls=NamesInHelp)
@click.argument("names", nargs=-1)
@click.option("--stanza-dir", type=OutputPath("folder", path_type=Path), default=None,
              help="Where stanza's models go (default $STANZA_RESOURCES_DIR, else stanza's own folder).")
@network_options
@quiet_option
def fetch_weights_command(names: tuple[str, ...], stanza_dir: Path | None, offline: bool, mirror: str | None,
                          quiet: bool) -> None:
    """Download the weights extraction and parsing need, ahead of time (e.g. on a login node).

    NAMES: {names}. Each goes where its loader looks first: torchvision's cache ($TORCH_HOME/hub/checkpoints), the
    Hugging Face cache, $RETR_WEIGHTS (else ~/.cache/retr/weights), stanza's folder. Files already there are left
    alone. With --offline nothing is downloaded: the command checks, and names what is missing in one line.

    \b
    Example:
      retr-pipeline fetch-weights all
      retr-pipeline fetch-weights butd resnet152 --mirror http://mirror.example.org/retr
      retr-pipeline fetch-weights --offline      # exit 0 only when everything is in place
    """
    apply_network_options(offline, mirror)
    items = weights_items(names or ("all",), stanza_dir)
    for item, path, downloaded in ensure_weights(items, quiet=quiet, mirror=mirror):
        click.echo(f"{item.name}: {path}" + (" (downloaded)" if downloaded else " (already there)"))


# ------------------------------------------------------------------------------------------------ data

@click.command("fetch-data")
@click.argument("dataset", type=click.Choice(["coco", "f30k"]))
@click.option("--root", type=OutputPath("folder", path_type=Path), default=None,
              help="Dataset folder: ROOT/images, ROOT/dataset_*.json, ROOT/manifest.jsonl, ROOT/downloads. "
                   "Default: the preset's locations ($RETR_DATA/DATASET, RETR_<NAME>_* overrides).")
@click.option("--images-zip", "images_archive", default=None,
              type=InputPath("file", "a .zip, .tar or .tar.gz archive", path_type=Path),
              help="f30k: the images archive you were sent (.zip, .tar or .tar.gz); Flickr30K's images are gated.")
@click.option("--keep-archives", is_flag=True,
              help="Keep the image archives after unpacking (default: delete each once its images are in place).")
@network_options
@quiet_option
def fetch_data_command(dataset: str, root: Path | None, images_archive: Path | None, keep_archives: bool,
                       offline: bool, mirror: str | None, quiet: bool) -> None:
    """Download a dataset's images and Karpathy's splits, unpack them, and write the manifest.

    coco: COCO 2014 train+val images (20.2 GB of zips; about 34 GB of free disk at the peak, 41 GB with
    --keep-archives), Karpathy's splits (36.7 MB) and COCO's caption files (from annotations_trainval2014.zip,
    252.9 MB: each caption's COCO caption id, which retr-train eval --extended needs). f30k: the images archive
    you were sent (--images-zip; request it at https://shannon.cs.illinois.edu/DenotationGraph/) and the splits. Transfers resume where they
    stopped (run the command again); sizes and published sha256s are checked, every archive member's CRC-32
    when unpacking; a failed check removes the file and says so. Then the manifest is built from the split
    file, as `retr-pipeline manifest karpathy` does, and `make extract DATASET=coco` can run.

    \b
    Example:
      retr-pipeline fetch-data coco --root data/coco
      retr-pipeline fetch-data f30k --root data/f30k --images-zip ~/flickr30k-images.tar.gz
    """
    apply_network_options(offline, mirror)
    summary = fetch_dataset(dataset, root, images_archive=images_archive, mirror=mirror,
                            keep_archives=keep_archives, quiet=quiet)
    click.echo(summary.line())


# ------------------------------------------------------------------------------------------------ word vectors

@click.command("fetch-word-vectors")
@click.argument("names", nargs=-1)
@network_options
@quiet_option
def fetch_word_vectors_command(names: tuple[str, ...], offline: bool, mirror: str | None, quiet: bool) -> None:
    """Download GloVe word vectors ahead of time (training downloads them on first use).

    NAMES: glove (glove.840B.300d.zip, 2.2 GB: the set SMAN and CVSE used; default), glove-6b (glove.6B.zip,
    862 MB). Each goes to $RETR_WORD_VECTORS (else ~/.cache/retr/word-vectors), size and sha256 checked; it is
    read from the zip, never unpacked. With --offline nothing is downloaded: the command checks, and names what
    is missing in one line.

    \b
    Example:
      retr-pipeline fetch-word-vectors glove
      retr-pipeline fetch-word-vectors glove --mirror http://mirror.example.org/retr
    """
    unknown = [n for n in names if n not in GLOVE_SETS]
    if unknown:
        raise ParameterError(f"unknown word vectors {unknown[0]!r} (known: {', '.join(GLOVE_SETS)})", "names")
    apply_network_options(offline, mirror)
    for name in names or ("glove",):
        click.echo(f"{name}: {resolve_vectors(name, quiet=quiet).path}")


# ------------------------------------------------------------------------------------------------ parser models

@click.command("fetch-parser-models")
@click.argument("model_dir", type=OutputPath("folder"))
@click.option("--no-constituency", "no_constituency", is_flag=True, help="skip the constituency model.")
def fetch_parser_models_command(model_dir, no_constituency):
    """Download stanza's English models into MODEL_DIR (run on a machine with internet access).

    Copy MODEL_DIR to the machine that parses and pass it as --stanza-dir (or set STANZA_RESOURCES_DIR).

    \b
    Example:
      retr-pipeline fetch-parser-models ~/stanza_resources
    """
    folder = fetch_parser_models(model_dir, constituency=not no_constituency)
    click.echo(f"stanza English models are in {folder}; use --stanza-dir {folder}")
