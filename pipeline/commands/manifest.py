"""``retr-pipeline manifest …``: build manifests from Karpathy split files, give COCO manifests their caption ids,
and check existing ones."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import click

from retr.common.cli import InputPath, OutputPath

from retr.common.errors import UserError
from retr.manifests.karpathy import read_karpathy
from retr.manifests.presets import PRESET_NAMES, get_preset
from retr.manifests.schema import SPLITS, outside_root_reason, read_manifest, rewrite_caption_ids, write_manifest
from retr.manifests.coco_captions import join_caption_ids, read_coco_captions


@click.group("manifest")
def manifest_group() -> None:
    """Build and check manifests (JSON Lines: id, path, split, captions).

    \b
    Example:
      retr-pipeline manifest karpathy data/coco/dataset_coco.json --out data/coco/manifest.jsonl
      retr-pipeline manifest coco-caption-ids data/coco/manifest.jsonl --annotations data/coco/annotations
      retr-pipeline manifest check data/coco/manifest.jsonl
    """


def _split_summary(records) -> str:
    counts = Counter(r.split for r in records)
    captions = sum(len(r.captions) for r in records)
    parts = [f"{split} {counts[split]}" for split in SPLITS if counts[split]]
    return f"{len(records)} images ({', '.join(parts)}), {captions} captions"


@manifest_group.command("karpathy")
@click.argument("karpathy_file", type=InputPath("file", "a Karpathy split JSON file", path_type=Path))
@click.option("--out", type=OutputPath("file", path_type=Path), required=True,
              help="Manifest to write (JSON Lines).")
@click.option("--max-captions", type=int, default=5, show_default=True,
              help="Keep the first N captions of each image (0 keeps all).")
@click.option("--coco-captions", "coco_captions", multiple=True,
              type=InputPath("any", "COCO's caption files", resource=True, path_type=Path),
              help="COCO: give each caption its COCO caption id from captions_train2014.json and "
                   "captions_val2014.json (the files, their folder, or annotations_trainval2014.zip).")
def karpathy_command(karpathy_file: Path, out: Path, max_captions: int, coco_captions: tuple[Path, ...]) -> None:
    """Convert a Karpathy split file (dataset_coco.json, dataset_flickr30k.json) into a manifest.

    COCO's restval stays its own split; images keep file order (the 1K test folds depend on it). With
    --coco-captions each caption also gets its COCO caption id (retr-train eval --extended needs them).

    \b
    Example:
      retr-pipeline manifest karpathy dataset_flickr30k.json --out data/f30k/manifest.jsonl
      retr-pipeline manifest karpathy dataset_coco.json --coco-captions annotations_trainval2014.zip \\
          --out data/coco/manifest.jsonl
    """
    coco = read_coco_captions(coco_captions) if coco_captions else None    # an absent download: said first
    records = read_karpathy(karpathy_file, max_captions=max_captions or None)
    line = None
    if coco is not None:
        join = join_caption_ids(records, coco)
        records, line = join.records, join.summary()
    write_manifest(out, records)
    click.echo(f"wrote {out}: {_split_summary(records)}" + (f"; {line}" if line else ""))


@manifest_group.command("coco-caption-ids")
@click.argument("manifest", type=InputPath("file", "a JSON Lines manifest", path_type=Path))
@click.option("--annotations", multiple=True, required=True,
              type=InputPath("any", "COCO's caption files", resource=True, path_type=Path),
              help="COCO's caption files captions_train2014.json and captions_val2014.json: the files, the folder "
                   "holding them (fetch-data coco puts them in DATA/annotations), or annotations_trainval2014.zip.")
@click.option("--out", type=OutputPath("file", path_type=Path), default=None,
              help="Write the manifest here (default: rewrite MANIFEST in place).")
def coco_caption_ids_command(manifest: Path, annotations: tuple[Path, ...], out: Path | None) -> None:
    """Give an existing COCO manifest its captions' COCO caption (annotation) ids.

    Each caption is matched to an annotation of its image (by file name, else by its coco_<id>) with the same text
    (whitespace runs made single spaces); a caption that matches none keeps no id, and the line printed counts and
    names such captions. Only the caption ids change: every other byte of the manifest stays, and features,
    parses and runs made from it still match it (its digest leaves the caption ids out). retr-train eval
    --extended (ECCV Caption, CxC) needs the test split's ids.

    \b
    Example:
      retr-pipeline manifest coco-caption-ids data/coco/manifest.jsonl --annotations data/coco/annotations
      retr-pipeline manifest coco-caption-ids manifest.jsonl --annotations annotations_trainval2014.zip
    """
    records = read_manifest(manifest)
    if not records:
        raise UserError(f"{manifest} holds no images (a manifest has one JSON object per line)")
    join = join_caption_ids(records, read_coco_captions(annotations))
    rewrite_caption_ids(manifest, {r.id: r.caption_ids for r in join.records}, out)
    click.echo(f"wrote {out or manifest}: {join.summary()}")


@manifest_group.command("check")
@click.argument("manifest", type=InputPath("file", "a JSON Lines manifest", path_type=Path))
@click.option("--image-root", type=InputPath("folder", "a folder of images", path_type=Path), default=None,
              help="Also check that every image file exists under this folder.")
@click.option("--allow-outside-root", is_flag=True,
              help="Accept image paths that leave the image root (absolute, or '..' above it).")
def check_command(manifest: Path, image_root: Path | None, allow_outside_root: bool) -> None:
    """Validate a manifest and print how many images and captions each split has.

    Image paths must stay inside the image root: an absolute path or one whose '..' climb above the root is an
    error unless --allow-outside-root. With --image-root every image file must exist.

    \b
    Example:
      retr-pipeline manifest check data/synthetic/manifest.jsonl --image-root data/synthetic
    """
    records = read_manifest(manifest)
    if not records:
        raise UserError(f"{manifest} holds no images (a manifest has one JSON object per line)")
    click.echo(f"{manifest}: {_split_summary(records)}")
    outside = [(r, reason) for r in records if (reason := outside_root_reason(r.path)) is not None]
    errors = []
    if outside and not allow_outside_root:
        shown = ", ".join(f"{r.id} ({r.path}: {reason})" for r, reason in outside[:3])
        errors.append(f"{len(outside)} image path{'s' if len(outside) > 1 else ''} leave the image root: {shown}"
                      + (" …" if len(outside) > 3 else "") + " (--allow-outside-root accepts them)")
    elif outside:
        click.echo(f"note: {len(outside)} image paths leave the image root (accepted: --allow-outside-root)")
    if image_root is not None:
        refused = set() if allow_outside_root else {r.id for r, _ in outside}
        missing = [r for r in records if r.id not in refused and not (image_root / r.path).is_file()]
        if missing:
            shown = ", ".join(f"{r.id} ({r.path})" for r in missing[:5])
            errors.append(f"{len(missing)} image files missing under {image_root}: {shown}"
                          + (" …" if len(missing) > 5 else ""))
        else:
            click.echo(f"all {len(records) - len(refused)} image files present under {image_root}")
    if errors:
        raise click.ClickException("; ".join(errors))


@manifest_group.command("preset")
@click.argument("name", type=click.Choice(PRESET_NAMES))
def preset_command(name: str) -> None:
    """Print where a dataset preset looks for images, manifest and features (after overrides).

    \b
    Example:
      RETR_DATA=/datasets retr-pipeline manifest preset coco
    """
    preset = get_preset(name)
    click.echo(f"{preset.name}: {preset.description}")
    for label, value in (("images", preset.images), ("manifest", preset.manifest),
                         ("karpathy", preset.karpathy), ("features", preset.features),
                         *([("annotations", preset.annotations)] if preset.annotations else [])):
        state = "" if value is None else ("  (present)" if value.exists() else "  (missing)")
        click.echo(f"  {label:<11} {value}{state}")
    click.echo(f"  {'protocols':<11} {', '.join(preset.test_protocols)}")
