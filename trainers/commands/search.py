"""``retr-train search``: the command over :class:`retr.trainers.search.retrieval.Retriever`."""
from __future__ import annotations

import json

import click

from retr.common.cli import InputPath, quiet_option
from retr.trainers.commands.options import FEATURES, MANIFEST, RUN
from retr.common.errors import UserError
from retr.common.devices import exact_float32
from retr.trainers.search.retrieval import Retriever, query_error


@click.command("search")
@click.argument("run", type=RUN)
@click.option("--query", "queries", multiple=True, help="A sentence: find the images it describes (repeatable).")
@click.option("--image", "images", multiple=True,
              help="An image id of the split or index, an image file or a folder: find its captions (repeatable).")
@click.option("--top", default=10, show_default=True, help="Results per query.")
@click.option("--split", default="test", show_default=True, help="The gallery: this split of the run's data.")
@click.option("--index", type=InputPath("folder", "a gallery index folder"),
              help="Search images in this gallery index (retr-train index) instead of the split.")
@click.option("--images", "gallery", type=InputPath("folder", "a folder of images"),
              help="Search images in this folder (indexed into RUN/search-cache/ once, grown on later runs).")
@click.option("--extractor-weights", type=InputPath("file", "a weights file"),
              help="The extractor's weights file, where the feature set records one by hash (image files).")
@click.option("--vector-index", type=click.Choice(["exact", "ivf", "hnsw"]), default="exact", show_default=True,
              help="The image gallery's inner-product index (ivf/hnsw: approximate, faiss): models scored by one, "
                   "or stage one of --shortlist; refused for others. ivf needs 39 images per list.")
@click.option("--shortlist", type=click.IntRange(min=1), default=None,
              help="Two-stage search for models whose score is no inner product (SCAN, SEAM): score only the N "
                   "best items by cheap vectors (docs/search.md has each model's recall); at least --top are "
                   "scored. Default: every item.")
@click.option("--features", type=FEATURES, help="Override the run's feature set.")
@click.option("--manifest", type=MANIFEST, help="Override the run's manifest.")
@click.option("--checkpoint", default="best", show_default=True, help="best, last, or a file in the run.")
@click.option("--device", default="auto", show_default=True)
@click.option("--no-cache", is_flag=True, help="Encode the gallery anew instead of using RUN/search-cache/.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per query.")
@click.option("--trust-checkpoint", is_flag=True,
              help="Read a checkpoint that holds Python objects besides tensors (only for files you trust).")
@quiet_option
def search_command(run, queries, images, top, split, index, gallery, extractor_weights, vector_index, shortlist,
                   features, manifest, checkpoint, device, no_cache, as_json, trust_checkpoint, quiet):
    """Search the split's gallery with a trained run: a sentence → images, an image → captions.

    The gallery (the split's images, an index's, or a folder's) is encoded once and kept; the scores are the
    ones `eval` gives the same pairs. An image file is embedded with the extractor settings its feature set
    records. Words outside the run's vocabulary are reported.

    \b
    Example:
      retr-train search runs/scan-f30k --query "a dog jumps into a lake" --top 5
      retr-train search runs/scan-f30k --image 1000092795 --image photos/dog.jpg --json
      retr-train search runs/scan-f30k --images photos/ --query "a dog on a beach"
    """
    if not queries and not images:
        raise UserError("give --query TEXT or --image ID (or several)")
    if top < 1:
        raise UserError(f"--top must be ≥ 1, not {top}")
    if index and gallery:
        raise UserError("give --index or --images, not both")
    for text in queries:
        if query_error(text) is not None:
            raise UserError(f"--query {text!r} has no words: give a sentence describing the images you want")
    if any(not image.strip() for image in images):
        raise UserError("--image is empty: give an image id, an image file or a folder of images")
    with exact_float32():                    # eval's scores, on a GPU too (docs/search.md)
        retriever = Retriever.from_run(run, features, manifest, split, checkpoint, device, cache=not no_cache,
                                       trust_checkpoint=trust_checkpoint, quiet=quiet, index=index, images=gallery,
                                       extractor_weights=extractor_weights, vector_index=vector_index,
                                       shortlist=shortlist)
        results = retriever.text_to_images(queries, top) + retriever.image_to_texts(images, top)
    for result in results:
        if as_json:
            click.echo(json.dumps(result.to_json()))
            continue
        click.echo(f"{result.query}")
        if result.unknown_words:
            click.echo(f"  note: not in the run's vocabulary (read as <unk>): {', '.join(result.unknown_words)}")
        for hit in result.hits:
            what = f"{hit.image_id}  {hit.caption}" if hit.caption is not None else hit.image_id
            click.echo(f"  {hit.rank:>3}  {hit.score:+.6f}  {what}")
