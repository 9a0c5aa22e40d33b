"""``retr-train reproduce RECIPE`` and ``retr-train recipes``: a published row from one command.

``reproduce`` trains every member of a recipe (:mod:`retr.trainers.reproduction.recipes`) into ``OUT/<member run>`` — a
finished member with the recipe's settings and data is reused, an interrupted one resumed, one made otherwise
refused, and every member checked before the first trains — then evaluates each member alone and, for an
ensemble, the members together, and prints and writes (``OUT/reproduce-<recipe>.json``) the measured numbers
beside the published ones with their difference.

The report says ``reproduction: yes`` only when nothing departs from the recipe: no override, the feature set's
recorded provenance and the side files' attributes are the recipe's, and the split has the protocol's size.
Otherwise it says ``no`` with every reason (README, "What reproduction: yes guarantees").
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tabulate import tabulate

from retr.common.errors import UserError
from retr.common.paths import check_output_folder
from retr.manifests.schema import manifest_sha256, read_manifest
from retr.store.concepts import ConceptSet
from retr.store.features import ATTRS_BEFORE_RECORDED, FeatureSet
from retr.store.labels import read_label_attrs
from retr.store.trees import TreeSet
from retr.trainers.config import (RESUME_APPLIES, Difference, TrainConfig, setting_differences, setting_fields,
                                  settings_from_options)
from retr.trainers.data.pairing import check_manifest_pairing
from retr.trainers.evaluation.clip_zero_shot import check_clip_inputs, evaluate_clip
from retr.trainers.evaluation.metrics import check_evaluation_split
from retr.trainers.evaluation.reports import report_after_training
from retr.trainers.evaluation.runs import evaluate_runs
from retr.trainers.models import get_spec
from retr.trainers.reproduction.recipes import (FeatureProvenance, Member, Published, Recipe, accepts, list_recipes,
                                               said)
from retr.trainers.runs import checkpoint as ckpt
from retr.trainers.runs.layout import CONFIG
from retr.trainers.runs.resume import data_differences, data_identity
from retr.trainers.training import loop
from retr.trainers.training.preflight import check_feature_rows, check_training

logger = logging.getLogger(__name__)

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
    spec = get_spec(member.model)
    names = {f.name for f in dataclasses.fields(spec.config_class)} | {f.name for f in setting_fields(TrainConfig)}
    return {**member.settings, **{k: v for k, v in overrides.items() if k in names}}


def _check_overrides(recipe: Recipe, overrides: dict[str, Any]) -> None:
    if recipe.zero_shot is not None and overrides:
        raise UserError(f"{recipe.name} trains nothing (zero-shot): it has no setting to override")
    known = {f.name for f in setting_fields(TrainConfig)}
    for member in recipe.members:
        known |= {f.name for f in dataclasses.fields(get_spec(member.model).config_class)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise UserError(f"no member of {recipe.name} has the setting(s) {', '.join(unknown)}")


def member_state(run: Path) -> str:
    """``new`` (no checkpoint yet), ``finished`` (every epoch done, or stopped early), or ``interrupted``."""
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


#: settings a member run may hold other values of and still be the recipe's run: how it ran, not what it
#: computed (``resume_applies`` settings), except early stopping; ``epochs`` is compared apart (fewer: resumed)
_MAY_DIFFER = tuple(name for name in RESUME_APPLIES if name != "early_stop")


@dataclass
class PlannedMember:
    """One member of a recipe, before anything is trained: its settings, run folder and what is there."""

    member: Member
    cfg: TrainConfig
    run: Path
    state: str                  #: :func:`member_state`, or ``new`` for a folder without a config
    differences: list            #: :class:`~retr.trainers.runs.resume.Difference` s from ``cfg`` (empty: reusable)


def plan_member(member: Member, out: Path, data: dict, overrides: dict[str, Any], features,
                identities: dict) -> PlannedMember:
    """The member's settings (recipe + overrides) and how an existing run of it differs from them: every setting
    the model and the loop read (the ``resume_applies`` ones that only say how it ran aside), the data it was
    trained on (:func:`~retr.trainers.runs.resume.data_identity` of the opened ``features``; ``identities``
    keeps each one computed, by side files, so members sharing their data digest it once), and more epochs than
    asked."""
    spec = get_spec(member.model)
    run = out / member.run
    values = {"features": data["features"], "manifest": data["manifest"], "out": str(run), "preset": member.preset,
              **member_settings(member, overrides), "config": None}
    for side in spec.inputs:
        if data.get(side.name):
            values[side.name] = data[side.name]
    cfg = settings_from_options(spec, values, set(values) - {"config"})
    if not (run / CONFIG).is_file():
        return PlannedMember(member, cfg, run, "new", [])
    stored = ckpt.read_settings(run)
    if stored.model != cfg.model:
        return PlannedMember(member, cfg, run, "new", [Difference("model", cfg.model, stored.model)])
    differences = setting_differences(cfg, stored, _MAY_DIFFER)
    if stored.epochs > cfg.epochs:
        differences.append(Difference("epochs", repr(cfg.epochs), repr(stored.epochs)))
    key = tuple(sorted(cfg.inputs.items()))
    if key not in identities:
        identities[key] = data_identity(features, cfg.manifest, cfg.inputs)
    differences += data_differences(run, identities[key])
    return PlannedMember(member, cfg, run, member_state(run), differences)


def set_aside(run: Path) -> Path:
    """``--retrain``: move a member's run out of the way (nothing is deleted) and return where it went."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    target = run.with_name(f"{run.name}.replaced-{stamp}")
    run.rename(target)
    logger.warning(f"{run.name}: the earlier run moved to {target}")
    return target


def will_train(planned: PlannedMember) -> bool:
    """False for a finished member run that already has the epochs asked (it is reused as it is)."""
    return not (planned.state == "finished" and ckpt.read_config(planned.run).get("epochs", 0) >= planned.cfg.epochs)


def train_member(planned: PlannedMember, quiet: bool) -> Path:
    """Train (or resume, or skip) one planned member whose run holds no differences; returns its folder."""
    cfg, run, state = planned.cfg, planned.run, planned.state
    if not will_train(planned):
        logger.info(f"{planned.member.run}: finished, skipped (same settings and data)")
        return run
    resume = (run / CONFIG).is_file()
    logger.info(f"{planned.member.run}: {'resuming' if state != 'new' else 'training'} ({cfg.model}, preset {cfg.preset})")
    loop.train(cfg, resume=resume, quiet=quiet)
    spec = get_spec(cfg.model)
    if state != "finished":
        report_after_training(spec, run, cfg)
    return run


# ---------------------------------------------------------------------------------------------- provenance

def _attr(attrs: dict, key: str) -> Any:
    """A stored attribute; ``a.b`` reads key ``b`` of the JSON attribute ``a``; extraction settings recorded only
    since a later version read as what older sets were made with."""
    if "." in key:
        outer, inner = key.split(".", 1)
        value = attrs.get(outer)
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return None
        return value.get(inner) if isinstance(value, dict) else None
    if key not in attrs and key in ATTRS_BEFORE_RECORDED:
        return ATTRS_BEFORE_RECORDED[key]
    return attrs.get(key)


def _shown(value: Any) -> str:
    if value is None:
        return "not recorded"
    return value if isinstance(value, str) else json.dumps(value)


def feature_reasons(needed: FeatureProvenance, features, manifest_sha256: str) -> list[str]:
    """Why the feature set (a :class:`retr.store.features.FeatureSet`) is not the one the recipe's number came
    from: another extractor or shape, an importer the recipe does not accept, an extraction setting or weights
    other than the recipe's, or another manifest. Empty: it is."""
    attrs = features.attrs
    reasons = []
    if attrs.get("extractor") != needed.extractor:
        reasons.append(f"features: extractor {attrs.get('extractor')} (recipe {needed.extractor})")
    shape = tuple(int(x) for x in features.feature_shape)
    if shape != tuple(needed.shape):
        reasons.append(f"features: {'×'.join(map(str, shape))} per image (recipe {'×'.join(map(str, needed.shape))})")
    source = attrs.get("source")
    if source is not None:
        if source not in needed.imported:
            accepted = ", ".join(needed.imported) or "none"
            reasons.append(f"features: imported from {source} (recipe: extracted by retr, or imported from {accepted})")
    elif attrs.get("extractor") == needed.extractor:
        for key, wanted in needed.extracted.items():
            value = _attr(attrs, key)
            if not accepts(wanted, value):
                reasons.append(f"features: {key} {_shown(value)} (recipe {said(wanted)})")
    if attrs.get("manifest_sha256") != manifest_sha256:
        reasons.append("features: made from another manifest than --manifest")
    return reasons


def _input_attrs(name: str, path: str) -> dict:
    """The attributes a side file carries (labels: its ``#attrs``; trees and concepts: their root attributes)."""
    if name == "labels":
        return read_label_attrs(path)
    if name == "trees":
        return TreeSet(path).attrs
    return ConceptSet(path).attrs


def input_reasons(recipe: Recipe, data: dict, manifest_sha256: str) -> list[str]:
    """Why the side files given (JGCAR's labels, SMFEA's trees, concepts, concept vectors) are not the ones the
    recipe's number needs: absent (the model's fallback is named), built otherwise, or for another manifest."""
    reasons = []
    for name, needed in recipe.inputs.items():
        flag = f"--{name.replace('_', '-')}"
        path = data.get(name)
        if not path:
            reasons.append(f"no {flag}: {needed.without}")
            continue
        if not needed.attrs:
            continue
        attrs = _input_attrs(name, path)
        for key, wanted in needed.attrs.items():
            value = _attr(attrs, key)
            if not accepts(wanted, value):
                reasons.append(f"{flag}: {key} {_shown(value)} (recipe {said(wanted)})")
        if attrs.get("manifest_sha256") not in (None, manifest_sha256):
            reasons.append(f"{flag}: made from another manifest than --manifest")
    return reasons


def override_reasons(recipe: Recipe, overrides: dict[str, Any]) -> list[str]:
    """One reason per override: ``override embed_size 64 (recipe 1024)`` (the recipe's value as its first member
    resolves it)."""
    if not overrides:
        return []
    member = recipe.members[0]
    spec = get_spec(member.model)
    recipe_values = {**dataclasses.asdict(TrainConfig()), **spec.resolve_preset(member.preset, member.settings),
                     **member.settings}
    out = []
    for key, value in overrides.items():
        was = recipe_values.get(key)
        if isinstance(was, tuple):
            was = list(was)
        out.append(f"override {key} {_shown(value)} (recipe {_shown(was)})")
    return out


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
              device: str = "auto", allow_size_mismatch: bool = False, quiet: bool = False,
              retrain: tuple[str, ...] = (), verify: bool = True) -> dict:
    """Train every member, evaluate singles and the ensemble, compare with the published numbers, and say
    whether this was a reproduction (``reproduction``) and, if not, every reason why (``reasons``).

    A member run already in ``out`` is reused (or resumed) only when its stored settings and data equal the
    recipe's; otherwise nothing is trained and one line names each difference, unless ``retrain`` names the
    member (its run is then moved aside, see :func:`set_aside`).

    Every check runs before the first member trains: ``out``, the feature set's kind (the one its members' papers
    used: :func:`check_member_kinds`), the evaluation split (present, every image with features, the protocol's
    size unless ``allow_size_mismatch``), features against the manifest, and each member's training checks
    (:func:`preflight_members`); the zero-shot recipes' CLIP inputs likewise; then, unless ``verify`` is false,
    every row of the feature set against its stored checksum."""
    _check_overrides(recipe, overrides)
    unknown = sorted(set(retrain) - {m.run for m in recipe.members})
    if unknown:
        raise UserError(f"--retrain {unknown[0]}: not a member of {recipe.name} "
                        f"({', '.join(m.run for m in recipe.members)})")
    check_output_folder(out)
    if (out / f"reproduce-{recipe.name}.json").is_dir():
        raise UserError(f"{out / f'reproduce-{recipe.name}.json'} is a folder: the report cannot be written there")
    features = _check_data(data)
    check_member_kinds(recipe, features)
    manifest_digest = manifest_sha256(data["manifest"])
    reasons = [*recipe.unmet, *override_reasons(recipe, overrides)]
    reasons += feature_reasons(recipe.features, features, manifest_digest)
    reasons += input_reasons(recipe, data, manifest_digest)
    # the split every member and the ensemble are evaluated on, before any member trains
    check_evaluation_split(features, data["manifest"], split, recipe.protocol, allow_size_mismatch)
    identities: dict = {}
    planned = [plan_member(m, out, data, overrides, features, identities) for m in recipe.members]
    refused = [p for p in planned if p.differences and p.member.run not in retrain]
    if refused:
        raise UserError("; ".join(f"member {p.member.run} in {p.run} was trained otherwise: "
                                  f"{', '.join(f'{d.name} {d.stored} (recipe {d.given})' for d in p.differences)}"
                                  for p in refused)
                        + "; nothing was trained: pass --retrain MEMBER to train it again (the old run is kept "
                          "aside) or choose another --out")
    notes = check_manifest_pairing(features, data["manifest"]) + preflight_members(planned, features, retrain)
    if recipe.zero_shot is not None:
        notes += check_clip_inputs(features, data["manifest"], recipe.protocol, split, None, allow_size_mismatch)
    if verify:
        check_feature_rows(data["features"], "--features", quiet)
    for note in dict.fromkeys(notes):
        logger.warning(f"note: {note}")
    out.mkdir(parents=True, exist_ok=True)
    for p in planned:
        if p.member.run in retrain and p.run.exists():
            set_aside(p.run)
            p.state, p.differences = "new", []
    summary = features_summary(features.attrs)
    del features                     # the loop and the evaluator open the set themselves
    runs = [train_member(p, quiet) for p in planned]
    eval_args = dict(split=split, features=data["features"], manifest=data["manifest"], device=device,
                     quiet=True, allow_size_mismatch=allow_size_mismatch)
    rows, mismatch = [], None
    for member, run in zip(recipe.members, runs):
        result, _ = evaluate_runs([str(run)], recipe.protocol, **eval_args)
        mismatch = mismatch or result.get("size_mismatch")
        rows.append(compare("single", member.run, result, member.published if recipe.ensemble else recipe.published))
    if recipe.ensemble:
        result, _ = evaluate_runs([str(r) for r in runs], recipe.protocol, **eval_args)
        rows.append(compare("ensemble", " + ".join(m.run for m in recipe.members), result, recipe.published))
    if recipe.zero_shot is not None:
        result, _ = evaluate_clip(data["features"], data["manifest"], recipe.protocol, split, device=device,
                                  allow_size_mismatch=allow_size_mismatch, quiet=True, **recipe.zero_shot)
        mismatch = result.get("size_mismatch")
        rows.append(compare("zero-shot", f"CLIP {result['clip_model']} ({result['weights']})", result,
                            recipe.published))
    if mismatch:
        reasons.append(f"split size {mismatch['images']}, protocol {mismatch['expected']}")
    if split != "test":
        reasons.append(f"evaluated on split {split} (the published numbers are on test)")
    report = {"recipe": recipe.name, "title": recipe.title, "protocol": recipe.protocol, "split": split,
              "reproduction": not reasons, "reasons": reasons,
              "features": {"given": data["features"], "extractor": summary,
                           "needed": recipe.features.how},
              "overrides": overrides, "rows": rows,
              "runs": [str(r) for r in runs], "notes": recipe.notes,
              "size_mismatch": mismatch,
              "evaluated": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    ckpt.write_json(out / f"reproduce-{recipe.name}.json", report)
    return report


def check_member_kinds(recipe: Recipe, features) -> None:
    """Refuse a feature set of a kind the members' papers did not use (their specs' ``feature_kinds``): training
    on it may run, but it is no reproduction of the paper's row."""
    for member in recipe.members:
        kinds = get_spec(member.model).feature_kinds
        if kinds and features.kind not in kinds:
            raise UserError(f"{recipe.name}: {member.model}'s paper used {' or '.join(kinds)} features (the "
                            f"recipe's: {recipe.features.extractor}), --features {features.path} holds "
                            f"{features.kind} features; no reproduction trains on them (retr-train {member.model} "
                            "does, with a note)")


def preflight_members(planned: list[PlannedMember], features, retrain: tuple[str, ...] = ()) -> list[str]:
    """Every member's training checks (:func:`~retr.trainers.training.preflight.check_training`), all of them
    before the first member trains: a member that would fail fails now, with nothing trained. Returns the
    notes. A member named in ``retrain`` is checked as a new run; a finished one that is reused is not checked."""
    notes: list[str] = []
    for p in planned:
        if p.member.run not in retrain and not will_train(p):
            continue
        resume = p.member.run not in retrain and (p.run / CONFIG).is_file()
        notes += check_training(p.cfg, resume=resume, features=features)
    return notes


def features_summary(attrs: dict) -> dict:
    """What the report records of the feature set used (its attributes ``attrs``): extractor, weights (with the
    sha256 extraction recorded), source when imported, and the extraction settings."""
    keys = ("extractor", "weights", "source", "image_size", "short_side", "max_side", "detector_settings",
            "min_boxes", "max_boxes", "half", "half_precision", "autocast", "decode", "tf32", "detector_batch",
            "manifest_sha256")
    return {k: attrs[k] for k in keys if k in attrs}


def _check_data(data: dict):
    """Open the feature set and read the manifest before the first member starts (one error line, nothing
    trained, when either is the wrong kind of file); returns the opened feature set."""
    features = FeatureSet(data["features"])
    if not read_manifest(data["manifest"]):
        raise UserError(f"{data['manifest']} holds no images")
    return features


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _fmt_diff(value) -> str:
    return "" if value is None else f"{value:+.1f}"


def reproduction_line(report: dict) -> str:
    """``reproduction: yes``, or ``reproduction: no (N reasons): first; second; …``."""
    reasons = report.get("reasons") or []
    if report["reproduction"]:
        return "reproduction: yes"
    return f"reproduction: no ({len(reasons)} reason{'s' * (len(reasons) != 1)}): {'; '.join(reasons)}"


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

    lines = [reproduction_line(report),
             f"{report['recipe']} — {report['title']} ({report['protocol']} on {report['split']})"]
    lines += tabulate(table, headers=header, tablefmt="simple", disable_numparse=True,
                      colalign=("left", "left", *["right"] * 7)).splitlines()
    for row in report["rows"]:
        if "published" in row:
            lines.append(f"{row['kind']} {row['label']}: published in {row['published']['source']}")
    if report.get("notes"):
        lines.append(f"note: {report['notes']}")
    return lines


def provenance_json(recipe: Recipe) -> dict:
    """The provenance a recipe needs, as ``recipes --json`` prints it (each needed value in words)."""
    f = recipe.features
    return {"features": {"extractor": f.extractor, "shape": list(f.shape), "how": f.how,
                         "extracted": {k: said(v) for k, v in f.extracted.items()}, "imported": dict(f.imported)},
            "inputs": {name: {"attrs": {k: said(v) for k, v in need.attrs.items()}, "without": need.without,
                              "how": need.how} for name, need in recipe.inputs.items()}}


def markdown_table() -> str:
    """The table of recipes in docs/recipes.md (``retr-train recipes --markdown``; a test keeps the page in step)."""
    rows = [[f"`{r.name}`", r.published.source, r.protocol, " / ".join(map(_fmt, r.published.i2t)),
             " / ".join(map(_fmt, r.published.t2i)), _fmt(r.published.rsum), f"`{r.features.extractor}`"]
            for r in list_recipes()]
    return tabulate(rows, headers=["recipe", "published in", "protocol", "i2t R@1 / R@5 / R@10",
                                   "t2i R@1 / R@5 / R@10", "rSum", "features"],
                    tablefmt="github", disable_numparse=True)


