"""``retr-train show``: a static HTML report of a run or an ensemble (:mod:`retr.trainers.reporting.report`)."""
from __future__ import annotations

import click

from retr.common.cli import InputPath, OutputPath, quiet_option
from retr.trainers.commands.options import FEATURES, IMAGE_ROOT, MANIFEST, RUN, no_verify_option
from retr.trainers.evaluation.metrics import PROTOCOLS
from retr.trainers.reporting.report import write_report
from retr.common.paths import check_folder_holds_only
from retr.trainers.runs.hub import local_run
from retr.trainers.training.preflight import check_run_features


@click.command("show")
@click.argument("runs", nargs=-1, required=True, type=RUN)
@click.option("--protocol", type=click.Choice(PROTOCOLS), required=True, help="The protocol ranks and numbers follow.")
@click.option("--out", default="report", show_default=True, type=OutputPath("folder"),
              help="Folder to write index.html and assets/ into.")
@click.option("--split", default="test", show_default=True)
@click.option("--samples", default=5, show_default=True, type=int,
              help="Queries drawn per direction, and as many worst queries.")
@click.option("--top", default=5, show_default=True, type=int, help="Retrieved items shown per query.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the sampled queries.")
@click.option("--attention", default=2, show_default=True, type=int,
              help="Sampled text→image queries whose attention maps are drawn (per model).")
@click.option("--image-root", type=IMAGE_ROOT, default=None,
              help="Folder the manifest's image paths are relative to (default: the manifest's folder).")
@click.option("--features", type=FEATURES, default=None, help="Override the run's feature set.")
@click.option("--manifest", type=MANIFEST, default=None, help="Override the run's manifest.")
@click.option("--sims", type=InputPath("file", "a .npy similarity matrix"), default=None,
              help="Rank this matrix from `retr-train eval --save-sims` instead of evaluating again.")
@click.option("--checkpoint", "which", default="best", show_default=True, help="best, last, or a file in the run.")
@click.option("--device", default="auto", show_default=True)
@click.option("--allow-size-mismatch", is_flag=True,
              help="Accept a split whose size is not the protocol's (e.g. the synthetic data); said in the report.")
@click.option("--extended", is_flag=True,
              help="COCO protocols: also the ECCV Caption and CxC numbers of the matrix (as eval --extended).")
@click.option("--trust-checkpoint", is_flag=True,
              help="Read checkpoints that hold Python objects besides tensors (only for files you trust).")
@click.option("--allow-nonempty-out", is_flag=True,
              help="Write the report into a non-empty --out that holds no report (refused otherwise).")
@no_verify_option
@quiet_option
def show_command(runs, protocol, out, split, samples, top, seed, attention, image_root, features, manifest, sims,
                 which, device, allow_size_mismatch, extended, trust_checkpoint, allow_nonempty_out, no_verify,
                 quiet) -> None:
    """Write a static HTML report of a run (or an ensemble): summary and numbers, training curves, sampled and
    worst queries both ways with their top results, and each model's attention maps.

    The folder holds index.html and assets/ (images only, relative links): open it in a browser, no server.

    \b
    Example:
      retr-train show runs/scan-f30k --protocol f30k-1k --image-root data/f30k --out report/scan
      retr-train show runs/scan-t2i runs/scan-i2t --protocol coco-1k --samples 10 --out report/ens
    """
    if not allow_nonempty_out:
        check_folder_holds_only(out, "--out", "a report", lambda folder: (folder / "index.html").is_file())
    if not no_verify:
        check_run_features([str(local_run(run)) for run in runs], features, quiet)
    index = write_report(list(runs), protocol, out, split, samples, top, seed, attention, image_root, features,
                         manifest, which, device, sims=sims, allow_size_mismatch=allow_size_mismatch,
                         trust_checkpoint=trust_checkpoint, quiet=quiet, extended=extended)
    click.echo(f"report written to {index}")
