"""``retr-pipeline synth``: write the synthetic coloured-shapes dataset (see :mod:`retr.manifests.synthetic`)."""
from __future__ import annotations

from pathlib import Path

import click

from retr.common.cli import OutputPath, quiet_option
from retr.common.paths import check_folder_holds_only
from retr.common.progress import progress
from retr.manifests.synthetic import CONLLU, MANIFEST, MAX_SCENES, SCENES, generate_synthetic


@click.command("synth")
@click.option("--out", type=OutputPath("folder", path_type=Path), required=True,
              help="Folder to write (created if needed; an existing synthetic dataset there is rewritten).")
@click.option("--allow-nonempty-out", is_flag=True,
              help="Write the dataset into a non-empty --out that holds none (refused otherwise).")
@click.option("--images", "num_images", type=int, default=1000, show_default=True,
              help=f"Number of images (3 to {MAX_SCENES}: every scene occurs once).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Random seed; the same seed and --images give byte-identical files.")
@quiet_option
def synth_command(out: Path, num_images: int, seed: int, allow_nonempty_out: bool, quiet: bool) -> None:
    """Generate the synthetic dataset: scenes of two coloured shapes, five captions each, gold parses.

    Writes OUT/images/synth_NNNNN.jpg (224×224), OUT/manifest.jsonl (train/val/test, 10% each for
    val and test), OUT/captions.conllu (the gold dependency and constituency parse of every caption)
    and OUT/scenes.jsonl (each image's objects, positions and relation). Every caption names both
    objects (size, colour, shape) and their relation, so it matches exactly one image.

    \b
    Example:
      retr-pipeline synth --out data/synthetic --images 240 --seed 0
    """
    if not allow_nonempty_out:
        check_folder_holds_only(out, "--out", "a synthetic dataset", lambda folder: all(
            (folder / name).is_file() for name in (MANIFEST, SCENES)))
    summary = generate_synthetic(
        out, num_images=num_images, seed=seed,
        progress=lambda items: progress(items, total=num_images, desc="synth", unit="img", quiet=quiet))
    counts = ", ".join(f"{split} {n}" for split, n in summary.split_counts.items())
    click.echo(f"wrote {summary.num_images} images ({counts}), {summary.num_captions} captions to {out}: "
               f"{MANIFEST}, {CONLLU}, {SCENES}, images/")
