"""``retr-pipeline manifest …``: build manifests from Karpathy split files and check existing ones."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import click

from retr.common.cli import InputPath, OutputPath

from retr.common.errors import UserError
from retr.manifests.karpathy import read_karpathy
from retr.manifests.presets import PRESET_NAMES, get_preset
from retr.manifests.schema import SPLITS, outside_root_reason, read_manifest, write_manifest


@click.group("manifest")
def manifest_group() -> None:
    """Build and check manifests (JSON Lines: id, path, split, captions).

    \b
    Example:
      retr-pipeline manifest karpathy data/coco/dataset_coco.json --out data/coco/manifest.jsonl
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
def karpathy_command(karpathy_file: Path, out: Path, max_captions: int) -> None:
    """Convert a Karpathy split file (dataset_coco.json, dataset_flickr30k.json) into a manifest.

    COCO's restval stays its own split; images keep file order (the 1K test folds depend on it).

    \b
    Example:
      retr-pipeline manifest karpathy dataset_flickr30k.json --out data/f30k/manifest.jsonl
    """
    records = read_karpathy(karpathy_file, max_captions=max_captions or None)
    write_manifest(out, records)
    click.echo(f"wrote {out}: {_split_summary(records)}")


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
                         ("karpathy", preset.karpathy), ("features", preset.features)):
        state = "" if value is None else ("  (present)" if value.exists() else "  (missing)")
        click.echo(f"  {label:<9} {value}{state}")
    click.echo(f"  protocols {', '.join(preset.test_protocols)}")
