"""``retr-train eval`` (single runs and ensembles) and ``retr-train table``."""
from __future__ import annotations

import json
import csv
import io

import click
from tabulate import tabulate

from retr.common.cli import OutputPath, quiet_option
from retr.trainers.commands.options import FEATURES, MANIFEST, RUN, no_verify_option
from retr.common.errors import UserError
from retr.common.paths import write_problem
from retr.trainers.evaluation.metrics import PROTOCOLS, TIE_RULES
from retr.trainers.evaluation.runs import evaluate_runs, has_extended, record_result, table_rows, write_sims
from retr.trainers.evaluation.similarity import DEFAULT_PRECISION, PRECISIONS
from retr.trainers.runs import checkpoint as ckpt
from retr.trainers.runs.hub import local_run
from retr.trainers.runs.layout import EVAL
from retr.trainers.evaluation.coco_extended import METRIC_LABELS, METRIC_NAMES
from retr.trainers.training.preflight import check_run_features


def _line(side: str, m: dict) -> str:
    return (f"{side}: R@1 {m['r1']:.1f}  R@5 {m['r5']:.1f}  R@10 {m['r10']:.1f}  "
            f"medr {m['medr']:.1f}  meanr {m['meanr']:.1f}")


def echo_numbers(result: dict, what: str) -> None:
    """The protocol's numbers of ``result`` as ``eval`` prints them, under a first line ending in ``what``."""
    protocol = result["protocol"]
    click.echo(f"{protocol} on {result['split']} ({result['images']} images, {result['captions']} captions) — "
               f"{what}")
    if result.get("size_mismatch"):
        m = result["size_mismatch"]
        click.echo(f"note: {protocol} expects {m['expected']} images, this split has {m['images']} "
                   "(--allow-size-mismatch): not the protocol's numbers")
    if protocol == "coco-1k":
        click.echo("mean over 5 folds:")
    if protocol == "coco-1k-first":
        click.echo("first 1K fold only:")
    click.echo(_line("image→text (i2t)", result["i2t"]))
    click.echo(_line("text→image (t2i)", result["t2i"]))
    click.echo(f"rsum: {result['rsum']:.1f}  (ties: {result.get('ties', 'pessimistic')})")


def echo_extended(extended: dict, annotations: str, ties: str) -> None:
    """The extended numbers (``result["extended"]``) as one table: a row per direction, a column per number."""
    click.echo(f"COCO 5K test, every true match counted (ECCV Caption, CxC; {annotations}; ties: {ties}):")
    rows = [[side, *(extended[name][side] for name in METRIC_NAMES)] for side in ("i2t", "t2i")]
    click.echo(tabulate(rows, headers=["", *(METRIC_LABELS[name] for name in METRIC_NAMES)], tablefmt="simple",
                        floatfmt=".1f"))


@click.command("eval")
@click.argument("runs", nargs=-1, required=True, type=RUN)
@click.option("--protocol", type=click.Choice(PROTOCOLS), required=True,
              help="f30k-1k / coco-5k: the split as given; coco-1k: five equal folds in file order, averaged; "
                   "coco-1k-first: the first fold alone (SEAM's Table 3).")
@click.option("--split", default="test", show_default=True)
@click.option("--features", type=FEATURES, default=None, help="Override the run's feature set.")
@click.option("--manifest", type=MANIFEST, default=None, help="Override the run's manifest.")
@click.option("--checkpoint", "which", default="best", show_default=True, help="best, last, or a file in the run.")
@click.option("--precision", type=click.Choice(PRECISIONS), default=DEFAULT_PRECISION, show_default=True,
              help="refined: float32 scoring, then float64 for every pair whose rank rounding could change "
                   "(every rank, so every metric, equals float64's); float64: everything in float64 (full "
                   "orderings too); float32: one pass.")
@click.option("--device", default="auto", show_default=True)
@click.option("--tf32", is_flag=True,
              help="On CUDA, let cuDNN (the GRU/LSTM encoders, convolutions) and matrix products use TF32: faster, "
                   "but no longer the CPU's numbers (recorded in the result). Default: exact float32.")
@click.option("--preload/--no-preload", default=None,
              help="Hold the split's features in memory while encoding (default: each image is read from the file "
                   "once, as it is encoded).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with every number.")
@click.option("--save-sims", type=OutputPath("file"), default=None,
              help="Write the images × captions similarities (float64 .npy, manifest order) and FILE.ids.json "
                   "(the image ids of the rows, the caption keys of the columns).")
@click.option("--ties", type=click.Choice(TIE_RULES), default="pessimistic", show_default=True,
              help="pessimistic: a tie counts against the query; official: the authors' argsort order (gives an "
                   "imported official checkpoint its official numbers when identical captions tie).")
@click.option("--allow-size-mismatch", is_flag=True,
              help="Evaluate a split whose size is not the protocol's (1,000 Flickr30K / 5,000 COCO test images), "
                   "e.g. the synthetic data; recorded in the result.")
@click.option("--extended", is_flag=True,
              help="COCO protocols: also ECCV Caption (mAP@R, R-Precision, R@1) and CxC (R@1/5/10), which count "
                   "every human-verified match, and COCO 5K and 1K as eccv_caption computes them, from the same "
                   "matrix (needs the eccv extra and the manifest's COCO caption ids; docs/evaluation.md).")
@click.option("--trust-checkpoint", is_flag=True,
              help="Read checkpoints that hold Python objects besides tensors (they can run code: only for files "
                   "you trust).")
@no_verify_option
@quiet_option
def eval_command(runs, protocol, split, features, manifest, which, precision, device, tf32, preload, as_json,
                 save_sims, ties, allow_size_mismatch, extended, trust_checkpoint, no_verify, quiet) -> None:
    """Evaluate one run, or an ensemble of runs (their similarity matrices averaged).

    The result is also stored in each run's eval.json (not in an export's). A run may be an export
    (retr-train export), also on the Hugging Face Hub as hf-hub:ORG/NAME.

    \b
    Example:
      retr-train eval runs/scan-f30k --protocol f30k-1k
      retr-train eval runs/scan-coco-t2i runs/scan-coco-i2t --protocol coco-1k --json
      retr-train eval runs/vse-infinity-coco --protocol coco-5k --extended
    """
    runs = [str(local_run(run)) for run in runs]     # an hf-hub: name fetched (or found in the cache) once
    recorded = [run for run in runs if not ckpt.is_export(run)]   # an export is shared as made: nothing goes in
    for run in list(recorded):
        problem = write_problem(run)
        if problem is not None:                           # said before the work, which goes on
            click.echo(f"note: cannot write in {run} ({problem}): the result is not recorded in its "
                       f"{EVAL}", err=True)
            recorded.remove(run)
    if not no_verify:
        check_run_features(runs, features, quiet)
    result, sims = evaluate_runs(list(runs), protocol, split, features, manifest, device, precision, which,
                                 preload, quiet, trust_checkpoint=trust_checkpoint,
                                 allow_size_mismatch=allow_size_mismatch, ties=ties, tf32=tf32, extended=extended)
    if save_sims and sims is None:
        raise UserError("--save-sims: a two-step run has no single similarity matrix (one per direction)")
    if save_sims:
        write_sims(save_sims, sims, result, manifest or ckpt.read_config(runs[0]).get("manifest"), split)
    for run in recorded:
        record_result(run, result)
    if as_json:
        click.echo(json.dumps(result))
        return
    kind = f"ensemble of {len(runs)} runs (averaged similarities)" if len(runs) > 1 else "single model"
    echo_numbers(result, f"{kind}: {', '.join(runs)}")
    if "extended" in result:
        echo_extended(result["extended"], result["extended_annotations"], result["ties"])
    if "refinement" in result:
        r = result["refinement"]
        click.echo(f"precision refined: {r['rescored_pairs']} pairs ({100 * r['rescored_fraction']:.2f}%) rescored "
                   f"in float64 (margin {r['margin']:.2g}); every rank is the float64 one")
    if "two_step" in result:
        sec = result["seconds"]
        click.echo(f"two-step (shortlist {result['shortlist']}, re-ranked by the pair score) above; "
                   f"one-step (global score only): rsum {result['one_step']['rsum']:.1f}, "
                   f"i2t R@1 {result['one_step']['i2t']['r1']:.1f}, t2i R@1 {result['one_step']['t2i']['r1']:.1f}; "
                   f"seconds: one-step {sec['one_step']:.2f}, two-step {sec['two_step']:.2f}")


TABLE_FORMATS = {"text": "simple", "markdown": "github", "latex": "latex_booktabs", "csv": None}


@click.command("table")
@click.argument("runs", nargs=-1, required=True, type=RUN)
@click.option("--format", "fmt", type=click.Choice(list(TABLE_FORMATS)), default="text", show_default=True,
              help="text: aligned columns; markdown: a GitHub table; latex: a booktabs tabular; csv: full precision.")
@click.option("--extended", is_flag=True,
              help="The results evaluated with eval --extended, with their ECCV Caption (mAP@R, R-Precision, R@1) "
                   "and CxC (R@1/5/10) numbers both ways instead of the recalls.")
def table_command(runs, fmt, extended) -> None:
    """Print one table of every result stored in the runs' eval.json: which run (name, model, preset, seed),
    which protocol and split, single or ensemble, R@1/5/10 both ways and rSum.

    \b
    Example:
      retr-train table runs/scan-f30k runs/vsepp-f30k
      retr-train table runs/vsepp-s* --format markdown
      retr-train table runs/*-coco --extended --format latex
    """
    header, rows, notes = table_rows(runs, extended=extended)
    if not extended and fmt != "csv" and has_extended(runs):
        notes.append("ECCV Caption and CxC numbers of --extended results: retr-train table --extended")
    if fmt == "csv":                  # data only: a size-mismatched protocol keeps its mark, the notes are not rows

        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerows([header, *rows])
        click.echo(buffer.getvalue(), nl=False)
        return
    click.echo(tabulate(rows, headers=header, tablefmt=TABLE_FORMATS[fmt], floatfmt=".1f"))
    for note in notes:
        click.echo(f"% {note}" if fmt == "latex" else note)
