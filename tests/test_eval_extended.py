"""``retr-train eval --extended``, ``eval-sims``, ``table --extended`` and an export's card, as a user runs them: a
run trained on the synthetic data, evaluated on a COCO 5K test split (the real 5,000 test images' ids and their
25,000 COCO caption ids, with made-up captions and features of the run's shape); and every wrong input of the
extended evaluation refused in one line with nothing written."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from retr.manifests.schema import ManifestRecord, write_manifest
from retr.manifests.synthetic import COLOURS, SHAPES, SIZES
from retr.store.features import ShardWriter, shard_name, write_index
from retr.trainers.evaluation import coco_extended
from test_pipeline_wrong_inputs import assert_one_error_line
from trainer_synthetic import D, K

TINY = ["--embed-size", "16", "--word-dim", "8", "--batch-size", "16", "--quiet", "--val-images", "10",
        "--device", "cpu", "--epochs", "1"]


def _coco_test_split(folder: Path, with_ids: bool = True) -> tuple[Path, Path]:
    """A manifest of Karpathy's COCO 5K test split (its ids, in Karpathy's order, each caption's COCO caption id
    unless ``with_ids`` is False) with captions in the synthetic data's words, and a feature set of the synthetic
    run's shape for its images."""
    annotations = coco_extended.load_annotations()
    rng = np.random.default_rng(0)
    colours = list(COLOURS)

    def caption() -> str:
        a, b = (f"{rng.choice(SIZES)} {rng.choice(colours)} {rng.choice(SHAPES)}" for _ in range(2))
        return f"a {a} to the {rng.choice(['left', 'right'])} of a {b}"

    ids = annotations.caption_ids.reshape(5000, 5)
    records = [ManifestRecord(f"coco_{image}", f"val2014/COCO_val2014_{image:012d}.jpg", "test",
                              tuple(caption() for _ in range(5)),
                              caption_ids=tuple(int(c) for c in ids[n]) if with_ids else None)
               for n, image in enumerate(annotations.image_ids.tolist())]
    manifest = folder / ("manifest.jsonl" if with_ids else "manifest-without-ids.jsonl")
    write_manifest(manifest, records)
    features = folder / "coco-regions.h5"
    if not features.is_file():
        attrs = dict(kind="regions", extractor="coco-regions", backbone="random", weights="random", image_size=224,
                     manifest_sha256="0" * 64)
        path = folder / "coco-regions" / shard_name(0, 1)
        with ShardWriter(path, attrs, (K, D), extras={"num_boxes": ((), "int32")}, shard_index=0,
                         num_shards=1) as writer:
            writer.append([r.id for r in records], rng.standard_normal((5000, K, D)).astype(np.float32),
                          num_boxes=np.full(5000, K, dtype=np.int32))
        write_index(features, [path])
    return manifest, features


@pytest.fixture(scope="module")
def coco(synthetic_run, tmp_path_factory):
    """(run, manifest, features, folder): this module's copy of a synthetic run, and the COCO 5K test data."""
    folder = tmp_path_factory.mktemp("eval_extended")
    run = synthetic_run("vsepp", *TINY, copy_to=folder / "run")
    manifest, features = _coco_test_split(folder)
    _coco_test_split(folder, with_ids=False)
    return run, manifest, features, folder


def _eval(run_cli, run, manifest, features, *args):
    return run_cli.as_user("train", "eval", run, "--features", features, "--manifest", manifest, "--device", "cpu",
                           "--quiet", *args)


@pytest.fixture(scope="module")
def evaluated(coco, tmp_path_factory):
    """(result, sims): ``eval RUN --protocol coco-5k --extended --json --save-sims`` of this module's run."""
    from conftest import CliRunnerHelper

    run, manifest, features, _ = coco
    sims = tmp_path_factory.mktemp("eval_extended_sims") / "sims.npy"
    code, stdout, stderr = _eval(CliRunnerHelper(), run, manifest, features, "--protocol", "coco-5k", "--extended",
                                 "--json", "--save-sims", sims)
    assert code == 0, stderr
    return json.loads(stdout), sims


@pytest.mark.slow
def test_eval_extended_reports_every_number_in_json_eval_json_sims_table_and_card(coco, evaluated, run_cli,
                                                                                    tmp_path):
    run, manifest, features, _ = coco
    result, sims = evaluated
    extended = result["extended"]
    assert list(extended) == list(coco_extended.METRIC_NAMES)            # the keys compute_all_metrics uses
    assert all(set(v) == {"i2t", "t2i"} and all(0 <= x <= 100 for x in v.values()) for v in extended.values())
    assert result["extended_annotations"].startswith("eccv-caption ") and result["ties"] == "pessimistic"
    for d in ("i2t", "t2i"):                                              # COCO 5K twice from one matrix
        assert extended["coco_5k_r1"][d] == pytest.approx(result[d]["r1"], abs=1e-9)
    stored = json.loads((run / "eval.json").read_text())["results"]
    assert [r["extended"] for r in stored if r["protocol"] == "coco-5k"] == [extended]
    # --save-sims records each column's COCO caption id; eval-sims scores the saved matrix to the same numbers
    ids = json.loads(Path(f"{sims}.ids.json").read_text())
    assert ids["caption_ids"] == [int(c) for c in coco_extended.load_annotations().caption_ids]
    code, stdout, stderr = run_cli.as_user("train", "eval-sims", sims, "--extended", "--json")
    assert code == 0, stderr
    saved = json.loads(stdout)
    assert saved["extended"] == extended
    assert [r["protocol"] for r in saved["results"]] == ["coco-1k", "coco-5k", "coco-1k-first"]
    assert {k: saved["results"][1][k] for k in ("i2t", "t2i", "rsum")} == {k: result[k] for k in ("i2t", "t2i", "rsum")}
    # a matrix without an ids file (another code base's): rows and columns are the manifest's split, in file order
    bare = tmp_path / "bare.npy"
    bare.write_bytes(sims.read_bytes())
    code, stdout, stderr = run_cli.as_user("train", "eval-sims", bare, "--manifest", manifest, "--protocol", "coco-5k",
                                           "--extended", "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["extended"] == extended and json.loads(stdout)["ids"] == f"split test of {manifest}"
    # the table: the recalls, a note naming --extended, and the extended numbers with --extended
    code, stdout, _ = run_cli.as_user("train", "table", run)
    assert code == 0 and stdout.splitlines()[-1] == ("ECCV Caption and CxC numbers of --extended results: "
                                                     "retr-train table --extended")
    code, stdout, _ = run_cli.as_user("train", "table", run, "--extended", "--format", "csv")
    header, row = stdout.splitlines()
    assert header.split(",")[7:] == [f"{d} {coco_extended.METRIC_LABELS[n]}" for n in coco_extended.TABLE_METRICS
                                     for d in ("i2t", "t2i")]
    assert [float(x) for x in row.split(",")[7:]] == [extended[n][d] for n in coco_extended.TABLE_METRICS
                                                      for d in ("i2t", "t2i")]
    # the report: its numbers with --extended (from the saved matrix), and the stored results' second table
    code, stdout, stderr = run_cli.as_user("train", "show", run, "--protocol", "coco-5k", "--extended", "--sims", sims,
                                           "--features", features, "--manifest", manifest, "--samples", "1",
                                           "--attention", "0", "--device", "cpu", "--out", tmp_path / "report",
                                           "--quiet")
    assert code == 0, stderr
    page = (tmp_path / "report" / "index.html").read_text()
    assert "COCO 5K test, every true match counted" in page and "ECCV mAP@R" in page
    assert f"<td>{extended['eccv_map_at_r']['i2t']:.1f}</td>" in page
    assert "ECCV Caption and CxC (eval --extended): every true match counted" in page and "i2t ECCV mAP@R" in page
    # an export's card
    code, _, stderr = run_cli.as_user("train", "export", run, "--out", tmp_path / "export")
    assert code == 0, stderr
    card = (tmp_path / "export" / "README.md").read_text()
    assert "- map@r" in card.split("---\n")[1] and "### Every true match counted: ECCV Caption and CxC" in card
    assert f"{extended['eccv_map_at_r']['i2t']:.1f}" in card.split("### Every true match counted")[1]


@pytest.mark.slow
def test_an_ensemble_prints_the_extended_table_under_its_numbers(coco, evaluated, run_cli, tmp_path):
    import shutil

    run, manifest, features, _ = coco
    first, second = tmp_path / "first", tmp_path / "second"         # eval records into its runs: copies
    shutil.copytree(run, first)
    shutil.copytree(run, second)
    code, stdout, stderr = run_cli.as_user("train", "eval", first, second, "--features", features, "--manifest",
                                           manifest, "--device", "cpu", "--quiet", "--protocol", "coco-5k",
                                           "--extended")
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert lines[0].startswith("coco-5k on test (5000 images, 25000 captions) — ensemble of 2 runs")
    head = lines.index("COCO 5K test, every true match counted (ECCV Caption, CxC; eccv-caption "
                       f"{coco_extended.load_annotations().version}; ties: pessimistic):")
    assert lines[head + 1].split() == ["ECCV", "mAP@R", "ECCV", "R-P", "ECCV", "R@1", "CxC", "R@1", "CxC", "R@5",
                                       "CxC", "R@10", "1K", "R@1", "1K", "R@5", "1K", "R@10", "5K", "R@1", "5K",
                                       "R@5", "5K", "R@10"]
    # two copies of one run average to its own matrix: the single run's numbers, one row per direction
    single = evaluated[0]["extended"]
    for line, side in zip(lines[head + 3:head + 5], ("i2t", "t2i")):
        assert line.split() == [side, *(f"{single[name][side]:.1f}" for name in coco_extended.METRIC_NAMES)]


# ------------------------------------------------------------------------------------------------ wrong inputs

def _nothing_written(run: Path, before: bytes | None, *paths: Path) -> None:
    eval_json = run / "eval.json"
    assert (eval_json.read_bytes() if eval_json.is_file() else None) == before
    assert not any(p.exists() for p in paths)


def test_wrong_inputs_of_the_extended_evaluation_are_one_line_each_and_write_nothing(coco, run_cli, tmp_path,
                                                                                       monkeypatch):
    run, manifest, features, folder = coco
    before = (run / "eval.json").read_bytes() if (run / "eval.json").is_file() else None
    sims = tmp_path / "sims.npy"
    cases = {
        "a Flickr30K protocol": (["--protocol", "f30k-1k", "--extended", "--allow-size-mismatch"], manifest,
                                 "error: --extended scores the COCO 5K test set (ECCV Caption, CxC); --protocol "
                                 "f30k-1k is not a COCO protocol"),
        "a manifest without caption ids": (["--protocol", "coco-5k", "--extended"],
                                           folder / "manifest-without-ids.jsonl",
                                           "have no COCO caption id (first: coco_391895#0); --extended needs them: "
                                           "`retr-pipeline manifest coco-caption-ids "),
    }
    for what, (args, given, expected) in cases.items():
        code, stdout, stderr = _eval(run_cli, run, given, features, *args, "--save-sims", sims)
        assert_one_error_line(code, stdout, stderr)
        assert expected in stderr, (what, stderr)
        _nothing_written(run, before, sims, Path(f"{sims}.ids.json"))
    # a two-step run alone (JGCAR re-ranks a shortlist per direction): refused from its settings, before its
    # checkpoint is read (this one has none)
    two_step = tmp_path / "jgcar"
    two_step.mkdir()
    (two_step / "config.json").write_text(json.dumps({"model": "jgcar", "model_args": {"shortlist": 100},
                                                      "manifest": str(manifest), "features": str(features)}))
    code, stdout, stderr = _eval(run_cli, two_step, manifest, features, "--protocol", "coco-5k", "--extended")
    assert_one_error_line(code, stdout, stderr)
    assert "error: --extended ranks one similarity matrix; a two-step run re-ranks a shortlist" in stderr
    assert sorted(p.name for p in two_step.iterdir()) == ["config.json"]
    # the package missing: one line naming the extra, before any run is opened
    monkeypatch.setitem(sys.modules, "eccv_caption", None)
    code, stdout, stderr = _eval(run_cli, run, manifest, features, "--protocol", "coco-5k", "--extended")
    assert_one_error_line(code, stdout, stderr)
    assert stderr == ("error: eccv-caption is not installed (needed by --extended: the ECCV Caption and CxC "
                      "annotations): pip install 'retr[eccv]' (or make setup)\n")
    _nothing_written(run, before)


def test_eval_sims_refuses_another_shape_and_ids_that_are_not_the_5k_test_set(coco, run_cli, tmp_path):
    _, manifest, _, _ = coco
    rng = np.random.default_rng(0)
    ids = {"image_ids": [], "caption_keys": []}
    for line in manifest.read_text().splitlines():
        record = json.loads(line)
        ids["image_ids"].append(record["id"])
        ids["caption_keys"] += [f"{record['id']}#{n}" for n in range(5)]
    shape = tmp_path / "shape.npy"
    np.save(shape, rng.random((5000, 24999)))
    Path(f"{shape}.ids.json").write_text(json.dumps(ids))
    code, stdout, stderr = run_cli.as_user("train", "eval-sims", shape, "--extended", "--manifest", manifest)
    assert_one_error_line(code, stdout, stderr)
    assert f"error: {shape} is a 5,000 × 24,999 matrix, but {shape}.ids.json names 5,000 images × 25,000 captions" \
        in stderr
    # the first 1,000 images of the test split: another set than COCO 5K's, even with a size it has a protocol for
    part = tmp_path / "part.npy"
    np.save(part, rng.random((1000, 5000)))
    Path(f"{part}.ids.json").write_text(json.dumps({"image_ids": ids["image_ids"][:1000],
                                                    "caption_keys": ids["caption_keys"][:5000]}))
    code, stdout, stderr = run_cli.as_user("train", "eval-sims", part, "--extended", "--manifest", manifest,
                                           "--protocol", "coco-5k", "--allow-size-mismatch")
    assert_one_error_line(code, stdout, stderr)
    assert "1,000 images and 5,000 captions; --extended scores the COCO 5K test set (5,000 images, 25,000 captions)" \
        in stderr
    # without --extended the same matrix scores with the protocol its size fits
    code, stdout, stderr = run_cli.as_user("train", "eval-sims", part, "--json")
    assert code == 0 and [r["protocol"] for r in json.loads(stdout)["results"]] == ["f30k-1k"]
    # no ids at all
    bare = tmp_path / "bare.npy"
    np.save(bare, rng.random((3, 15)))
    code, stdout, stderr = run_cli.as_user("train", "eval-sims", bare)
    assert_one_error_line(code, stdout, stderr)
    assert "has no bare.npy.ids.json beside it; give --ids FILE, or --manifest" in stderr
