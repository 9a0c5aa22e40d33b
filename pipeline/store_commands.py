"""``retr-pipeline verify | inspect | index``: check, summarise and join feature sets."""
from __future__ import annotations

from pathlib import Path

import click

from retr.store.features import index_shard_folder
from retr.pipeline.verify import summarize_feature_set, verify_feature_set


@click.command("verify")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--sample-rows", type=int, default=64, show_default=True,
              help="How many random rows to check for non-finite values.")
def verify_command(paths: tuple[Path, ...], sample_rows: int) -> None:
    """Check feature sets; exit non-zero with a list of problems unless every one is sound.

    Checks attributes, shapes for the kind, unique ids, every shard present and complete, a sample of rows finite.

    \b
    Example:
      retr-pipeline verify data/coco/features/resnet152-grid.h5
    """
    failed = 0
    for path in paths:
        problems = verify_feature_set(path, sample_rows=sample_rows)
        if problems:
            failed += 1
            click.echo(f"{path}: {len(problems)} problem{'s' if len(problems) > 1 else ''}")
            for problem in problems:
                click.echo(f"  - {problem}")
        else:
            click.echo(f"{path}: ok")
    if failed:
        raise click.ClickException(f"{failed} of {len(paths)} feature set(s) failed verification")


@click.command("inspect")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
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
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
def index_command(folder: Path) -> None:
    """Join the shards in FOLDER (DIR/NAME/shard-*.h5) into the index DIR/NAME.h5.

    Extraction writes the index itself once every shard exists; this command does it by hand, e.g. after
    shards were produced on several machines and copied together.

    \b
    Example:
      retr-pipeline index data/coco/features/resnet152-grid
    """
    path = index_shard_folder(folder)
    click.echo(f"wrote {path}")
