"""``retr-train index``: build or grow a gallery index of new images (:mod:`retr.trainers.search.index`)."""
from __future__ import annotations

from pathlib import Path

import click

from retr.common.cli import InputPath, OutputPath, quiet_option
from retr.trainers.commands.options import FEATURES, IMAGE_ROOT, MANIFEST, RUN
from retr.common.errors import UserError
from retr.manifests.schema import outside_root_reason, read_manifest
from retr.trainers.runs.hub import local_run
from retr.trainers.search.images import list_folder, no_images_error
from retr.trainers.search.index import GalleryIndex
from retr.trainers.search.retrieval import Retriever, run_index_identity


@click.command("index")
@click.argument("run", type=RUN)
@click.option("--images", type=InputPath("folder", "a folder of images"),
              help="A folder of images (searched recursively); "
              "an image's id is its path inside the folder.")
@click.option("--manifest", type=MANIFEST, help="A manifest of images instead (ids as listed).")
@click.option("--image-root", type=IMAGE_ROOT,
              help="Folder the manifest's paths are relative to (default: the manifest's folder).")
@click.option("--out", required=True, type=OutputPath("folder"), help="The index folder (made or grown).")
@click.option("--checkpoint", default="best", show_default=True, help="best, last, or a file in the run.")
@click.option("--features", type=FEATURES,
              help="The run's feature set, if moved (its attributes say how images are embedded).")
@click.option("--extractor-weights", type=InputPath("file", "a weights file"),
              help="The extractor's weights file, where the feature set records one by hash.")
@click.option("--shard-size", default=256, show_default=True, help="Images per index shard (the unit of resume).")
@click.option("--batch-size", default=8, show_default=True, help="Images per network call.")
@click.option("--workers", default=2, show_default=True, help="Image-decoding processes (0: in this one).")
@click.option("--split", default="test", show_default=True, help="The split whose captions image queries search.")
@click.option("--device", default="auto", show_default=True)
@click.option("--trust-checkpoint", is_flag=True,
              help="Read a checkpoint that holds Python objects besides tensors (only for files you trust).")
@quiet_option
def index_command(run, images, manifest, image_root, out, checkpoint, features, extractor_weights, shard_size,
                  batch_size, workers, split, device, trust_checkpoint, quiet):
    """Embed a folder (or manifest) of images with a trained run into a gallery index, once; a re-run adds only
    the images not in it yet. Unusable images are recorded and skipped, files that are not images skipped; each
    kind is counted. An index left with no usable image is an error.

    \b
    Example:
      retr-train index runs/scan-f30k --images photos/ --out photos.index
      retr-train search runs/scan-f30k --index photos.index --query "a dog on a beach"
    """
    if (images is None) == (manifest is None):
        raise UserError("give one of --images DIR or --manifest FILE")
    if image_root and not manifest:
        raise UserError("--image-root goes with --manifest")
    if batch_size < 1 or workers < 0 or shard_size < 1:
        raise UserError("--batch-size and --shard-size must be ≥ 1, --workers ≥ 0")
    not_images: list[str] = []
    if images is not None:
        listing = list_folder(images)
        if not listing.images:
            raise no_images_error(images, listing)
        items, not_images = listing.images, listing.others
    else:
        records = read_manifest(manifest)
        root = Path(image_root) if image_root else Path(manifest).resolve().parent
        outside = [r.id for r in records if outside_root_reason(r.path)]
        if outside:
            raise UserError(f"image {outside[0]!r} of {manifest} leaves the image root {root}; index images under it")
        items = [(r.id, root / r.path) for r in records]
        if not items:
            raise UserError(f"{manifest} lists no images to index")
    run = str(local_run(run))                   # an hf-hub: name: its snapshot (fetched on first use)
    identity = run_index_identity(run, checkpoint, features)     # refused before anything is loaded or written
    if identity is not None:
        GalleryIndex(out).check_can_add(identity)
    retriever = Retriever.from_run(run, features, split=split, checkpoint=checkpoint, device=device,
                                   trust_checkpoint=trust_checkpoint, quiet=quiet,
                                   extractor_weights=extractor_weights, batch_size=batch_size, workers=workers)
    summary = retriever.add_to_index(out, items, shard_size=shard_size, quiet=quiet, not_images=not_images)
    click.echo(summary.line(Path(out)))
    for line in summary.details():
        click.echo(f"  {line}")
