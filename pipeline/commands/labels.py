"""``retr-pipeline labels …``: image-label files (JGCAR's ``--labels``) from COCO's or Flickr30K Entities'
annotations."""
from __future__ import annotations

from pathlib import Path

import click

from retr.common.cli import InputPath, OutputPath

from retr.common.errors import UserError
from retr.manifests.dataset_labels import (F30K_NOT_LABELS, F30K_READING_DESCRIPTIONS, F30K_READINGS, LabelJoin,
                                           coco_instance_labels, f30k_entity_labels, read_coco_instances)
from retr.manifests.schema import manifest_sha256, read_manifest
from retr.store.labels import write_label_file

_manifest_option = click.option("--manifest", type=InputPath("file", "a JSON Lines manifest", path_type=Path),
                                required=True,
                                help="The dataset manifest whose images get labels (JSON Lines).")
#: a COCO instances_*.json file
_INSTANCES = InputPath("file", "a COCO instance annotation JSON file", resource=True, path_type=Path)
_out_option = click.option("--out", type=OutputPath("file", path_type=Path), required=True,
                           help="Label file to write: .json (one object) or .jsonl (one image per line).")


@click.group("labels")
def labels_group() -> None:
    """Write image-label files (JGCAR's --labels) from a dataset's own annotations.

    \b
    Example:
      retr-pipeline labels coco --instances instances_train2014.json instances_val2014.json \\
          --manifest data/coco/manifest.jsonl --out data/coco/instance_labels.json
      retr-pipeline labels f30k-entities --sentences Flickr30kEntities/Sentences \\
          --annotations Flickr30kEntities/Annotations \\
          --manifest data/f30k/manifest.jsonl --out data/f30k/entity_labels.json
    """


def _write(out: Path, manifest: Path, total: int, result: LabelJoin, attrs: dict, none_matched: str,
           complete_hint: str) -> None:
    if not result.labels:
        raise UserError(none_matched)
    attrs = {**attrs, "manifest": manifest.name, "manifest_sha256": manifest_sha256(manifest), "join": result.join,
             "vocabulary": result.vocabulary, "unmatched_images": len(result.unmatched)}
    write_label_file(out, result.labels, attrs)
    click.echo(f"wrote {out}: {result.summary(total)}")
    if result.unmatched:
        click.echo(f"warning: retr-train jgcar --labels needs an entry for every training image; {complete_hint}",
                   err=True)


@labels_group.command("coco")
@click.option("--instances", type=_INSTANCES, multiple=True, required=True,
              help="COCO instance annotation files (instances_train2014.json …): --instances A B, or "
                   "--instances A --instances B.")
@click.argument("more_instances", nargs=-1, type=_INSTANCES)
@_manifest_option
@_out_option
def coco_command(instances: tuple[Path, ...], more_instances: tuple[Path, ...], manifest: Path, out: Path) -> None:
    """Each manifest image's COCO categories (sorted names of its instance annotations; none: an empty list).

    Images are joined by file name (COCO_val2014_000000391895.jpg), else by a coco_<id> manifest id (the
    2017 files: same image ids, other file names). The Karpathy split draws on train2014 and val2014: give both.
    File names after the options are more instance files.

    \b
    Example:
      retr-pipeline labels coco --instances annotations/instances_train2014.json \\
          annotations/instances_val2014.json \\
          --manifest data/coco/manifest.jsonl --out data/coco/instance_labels.json
    """
    records = read_manifest(manifest)
    coco = read_coco_instances(instances + more_instances)
    result = coco_instance_labels(records, coco)
    first = records[0].path if records else "-"
    example = next(iter(coco.by_file), "-")
    _write(out, manifest, len(records), result,
           {"source": "coco-instances", "inputs": coco.files},
           f"none of the {len(records)} images of {manifest} is in {', '.join(coco.files)} (joined by file name, "
           f"e.g. {first}, and by coco_<id> ids; the instance files name e.g. {example}); are they the same "
           f"dataset?",
           "give every instance file the manifest draws on (instances_train2014.json and instances_val2014.json "
           "for the Karpathy split)")


@labels_group.command("f30k-entities")
@click.option("--sentences", required=True,
              type=InputPath("folder", "the Sentences folder", resource=True, path_type=Path),
              help="Flickr30K Entities' Sentences folder (one <image id>.txt per image).")
@click.option("--annotations", default=None,
              type=InputPath("folder", "the Annotations folder", resource=True, path_type=Path),
              help="Flickr30K Entities' Annotations folder: count only entities that have a bounding box "
                   "(recommended: the paper's labels come 'from the bounding box annotation').")
@click.option("--f30k-labels", "reading", type=click.Choice(F30K_READINGS), default=F30K_READINGS[0],
              show_default=True,
              help="heads: the head noun of each entity phrase ('[/EN#18/people A man]' → man; lower case, "
                   "singular); types: the 8 coarse entity types (people, clothing, …), which nearly every image "
                   "shares, so JGCAR's intra-modal losses see almost no negatives.")
@_manifest_option
@_out_option
def f30k_entities_command(sentences: Path, annotations: Path | None, reading: str, manifest: Path,
                          out: Path) -> None:
    """Each manifest image's Flickr30K Entities labels: the head nouns (default) or the entity types of the
    phrases of its five sentences ('notvisual' phrases left out).

    Images are joined by file stem: 1000092795.jpg reads Sentences/1000092795.txt (and Annotations/1000092795.xml
    with --annotations). The reading is recorded in the file's attributes (f30k_labels, label_reading).

    \b
    Example:
      retr-pipeline labels f30k-entities --sentences Flickr30kEntities/Sentences \\
          --annotations Flickr30kEntities/Annotations \\
          --manifest data/f30k/manifest.jsonl --out data/f30k/entity_labels.json
    """
    records = read_manifest(manifest)
    result = f30k_entity_labels(records, sentences, annotations, reading)
    first = Path(records[0].path).stem if records else "-"
    _write(out, manifest, len(records), result,
           {"source": "f30k-entities", "inputs": [sentences.name] + ([annotations.name] if annotations else []),
            "f30k_labels": reading, "label_reading": F30K_READING_DESCRIPTIONS[reading],
            "boxed_only": annotations is not None, "excluded_types": list(F30K_NOT_LABELS)},
           f"none of the {len(records)} images of {manifest} has a sentence file in {sentences} (looked for "
           f"<file stem>.txt, e.g. {sentences / (first + '.txt')}); is it the Flickr30K Entities Sentences folder?",
           f"{sentences} lacks some of the manifest's images (is it the whole Sentences folder?)")
    other = next(r for r in F30K_READINGS if r != reading)
    click.echo(f"labels: {F30K_READING_DESCRIPTIONS[reading]}"
               + ("" if annotations else "; all entities (--annotations: only those with a bounding box)")
               + f"; --f30k-labels {other} for the other reading")
