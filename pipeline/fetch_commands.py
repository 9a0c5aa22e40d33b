"""``retr-pipeline fetch-weights`` and ``fetch-data``: everything retr downloads, fetched ahead of time.

Weights are named by what they are (``resnet152``, ``vgg16``, ``vgg19``, ``inception_resnet_v2``, ``butd``,
``stanza``) or by the extractor that needs them (``resnet152-grid``, ``tencrop-vgg19``, …); ``all`` (the default)
is every one. Each lands where the code that loads it looks first — torchvision's cache, the Hugging Face cache,
retr's weights folder, stanza's resource folder — so a login node can fill the caches that GPU nodes read
offline. :func:`ensure_weights` is the same step for ``extract-preset``: offline, everything missing is named in
one line with the command that fetches it; online, it is downloaded before the first extractor runs.

Sources, sizes and checksums: :data:`retr.common.downloads.SOURCES`. Data: :mod:`retr.manifests.fetch`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import click

from retr.common.cli import quiet_option
from retr.common.downloads import SOURCES, format_bytes, is_offline, set_mirror, set_offline
from retr.common.errors import MissingResourceError, ParameterError


# ------------------------------------------------------------------------------------------------ weights

@dataclass(frozen=True)
class WeightsItem:
    """One set of weights: where it is cached (``locate`` → path or None), how to fetch it, where it is looked for."""

    name: str
    source: str                                   # key of SOURCES
    locate: Callable[[], Path | None]
    fetch: Callable[[bool, str | None], Path]     # (quiet, mirror) → path
    looked_in: Callable[[], str]

    @property
    def what(self) -> str:
        return SOURCES[self.source].what


def _torchvision(arch: str) -> WeightsItem:
    def cached() -> Path:
        from retr.extractors.weights import hub_checkpoint_path, imagenet_weights
        return hub_checkpoint_path(imagenet_weights(arch, "imagenet").url)

    def fetch(quiet: bool, mirror: str | None) -> Path:
        from retr.extractors.weights import fetch_imagenet_weights
        return fetch_imagenet_weights(arch, "imagenet", quiet=quiet, mirror=mirror)

    return WeightsItem(arch, arch, lambda: cached() if cached().is_file() else None, fetch,
                       lambda: str(cached().parent))


def _timm(arch: str) -> WeightsItem:
    def locate() -> Path | None:
        from retr.extractors.timm_weights import TIMM_DEFAULT_TAG, _pretrained_cfg, cached_hub_file
        return cached_hub_file(_pretrained_cfg(arch, TIMM_DEFAULT_TAG).hf_hub_id)

    def fetch(quiet: bool, mirror: str | None) -> Path:
        from retr.extractors.timm_weights import fetch_timm_weights
        return fetch_timm_weights(arch, quiet=quiet)

    def looked_in() -> str:
        from retr.extractors.timm_weights import hf_hub_cache
        return str(hf_hub_cache())

    return WeightsItem(arch, arch, locate, fetch, looked_in)


def _butd() -> WeightsItem:
    def locate() -> Path | None:
        from retr.extractors.butd.extractor import find_default_checkpoint
        return find_default_checkpoint()

    def fetch(quiet: bool, mirror: str | None) -> Path:
        from retr.extractors.butd.checkpoint import fetch_checkpoint
        from retr.extractors.butd.extractor import default_checkpoint_path, find_default_checkpoint
        return find_default_checkpoint() or fetch_checkpoint(default_checkpoint_path(), quiet=quiet, mirror=mirror)

    def looked_in() -> str:
        from retr.extractors.butd.extractor import default_checkpoint_candidates
        return ", ".join(str(c) for c in default_checkpoint_candidates())

    return WeightsItem("butd", "butd", locate, fetch, looked_in)


def _stanza(model_dir: Path | None) -> WeightsItem:
    def folder() -> tuple[Path, str]:
        from retr.parsers.backends import stanza_model_dir
        return stanza_model_dir(model_dir)

    def locate() -> Path | None:
        from retr.parsers.backends import STANZA_LANGUAGE
        path, _ = folder()
        return path if (path / "resources.json").is_file() and (path / STANZA_LANGUAGE).is_dir() else None

    def fetch(quiet: bool, mirror: str | None) -> Path:
        from retr.parsers.backends import fetch_parser_models, missing_models_error
        path, source = folder()
        if is_offline():
            raise missing_models_error(path, source)
        return fetch_parser_models(path)

    return WeightsItem("stanza", "stanza", locate, fetch, lambda: str(folder()[0]))


#: extractor name → the weights its default ``--weights`` needs
EXTRACTOR_WEIGHTS = {"resnet152-grid": "resnet152", "tencrop-resnet152": "resnet152", "vgg16-maps": "vgg16",
                     "tencrop-vgg19": "vgg19", "tencrop-irv2": "inception_resnet_v2", "butd-regions": "butd"}
WEIGHTS_NAMES = ("resnet152", "vgg16", "vgg19", "inception_resnet_v2", "butd", "stanza")


def weights_items(names: Iterable[str], stanza_dir: Path | None = None) -> list[WeightsItem]:
    """The items named (weights names, extractor names or ``all``), each once, in :data:`WEIGHTS_NAMES` order."""
    wanted: set[str] = set()
    for name in names:
        if name == "all":
            wanted.update(WEIGHTS_NAMES)
        elif name in WEIGHTS_NAMES:
            wanted.add(name)
        elif name in EXTRACTOR_WEIGHTS:
            wanted.add(EXTRACTOR_WEIGHTS[name])
        else:
            raise ParameterError(f"unknown weights {name!r} (expected all, {', '.join(WEIGHTS_NAMES)}, or an "
                                 f"extractor name: {', '.join(EXTRACTOR_WEIGHTS)})", "names")
    build = {"resnet152": lambda: _torchvision("resnet152"), "vgg16": lambda: _torchvision("vgg16"),
             "vgg19": lambda: _torchvision("vgg19"), "inception_resnet_v2": lambda: _timm("inception_resnet_v2"),
             "butd": _butd, "stanza": lambda: _stanza(stanza_dir)}
    return [build[name]() for name in WEIGHTS_NAMES if name in wanted]


def ensure_weights(items: list[WeightsItem], quiet: bool = False, mirror: str | None = None,
                   echo: Callable[[str], None] = lambda line: None) -> list[tuple[WeightsItem, Path, bool]]:
    """``(item, path, downloaded now)`` for every item, fetching the missing ones. Offline with anything missing:
    ONE :class:`MissingResourceError` naming all of it and ``retr-pipeline fetch-weights NAME…``."""
    found = [(item, item.locate()) for item in items]
    missing = [item for item, path in found if path is None]
    if missing and is_offline():
        places = list(dict.fromkeys(place for item in missing for place in item.looked_in().split(", ")))
        raise MissingResourceError(
            "weights " + ", ".join(item.name for item in missing), places,
            f"run retr-pipeline fetch-weights {' '.join(item.name for item in missing)} on a connected machine and "
            f"copy what it downloads to those folders (RETR_OFFLINE is set, so retr does not download here)")
    out = []
    for item, path in found:
        if path is None:
            echo(f"{item.name}: downloading {item.what} (about "
                 f"{format_bytes(SOURCES[item.source].download_bytes)})")
            path = item.fetch(quiet, mirror)
            out.append((item, path, True))
        else:
            out.append((item, path, False))
    return out


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


@click.command("fetch-weights")
@click.argument("names", nargs=-1)
@click.option("--stanza-dir", type=click.Path(path_type=Path), default=None,
              help="Where stanza's models go (default $STANZA_RESOURCES_DIR, else stanza's own folder).")
@network_options
@quiet_option
def fetch_weights_command(names: tuple[str, ...], stanza_dir: Path | None, offline: bool, mirror: str | None,
                          quiet: bool) -> None:
    """Download the weights extraction and parsing need, ahead of time (e.g. on a login node).

    NAMES: all (default), resnet152, vgg16, vgg19, inception_resnet_v2, butd (bottom-up-attention R101-k36),
    stanza, or extractor names (resnet152-grid, tencrop-irv2, butd-regions, …). Each goes where its loader
    looks first: torchvision's cache ($TORCH_HOME/hub/checkpoints), the Hugging Face cache, $RETR_WEIGHTS (else
    ~/.cache/retr/weights), stanza's folder. Files already there are left alone. With --offline nothing is
    downloaded: the command checks, and names what is missing in one line.

    \b
    Example:
      retr-pipeline fetch-weights all
      retr-pipeline fetch-weights butd resnet152 --mirror http://mirror.example.org/retr
      retr-pipeline fetch-weights --offline      # exit 0 only when everything is in place
    """
    if stanza_dir is not None and stanza_dir.exists() and not stanza_dir.is_dir():
        raise ParameterError(f"stanza_dir {stanza_dir} is a file, not a folder", "stanza_dir")
    apply_network_options(offline, mirror)
    items = weights_items(names or ("all",), stanza_dir)
    for item, path, downloaded in ensure_weights(items, quiet=quiet, mirror=mirror,
                                                 echo=lambda line: None if quiet else click.echo(line, err=True)):
        click.echo(f"{item.name}: {path}" + (" (downloaded)" if downloaded else " (already there)"))


# ------------------------------------------------------------------------------------------------ data

@click.command("fetch-data")
@click.argument("dataset", type=click.Choice(["coco", "f30k"]))
@click.option("--root", type=click.Path(path_type=Path), default=None,
              help="Dataset folder: ROOT/images, ROOT/dataset_*.json, ROOT/manifest.jsonl, ROOT/downloads. "
                   "Default: the preset's locations ($RETR_DATA/DATASET, RETR_<NAME>_* overrides).")
@click.option("--images-zip", "images_archive", type=click.Path(path_type=Path), default=None,
              help="f30k: the images archive you were sent (.zip, .tar or .tar.gz); Flickr30K's images are gated.")
@click.option("--keep-archives", is_flag=True,
              help="Keep the image archives after unpacking (default: delete each once its images are in place).")
@network_options
@quiet_option
def fetch_data_command(dataset: str, root: Path | None, images_archive: Path | None, keep_archives: bool,
                       offline: bool, mirror: str | None, quiet: bool) -> None:
    """Download a dataset's images and Karpathy's splits, unpack them, and write the manifest.

    coco: COCO 2014 train+val images (20.2 GB of zips; about 34 GB of free disk at the peak, 41 GB with
    --keep-archives) and Karpathy's splits (36.7 MB). f30k: the images archive you were sent (--images-zip;
    request it at https://shannon.cs.illinois.edu/DenotationGraph/) and the splits. Transfers resume where they
    stopped (run the command again); sizes and published sha256s are checked, every archive member's CRC-32
    when unpacking; a failed check removes the file and says so. Then the manifest is built from the split
    file, as `retr-pipeline manifest karpathy` does, and `make extract DATASET=coco` can run.

    \b
    Example:
      retr-pipeline fetch-data coco --root data/coco
      retr-pipeline fetch-data f30k --root data/f30k --images-zip ~/flickr30k-images.tar.gz
    """
    from retr.manifests.fetch import fetch_dataset

    apply_network_options(offline, mirror)
    summary = fetch_dataset(dataset, root, images_archive=images_archive, mirror=mirror,
                            keep_archives=keep_archives, quiet=quiet,
                            echo=lambda line: None if quiet else click.echo(line, err=True))
    click.echo(summary.line())
