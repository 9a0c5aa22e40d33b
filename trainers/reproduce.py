"""``retr-train reproduce RECIPE`` and ``retr-train recipes``: a published row from one command.

``reproduce`` trains every member of a recipe (:mod:`retr.trainers.recipes`) into ``OUT/<member run>`` — a
finished member is skipped, an interrupted one resumed — then evaluates each member alone and, for an ensemble,
the members together, and prints and writes (``OUT/reproduce-<recipe>.json``) the measured numbers beside the
published ones with their difference, single and ensemble rows labelled.

Overrides (``--epochs 1``, ``--set embed_size=64`` …) change every member's settings (only members whose model
has the setting); they are recorded in the output, so a run on the synthetic data is never mistaken for a
reproduction.
"""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

from retr.common.cli import quiet_option
from retr.common.errors import UserError
from retr.trainers import checkpoint as ckpt
from retr.trainers.config import TrainConfig, setting_fields
from retr.trainers.recipes import Member, Published, Recipe, get_recipe, list_recipes

SIDES = ("i2t", "t2i")
KEYS = ("r1", "r5", "r10")


def parse_overrides(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``("embed_size=64", "agg=avg")`` → ``{"embed_size": 64, "agg": "avg"}`` (values parsed as JSON when they
    can be, else kept as text)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--set {pair!r}: expected KEY=VALUE (e.g. --set embed_size=64)")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out


def member_settings(member: Member, overrides: dict[str, Any]) -> dict[str, Any]:
    """The member's settings with the overrides its model has (run settings apply to every member)."""
    from retr.trainers.models import get_spec

    spec = get_spec(member.model)
    names = {f.name for f in dataclasses.fields(spec.config_class)} | {f.name for f in setting_fields(TrainConfig)}
    return {**member.settings, **{k: v for k, v in overrides.items() if k in names}}


def _check_overrides(recipe: Recipe, overrides: dict[str, Any]) -> None:
    from retr.trainers.models import get_spec

    known = {f.name for f in setting_fields(TrainConfig)}
    for member in recipe.members:
        known |= {f.name for f in dataclasses.fields(get_spec(member.model).config_class)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise UserError(f"no member of {recipe.name} has the setting(s) {', '.join(unknown)}")


def member_state(run: Path) -> str:
    """``new`` (nothing there), ``finished`` (every epoch done, or stopped early), or ``interrupted``."""
    checkpoints = ckpt.list_checkpoints(run) if run.is_dir() else []
    if not checkpoints:
        return "new"
    state = ckpt.load_checkpoint(checkpoints[-1][1])
    config = state["config"]
    epoch, best = state["epoch"], state.get("best_epoch", state["epoch"])
    early = config.get("early_stop") or 0
    if epoch + 1 >= config["epochs"] or (early and epoch - best >= early):
        return "finished"
    return "interrupted"


def train_member(member: Member, out: Path, data: dict, overrides: dict[str, Any], quiet: bool, log) -> Path:
    """Train (or resume, or skip) one member; returns its run directory."""
    from retr.trainers.loop import train
    from retr.trainers.models import get_spec
    from retr.trainers.train_command import gather_settings

    spec = get_spec(member.model)
    run = out / member.run
    values = {"features": data["features"], "manifest": data["manifest"], "out": str(run), "preset": member.preset,
              **member_settings(member, overrides), "config": None}
    for side in spec.inputs:
        if data.get(side.name):
            values[side.name] = data[side.name]
    cfg, _ = gather_settings(spec, values, set(values) - {"config"})
    state = member_state(run)
    if state == "finished" and ckpt.read_config(run).get("epochs", 0) >= cfg.epochs:
        log(f"{member.run}: finished, skipped")
        return run
    log(f"{member.run}: {'resuming' if state != 'new' else 'training'} ({member.model}, preset {cfg.preset})")
    train(cfg, resume=state != "new", quiet=quiet, log=log)
    if spec.after_training is not None and state == "new":
        spec.after_training(str(run), cfg, log)
    return run


def _numbers(result: dict) -> dict:
    return {**{side: {k: result[side][k] for k in KEYS} for side in SIDES}, "rsum": result["rsum"]}


def _published(row: Published) -> dict:
    return {**{side: dict(zip(KEYS, getattr(row, side))) for side in SIDES}, "rsum": row.rsum, "source": row.source}


def _difference(measured: dict, published: dict) -> dict:
    def diff(a, b):
        return None if b is None else round(a - b, 2)
    return {**{side: {k: diff(measured[side][k], published[side][k]) for k in KEYS} for side in SIDES},
            "rsum": diff(measured["rsum"], published["rsum"])}


def compare(kind: str, label: str, result: dict, row: Published | None) -> dict:
    measured = _numbers(result)
    entry = {"kind": kind, "label": label, "measured": measured}
    if row is not None:
        entry["published"] = _published(row)
        entry["difference"] = _difference(measured, entry["published"])
    return entry


def reproduce(recipe: Recipe, data: dict, out: Path, overrides: dict[str, Any], split: str = "test",
              device: str = "auto", allow_size_mismatch: bool = False, quiet: bool = False, log=print) -> dict:
    """Train every member, evaluate singles and the ensemble, compare with the published numbers."""
    from retr.trainers.eval_commands import evaluate_runs

    _check_overrides(recipe, overrides)
    _check_data(data)
    out.mkdir(parents=True, exist_ok=True)
    runs = [train_member(m, out, data, overrides, quiet, log) for m in recipe.members]
    eval_args = dict(split=split, features=data["features"], manifest=data["manifest"], device=device,
                     quiet=True, allow_size_mismatch=allow_size_mismatch)
    rows = []
    for member, run in zip(recipe.members, runs):
        result, _ = evaluate_runs([str(run)], recipe.protocol, **eval_args)
        rows.append(compare("single", member.run, result, member.published if recipe.ensemble else recipe.published))
    if recipe.ensemble:
        result, _ = evaluate_runs([str(r) for r in runs], recipe.protocol, **eval_args)
        rows.append(compare("ensemble", " + ".join(m.run for m in recipe.members), result, recipe.published))
    report = {"recipe": recipe.name, "title": recipe.title, "protocol": recipe.protocol, "split": split,
              "features": {"given": data["features"], "needed": recipe.features.extractor},
              "overrides": overrides, "reproduction": not overrides, "rows": rows,
              "runs": [str(r) for r in runs], "notes": recipe.notes,
              "size_mismatch": result.get("size_mismatch"),
              "evaluated": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    ckpt.write_json(out / f"reproduce-{recipe.name}.json", report)
    return report


def _check_data(data: dict) -> None:
    """Open the feature set and read the manifest before the first member starts (one error line, nothing
    trained, when either is the wrong kind of file)."""
    from retr.manifests.schema import read_manifest
    from retr.store.features import FeatureSet

    FeatureSet(data["features"])
    if not read_manifest(data["manifest"]):
        raise UserError(f"{data['manifest']} holds no images")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _fmt_diff(value) -> str:
    return "" if value is None else f"{value:+.1f}"


def format_report(report: dict) -> list[str]:
    header = ["row", "", "i2t R@1", "R@5", "R@10", "t2i R@1", "R@5", "R@10", "rSum"]
    table = []
    for row in report["rows"]:
        name = f"{row['kind']}: {row['label']}"
        for what in ("measured", "published", "difference"):
            if what not in row:
                continue
            numbers = row[what]
            fmt = _fmt_diff if what == "difference" else _fmt
            table.append([name if what == "measured" else "", what,
                          *(fmt(numbers[s][k]) for s in SIDES for k in KEYS), fmt(numbers["rsum"])])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    lines = [f"{report['recipe']} — {report['title']} ({report['protocol']} on {report['split']})"]
    if report["overrides"]:
        lines.append(f"overrides {json.dumps(report['overrides'])}: not the published settings")
    lines += ["  ".join(str(x).ljust(w) if i < 2 else str(x).rjust(w) for i, (x, w) in enumerate(zip(r, widths))).rstrip()
              for r in [header, *table]]
    for row in report["rows"]:
        if "published" in row:
            lines.append(f"{row['kind']} {row['label']}: published in {row['published']['source']}")
    if report.get("notes"):
        lines.append(f"note: {report['notes']}")
    return lines


@click.command("reproduce")
@click.argument("recipe")
@click.option("--features", required=True, type=click.Path(dir_okay=False),
              help="The recipe's feature set (retr-train recipes names it).")
@click.option("--manifest", required=True, type=click.Path(dir_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Folder of the members' runs (shared between recipes) and the report.")
@click.option("--trees", type=click.Path(dir_okay=False), default=None, help="SMFEA recipes: trees.h5.")
@click.option("--concepts", type=click.Path(dir_okay=False), default=None, help="SMFEA recipes: concepts.h5.")
@click.option("--concept-vectors", type=click.Path(dir_okay=False), default=None,
              help="SMFEA recipes: GloVe-format concept vectors.")
@click.option("--labels", type=click.Path(dir_okay=False), default=None, help="JGCAR recipes: image labels.")
@click.option("--epochs", type=int, default=None, help="Override every member's epochs (not a reproduction).")
@click.option("--batch-size", type=int, default=None, help="Override every member's batch size.")
@click.option("--train-split", "train_splits", multiple=True, help="Override the training splits.")
@click.option("--val-images", type=int, default=None, help="Override the validation images.")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Override a setting of every member that has it (e.g. --set embed_size=64).")
@click.option("--split", default="test", show_default=True, help="Evaluation split.")
@click.option("--device", default="auto", show_default=True)
@click.option("--allow-size-mismatch", is_flag=True,
              help="Evaluate a split whose size is not the protocol's (e.g. the synthetic data); recorded.")
@quiet_option
def reproduce_command(recipe, features, manifest, out, trees, concepts, concept_vectors, labels, epochs, batch_size,
                      train_splits, val_images, settings, split, device, allow_size_mismatch, quiet) -> None:
    """Train every member of RECIPE, evaluate it, and print measured beside published numbers.

    Finished members are skipped and interrupted ones resumed, so running the command again continues where
    it stopped. The report is also written to OUT/reproduce-RECIPE.json.

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
    log = lambda message: click.echo(message, err=True)  # noqa: E731
    report = reproduce(chosen, data, Path(out), overrides, split, device, allow_size_mismatch, quiet, log)
    for line in format_report(report):
        click.echo(line)
    click.echo(f"report written to {Path(out) / f'reproduce-{chosen.name}.json'}")


def markdown_table() -> str:
    """The README's table of recipes (``retr-train recipes --markdown``; a test keeps the README in step)."""
    lines = ["| recipe | published in | protocol | i2t R@1 / R@5 / R@10 | t2i R@1 / R@5 / R@10 | rSum | features |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in list_recipes():
        p = r.published
        lines.append(f"| `{r.name}` | {p.source} | {r.protocol} | {' / '.join(map(_fmt, p.i2t))} | "
                     f"{' / '.join(map(_fmt, p.t2i))} | {_fmt(p.rsum)} | `{r.features.extractor}` |")
    return "\n".join(lines)


@click.command("recipes")
@click.option("--json", "as_json", is_flag=True, help="Print the recipes as JSON.")
@click.option("--markdown", is_flag=True, help="Print the README's table.")
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
        click.echo(json.dumps([{"name": r.name, "title": r.title, "protocol": r.protocol,
                                "features": dataclasses.asdict(r.features),
                                "members": [{"run": m.run, "model": m.model, "preset": m.preset,
                                             "settings": dict(m.settings)} for m in r.members],
                                "published": _published(r.published)} for r in recipes], indent=2))
        return
    rows = [[r.name, r.protocol, _fmt(r.published.i2t[0]), _fmt(r.published.t2i[0]), _fmt(r.published.rsum),
             r.features.extractor, r.published.source] for r in recipes]
    header = ["recipe", "protocol", "i2t R@1", "t2i R@1", "rSum", "features", "published in"]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in [header, *rows]:
        click.echo("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
