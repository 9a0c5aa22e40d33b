"""``retr-train eval-sims``: score a saved similarity matrix with every protocol (and ``--extended``)."""
from __future__ import annotations

import json

import click

from retr.common.cli import InputPath
from retr.trainers.commands.evaluate import echo_extended, echo_numbers
from retr.trainers.commands.options import MANIFEST
from retr.trainers.evaluation.metrics import PROTOCOLS, TIE_RULES
from retr.trainers.evaluation.saved_sims import choose_protocols, evaluate_saved, read_saved_sims


@click.command("eval-sims")
@click.argument("sims", metavar="FILE.npy", type=InputPath("file", "a saved similarity matrix (.npy file)"))
@click.option("--ids", type=InputPath("file", "an ids file (.json)"), default=None,
              help="The ids of the rows and columns (default FILE.npy.ids.json, as eval --save-sims writes it).")
@click.option("--manifest", type=MANIFEST, default=None,
              help="Take the columns' COCO caption ids from this manifest; without an ids file, the rows and columns "
                   "are its --split in file order.")
@click.option("--split", default="test", show_default=True)
@click.option("--protocol", "protocols", multiple=True, type=click.Choice(PROTOCOLS),
              help="Score with these protocols (repeatable). Default: every protocol whose size the matrix has.")
@click.option("--extended", is_flag=True,
              help="Also ECCV Caption (mAP@R, R-Precision, R@1), CxC (R@1/5/10) and COCO 5K/1K as eccv_caption "
                   "computes them (a COCO 5K test matrix; the eccv extra; docs/evaluation.md).")
@click.option("--ties", type=click.Choice(TIE_RULES), default="pessimistic", show_default=True,
              help="pessimistic: a tie counts against the query; official: np.argsort's order, as the authors' code.")
@click.option("--allow-size-mismatch", is_flag=True,
              help="Score with --protocol a matrix whose size is not the protocol's.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with every number.")
def eval_sims_command(sims, ids, manifest, split, protocols, extended, ties, allow_size_mismatch, as_json) -> None:
    """Score a saved images × captions similarity matrix: every protocol its size fits, and with --extended the
    ECCV Caption and CxC numbers. Nothing is written.

    FILE.npy is what retr-train eval --save-sims writes (float .npy, rows images, columns captions) with
    FILE.npy.ids.json beside it; a matrix saved by another code base needs an ids file (image_ids, caption_keys
    "<image id>#<n>", caption_ids) or --manifest (rows and columns in its split's order).

    \b
    Example:
      retr-train eval-sims runs/scan-coco/sims.npy --extended
      retr-train eval-sims sims.npy --extended --manifest data/coco/manifest.jsonl   # ids from the manifest
    """
    saved = read_saved_sims(sims, ids, manifest, split)
    chosen = choose_protocols(saved, protocols, allow_size_mismatch)
    out = evaluate_saved(saved, chosen, ties, allow_size_mismatch, extended)
    if as_json:
        click.echo(json.dumps(out))
        return
    for result in out["results"]:
        echo_numbers({**result, "split": f"{saved.path} (ids: {saved.ids_source})"}, "saved matrix")
    if "extended" in out:
        echo_extended(out["extended"], out["extended_annotations"], ties)
