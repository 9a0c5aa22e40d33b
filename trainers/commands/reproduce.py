"""``retr-train reproduce RECIPE`` and ``retr-train recipes`` (:mod:`retr.trainers.reproduction`)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click
from tabulate import tabulate

from retr.common.cli import InputPath, OutputPath, quiet_option
from retr.store.word_vectors import GLOVE_SETS
from retr.trainers.commands.options import FEATURES, MANIFEST, no_verify_option
from retr.trainers.reproduction.recipes import NOT_EXPRESSED, get_recipe, list_recipes
from retr.trainers.reproduction.reproduce import (_fmt, _published, format_report, markdown_table, parse_overrides,
                                                  provenance_json, reproduce)


@click.command("reproduce")
@click.argument("recipe")
@click.option("--features", required=True, type=FEATURES,
              help="The recipe's feature set (retr-train recipes names it).")
@click.option("--manifest", required=True, type=MANIFEST)
@click.option("--out", required=True, type=OutputPath("folder"),
              help="Folder of the members' runs (shared between recipes) and the report.")
@click.option("--trees", type=InputPath("file", "a trees.h5 file"), default=None, help="SMFEA recipes: trees.h5.")
@click.option("--concepts", type=InputPath("file", "a concepts.h5 file"), default=None,
              help="SMFEA recipes: concepts.h5.")
@click.option("--concept-vectors", default=None,
              type=InputPath("file", "a word-vector file", takes=GLOVE_SETS.__contains__),
              help="SMFEA recipes: GloVe-format concept vectors.")
@click.option("--labels", type=InputPath("file", "a label file"), default=None, help="JGCAR recipes: image labels.")
@click.option("--epochs", type=int, default=None, help="Override every member's epochs (not a reproduction).")
@click.option("--batch-size", type=int, default=None, help="Override every member's batch size.")
@click.option("--train-split", "train_splits", multiple=True, help="Override the training splits.")
@click.option("--val-images", type=int, default=None, help="Override the validation images.")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Override a setting of every member that has it (e.g. --set embed_size=64).")
@click.option("--retrain", multiple=True, metavar="MEMBER",
              help="Train this member again although OUT holds a run of it made otherwise (that run is moved "
                   "aside to OUT/MEMBER.replaced-TIME, not deleted); repeatable.")
@click.option("--split", default="test", show_default=True, help="Evaluation split.")
@click.option("--device", default="auto", show_default=True)
@click.option("--allow-size-mismatch", is_flag=True,
              help="Evaluate a split whose size is not the protocol's (e.g. the synthetic data); recorded.")
@no_verify_option
@quiet_option
def reproduce_command(recipe, features, manifest, out, trees, concepts, concept_vectors, labels, epochs, batch_size,
                      train_splits, val_images, settings, retrain, split, device, allow_size_mismatch,
                      no_verify, quiet) -> None:
    """Train every member of RECIPE, evaluate it, and print measured beside published numbers.

    Finished members are reused and interrupted ones resumed, so running the command again continues where
    it stopped; a member run in OUT made with other settings or data is refused (--retrain MEMBER). The first
    line says "reproduction: yes", or "no" with every reason. The report is also written to
    OUT/reproduce-RECIPE.json.

    \b
    Example:
      retr-train reproduce scan-f30k-ensemble --features data/f30k/features/butd-regions.h5 \\
          --manifest data/f30k/manifest.jsonl --out runs/
      retr-train recipes
    """
    chosen = get_recipe(recipe)
    overrides = parse_overrides(settings)
    for key, value in (("epochs", epochs), ("batch_size", batch_size), ("val_images", val_images),
                       ("train_splits", list(train_splits) or None)):
        if value is not None:
            overrides[key] = value
    data = {"features": features, "manifest": manifest, "trees": trees, "concepts": concepts,
            "concept_vectors": concept_vectors, "labels": labels}
    report = reproduce(chosen, data, Path(out), overrides, split, device, allow_size_mismatch, quiet, tuple(retrain),
                       verify=not no_verify)
    for line in format_report(report):
        click.echo(line)
    click.echo(f"report written to {Path(out) / f'reproduce-{chosen.name}.json'}")


@click.command("recipes")
@click.option("--json", "as_json", is_flag=True, help="Print the recipes as JSON.")
@click.option("--markdown", is_flag=True, help="Print the table of docs/recipes.md (GitHub markdown).")
def recipes_command(as_json, markdown) -> None:
    """List every recipe: the published row it reproduces, its protocol and the features it needs.

    \b
    Example:
      retr-train recipes
      retr-train reproduce scan-f30k-t2i-avg --features … --manifest … --out runs/
    """
    recipes = list_recipes()
    if markdown:
        click.echo(markdown_table())
        return
    if as_json:
        click.echo(json.dumps({"recipes": [{"name": r.name, "title": r.title, "protocol": r.protocol,
                                "features": provenance_json(r)["features"],
                                "inputs": provenance_json(r)["inputs"],
                                "members": [{"run": m.run, "model": m.model, "preset": m.preset,
                                             "settings": dict(m.settings)} for m in r.members],
                                "published": _published(r.published), "notes": r.notes,
                                "unmet": list(r.unmet),
                                "zero_shot": dict(r.zero_shot) if r.zero_shot is not None else None}
                               for r in recipes],
                               "not_expressed": [dataclasses.asdict(n) for n in NOT_EXPRESSED]}, indent=2))
        return

    rows = [[r.name, r.protocol, _fmt(r.published.i2t[0]), _fmt(r.published.t2i[0]), _fmt(r.published.rsum),
             r.features.extractor, r.published.source] for r in recipes]
    header = ["recipe", "protocol", "i2t R@1", "t2i R@1", "rSum", "features", "published in"]
    click.echo(tabulate(rows, headers=header, tablefmt="simple", disable_numparse=True))
