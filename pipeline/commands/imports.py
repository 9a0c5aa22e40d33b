"""``retr-pipeline import-scan | import-tsv | import-npz``: bring existing region features into retr."""
from __future__ import annotations

from pathlib import Path

import click

from retr.common.cli import InputPath, OutputPath, quiet_option, splits_option
from retr.common.progress import progress
from retr.pipeline.importers import SCAN_SPLITS, ImportSummary, import_npz, import_scan, import_tsv
from retr.store.features import FEATURE_DTYPES

_dtype = click.option("--dtype", type=click.Choice(FEATURE_DTYPES), default="float16", show_default=True,
                      help="On-disk type of the features.")
_prefix = click.option("--id-prefix", default="", help="Prepended to every image id (e.g. coco_ to match a "
                                                       "Karpathy manifest).")
_max_boxes = click.option("--max-boxes", type=int, default=None,
                          help="Boxes per row K (default: the largest count in the input).")
#: SCAN's folder of {split}_ims.npy and {split}_caps.txt
_SCAN_DATA = InputPath("folder", "SCAN's data folder", path_type=Path)
_name = click.option("--name", default="regions", show_default=True, help="Writes OUT/NAME.h5.")


def _file_import_options(f):
    """The options import-tsv and import-npz share: the output folder and name, K, the id prefix, the dtype."""
    for option in (quiet_option, _dtype, _prefix, _max_boxes, _name):      # applied bottom-up, as a decorator stack
        f = option(f)
    return click.option("--out", type=OutputPath("folder", path_type=Path), required=True, help="Output folder.")(f)


def _bar(quiet: bool):
    return lambda iterable=None, **kwargs: progress(iterable, quiet=quiet, **kwargs)


def _report(summary: ImportSummary) -> None:
    text = f"wrote {summary.features} ({summary.rows} images × {summary.max_boxes} boxes)"
    if summary.manifest is not None:
        counts = ", ".join(f"{split} {n}" for split, n in summary.splits.items())
        text += f" and {summary.manifest} ({counts})"
    click.echo(text)


@click.command("import-scan")
@click.argument("data_dir_arg", metavar="DATA_DIR", required=False, type=_SCAN_DATA)
@click.option("--data-dir", type=_SCAN_DATA, default=None,
              help="The same as DATA_DIR (the older spelling): SCAN's folder with {split}_ims.npy and "
                   "{split}_caps.txt, e.g. data/f30k_precomp.")
@click.option("--out", type=OutputPath("folder", path_type=Path), required=True,
              help="Writes OUT/manifest.jsonl and OUT/regions.h5.")
@splits_option("--split", "--splits", "splits", help=f"SCAN splits ({', '.join(SCAN_SPLITS)}); default: all present, "
                                                      "testall instead of test when both exist.")
@_prefix
@_dtype
@quiet_option
def import_scan_command(data_dir_arg: Path | None, data_dir: Path | None, out: Path, splits: tuple[str, ...], id_prefix: str, dtype: str,
                        quiet: bool) -> None:
    """Import SCAN's precomputed features and captions as a regions feature set and a manifest.

    SCAN's dev becomes val; COCO's testall (5K) becomes test. Ids come from {split}_ids.txt when present,
    else <split>_<row>. Five captions per image.

    \b
    Example:
      retr-pipeline import-scan data/f30k_precomp --out data/f30k/scan
      retr-train scan --features data/f30k/scan/regions.h5 --manifest data/f30k/scan/manifest.jsonl
    """
    if (data_dir_arg is None) == (data_dir is None):
        raise click.UsageError("give SCAN's data folder once: import-scan DATA_DIR (or --data-dir DATA_DIR)")
    data_dir = data_dir_arg or data_dir
    chosen = list(splits) or None
    _report(import_scan(data_dir, out, chosen, dtype=dtype, id_prefix=id_prefix, progress=_bar(quiet)))


@click.command("import-tsv")
@click.argument("tsv", type=InputPath("file", "a TSV file", path_type=Path))
@_file_import_options
def import_tsv_command(tsv: Path, out: Path, name: str, max_boxes: int | None, id_prefix: str, dtype: str,
                       quiet: bool) -> None:
    """Import a bottom-up-attention TSV: the original 6 fields or LXMERT's 10 (with labels).

    \b
    Example:
      retr-pipeline import-tsv trainval_36/trainval_resnet101_faster_rcnn_genome_36.tsv --out data/coco/features --id-prefix coco_
    """
    _report(import_tsv(tsv, out, dtype=dtype, max_boxes=max_boxes, id_prefix=id_prefix, name=name,
                       progress=_bar(quiet)))


@click.command("import-npz")
@click.argument("folder", type=InputPath("folder", "a folder of .npz files", path_type=Path))
@_file_import_options
def import_npz_command(folder: Path, out: Path, name: str, max_boxes: int | None, id_prefix: str, dtype: str,
                       quiet: bool) -> None:
    """Import a folder of MILVLG per-image .npz files (id = file name without .npz).

    \b
    Example:
      retr-pipeline import-npz output/coco_features --out data/coco/features --id-prefix coco_
    """
    _report(import_npz(folder, out, dtype=dtype, max_boxes=max_boxes, id_prefix=id_prefix, name=name,
                       progress=_bar(quiet)))
