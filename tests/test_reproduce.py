"""Recipes: every published row's command, checked as data and run end to end on the synthetic data."""
from __future__ import annotations

import dataclasses
import json

import pytest

from retr.trainers.models import get_spec, preset
from retr.trainers.recipes import RECIPES

#: The authors' flags for SCAN (kuanghuei/SCAN README; reference/scan.md), written out here on purpose:
#: (dataset, direction, aggregation) → λ_softmax, λ_lse (None: AVG has none); dataset → epochs, lr, lr step.
AUTHORS_SCAN_FLAGS = {
    ("f30k", "t2i", "lse"): (9.0, 6.0), ("f30k", "t2i", "avg"): (9.0, None),
    ("f30k", "i2t", "lse"): (4.0, 5.0), ("f30k", "i2t", "avg"): (4.0, None),
    ("coco", "t2i", "lse"): (9.0, 6.0), ("coco", "t2i", "avg"): (9.0, None),
    ("coco", "i2t", "lse"): (4.0, 20.0), ("coco", "i2t", "avg"): (4.0, None),
}
AUTHORS_SCAN_SCHEDULE = {"f30k": (30, 2e-4, 15), "coco": (20, 5e-4, 10)}


@pytest.mark.parametrize("combination", sorted(AUTHORS_SCAN_FLAGS))
def test_scan_presets_equal_the_authors_flags(combination):
    dataset, direction, agg = combination
    lambda_softmax, lambda_lse = AUTHORS_SCAN_FLAGS[combination]
    epochs, lr, step = AUTHORS_SCAN_SCHEDULE[dataset]
    for values in (preset("scan", f"{dataset}-{direction}-{agg}"),
                   preset("scan", dataset, direction=direction, agg=agg)):
        assert (values["direction"], values["agg"], values["lambda_softmax"]) == (direction, agg, lambda_softmax)
        if lambda_lse is not None:
            assert values["lambda_lse"] == lambda_lse
        assert (values["epochs"], values["lr"], values["lr_update"]) == (epochs, lr, step)
        assert (values["margin"], values["batch_size"], values["grad_clip"]) == (0.2, 128, 2.0)
        assert values["max_violation"] is True and values["bi_gru"] is True
        assert (values["embed_size"], values["word_dim"], values["norm"]) == (1024, 300, "clipped_l2norm")


def test_scan_dataset_presets_pick_the_published_best_aggregation():
    """Flickr30K Table 1: t-i AVG 446.2 > LSE 434.1, i-t AVG 452.2 > LSE 451.4; COCO 1K Table 2: t-i AVG
    500.5 > LSE 489.3, i-t LSE (494.5; the 5K table's single model is i-t LSE)."""
    assert preset("scan", "f30k")["agg"] == "avg" and preset("scan", "f30k")["direction"] == "t2i"
    assert preset("scan", "f30k", direction="i2t")["agg"] == "avg"
    assert preset("scan", "coco", direction="t2i")["agg"] == "avg"
    assert preset("scan", "coco", direction="i2t")["agg"] == "lse"
    assert preset("scan", "coco", direction="i2t")["lambda_lse"] == 20.0
    assert preset("scan", "f30k", agg="max")["lambda_softmax"] == 9.0      # no published row: AVG's λ


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_is_runnable_data(name):
    from retr.trainers.evaluation import PROTOCOLS

    recipe = RECIPES[name]
    assert recipe.protocol in PROTOCOLS
    assert recipe.published.source and recipe.published.t2i[0] is not None
    for member in recipe.members:
        spec = get_spec(member.model)
        values = {**spec.resolve_preset(member.preset, member.settings), **member.settings}
        names = {f.name for f in dataclasses.fields(spec.config_class)}
        spec.make_config({k: v for k, v in values.items() if k in names})
    if recipe.ensemble:
        assert len({m.run for m in recipe.members}) == len(recipe.members)


def test_recipes_command_lists_every_recipe(run_cli):
    out = run_cli("train", "recipes").output
    for name in RECIPES:
        assert name in out
    listed = json.loads(run_cli("train", "recipes", "--json").output)
    assert {r["name"] for r in listed} == set(RECIPES)
    ensemble = next(r for r in listed if r["name"] == "scan-f30k-ensemble")
    assert ensemble["published"]["rsum"] == 465.0 and len(ensemble["members"]) == 2


@pytest.mark.slow
def test_reproduce_runs_an_ensemble_and_a_single_recipe_end_to_end(tmp_path, run_cli):
    from trainer_synthetic import make_synthetic

    manifest, features = make_synthetic(tmp_path / "s", images=40, seed=0)
    out = tmp_path / "runs"
    small = ["--features", features, "--manifest", manifest, "--out", out, "--epochs", "1", "--batch-size", "16",
             "--train-split", "train", "--val-images", "0", "--set", "embed_size=16", "--set", "word_dim=8",
             "--allow-size-mismatch", "--device", "cpu", "--quiet"]
    first = run_cli("train", "reproduce", "scan-f30k-ensemble", *small)
    report = json.loads((out / "reproduce-scan-f30k-ensemble.json").read_text())
    assert [r["kind"] for r in report["rows"]] == ["single", "single", "ensemble"]
    assert report["overrides"]["epochs"] == 1 and report["reproduction"] is False
    for row in report["rows"]:
        for side in ("i2t", "t2i"):
            for k in ("r1", "r5", "r10"):
                assert row["difference"][side][k] == pytest.approx(
                    round(row["measured"][side][k] - row["published"][side][k], 2))
    assert report["rows"][2]["published"]["rsum"] == 465.0
    assert (out / "scan-f30k-t2i-avg" / "best.pt").is_file() and (out / "scan-f30k-i2t-lse" / "best.pt").is_file()
    assert "ensemble: scan-f30k-t2i-avg + scan-f30k-i2t-lse" in first.output and "published" in first.output
    # the ensemble row is `retr-train eval` of the two members
    run_cli("train", "eval", out / "scan-f30k-t2i-avg", out / "scan-f30k-i2t-lse", "--protocol", "f30k-1k",
            "--allow-size-mismatch", "--device", "cpu", "--quiet")
    stored = json.loads((out / "scan-f30k-t2i-avg" / "eval.json").read_text())["results"]
    together = next(r for r in stored if r["ensemble"])
    assert together["rsum"] == pytest.approx(report["rows"][2]["measured"]["rsum"], abs=1e-9)
    # again: both members are finished and skipped, the numbers are the same
    again = run_cli("train", "reproduce", "scan-f30k-ensemble", *small)
    assert again.output.count("finished, skipped") == 2
    assert json.loads((out / "reproduce-scan-f30k-ensemble.json").read_text())["rows"][2]["measured"] == \
        report["rows"][2]["measured"]
    # a single-model recipe reuses the member run the ensemble trained
    single = run_cli("train", "reproduce", "scan-f30k-t2i-avg", *small)
    assert "finished, skipped" in single.output
    one = json.loads((out / "reproduce-scan-f30k-t2i-avg.json").read_text())
    assert [r["kind"] for r in one["rows"]] == ["single"] and one["rows"][0]["published"]["rsum"] == 446.2
    # more epochs: the finished member is resumed, not retrained
    longer = [*small]
    longer[longer.index("--epochs") + 1] = "2"
    resumed = run_cli("train", "reproduce", "scan-f30k-t2i-avg", *longer)
    assert "resuming" in resumed.output
    metrics = [json.loads(line) for line in (out / "scan-f30k-t2i-avg" / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics if "val" in m] == [1, 2]


def test_reproduce_refuses_settings_no_member_has(tmp_path, run_cli):
    result = run_cli("train", "reproduce", "scan-f30k-t2i-avg", "--features", tmp_path / "f.h5", "--manifest",
                     tmp_path / "m.jsonl", "--out", tmp_path / "o", "--set", "gamma=3", ok=False)
    assert "no member of scan-f30k-t2i-avg has the setting(s) gamma" in str(result.exception)


def test_readme_table_is_the_recipes_table():
    from pathlib import Path

    from retr.trainers.reproduce import markdown_table

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    assert markdown_table() in readme, "README's recipe table is stale: paste `retr-train recipes --markdown`"
    assert readme.index("## Reproduce a paper's row") < readme.index("## Two commands")
