"""``retr-pipeline verify | inspect | index``: check, summarise and join feature sets."""
from __future__ import annotations

from pathlib import Path

import json

import click

from retr.common.cli import InputPath
from retr.common.paths import check_output_file

from retr.store.features import index_path_for, index_shard_folder
from retr.pipeline.verify import summarize_feature_set, verify_report


@click.command("verify")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--sample", "--sample-rows", "sample", type=click.IntRange(min=0), default=None,
              help="Quick mode: read only N random rows (plus the first and last) instead of every row.")
@click.option("--no-checksum", "no_checksum", is_flag=True,
              help="Quick mode: do not compare rows with the checksums stored when they were written.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per feature set (path, ok, problems, "
                                                       "notes, rows, rows_read, rows_checksummed).")
def verify_command(paths: tuple[Path, ...], sample: int | None, no_checksum: bool, as_json: bool) -> None:
    """Check feature sets; exit non-zero with a list of problems unless every one is sound.

    Checks attributes, shapes for the kind, unique ids, every shard present and complete with the ids the
    index records, then every row: finite values, and the checksum stored when it was written. Rows are
    streamed (bounded memory); --sample N and --no-checksum are quicker, weaker checks.

    \b
    Example:
      retr-pipeline verify data/coco/features/resnet152-grid.h5
      retr-pipeline verify --sample 64 --no-checksum data/coco/features/*.h5
    """
    failed = 0
    for path in paths:
        report = verify_report(path, sample=sample, checksum=not no_checksum)
        if as_json:
            failed += bool(report.problems)
            click.echo(json.dumps({"path": str(path), "ok": not report.problems, "problems": report.problems,
                                   "notes": report.notes, "rows": report.rows, "rows_read": report.rows_read,
                                   "rows_checksummed": report.rows_checksummed}))
            continue
        if report.problems:
            failed += 1
            click.echo(f"{path}: {len(report.problems)} problem{'s' if len(report.problems) > 1 else ''}")
            for problem in report.problems:
                click.echo(f"  - {problem}")
        else:
            read = (f"{report.rows_read} of {report.rows} rows read" if sample is not None
                    else f"all {report.rows} rows read")
            sums = (f", {report.rows_checksummed} matched their checksums" if not no_checksum
                    else ", checksums not compared (--no-checksum)")
            click.echo(f"{path}: ok ({read}{sums})")
        for note in report.notes:
            click.echo(f"  note: {note}")
    if failed:
        raise click.ClickException(f"{failed} of {len(paths)} feature set(s) failed verification")


@click.command("inspect")
@click.argument("paths", nargs=-1, required=True, type=InputPath("file", "a feature-set .h5 file", path_type=Path))
def inspect_command(paths: tuple[Path, ...]) -> None:
    """Summarise feature sets: kind, extractor, weights, N, K×D, dtype, size on disk, errors.

    \b
    Example:
      retr-pipeline inspect data/synthetic/features/butd-regions.h5
    """
    for path in paths:
        for line in summarize_feature_set(path):
            click.echo(line)


@click.command("index")
@click.argument("folder", type=InputPath("folder", "a folder of shards, DIR/NAME/shard-*.h5", path_type=Path))
def index_command(folder: Path) -> None:
    """Join the shards in FOLDER (DIR/NAME/shard-*.h5) into the index DIR/NAME.h5.

    Extraction writes the index itself once every shard exists; this command does it by hand, e.g. after
    shards were produced on several machines and copied together.

    \b
    Example:
      retr-pipeline index data/coco/features/resnet152-grid
    """
    check_output_file(index_path_for(folder), "the index")
    path = index_shard_folder(folder)
    click.echo(f"wrote {path}")
