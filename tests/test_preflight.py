"""Every check before any work (``trainers/training/preflight.py``): ``retr-train MODEL``, ``reproduce`` and
``eval-clip`` refuse what would fail — the protocol's split size, a member's side files or word vectors, the
output folder, features paired with another dataset's manifest, a weights file that would be ignored — in one
line, with a non-zero exit, before the first training step or caption encoding. The training function is
replaced by a recorder here, so each refusal also proves that nothing trained."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import pytest

from retr.manifests.schema import manifest_sha256, read_manifest, write_manifest
from test_clip_zero_shot import clip_set  # noqa: F401  (the module-scoped clip feature set)
from test_pipeline_wrong_inputs import KINDS, assert_one_error_line

TINY = ["--embed-size", "16", "--word-dim", "8", "--batch-size", "16", "--quiet", "--val-images", "10",
        "--device", "cpu", "--epochs", "1"]


@pytest.fixture
def trainings(monkeypatch):
    """The calls of the training loop (``retr.trainers.training.loop.train``), which records and trains nothing:
    a command that refused before any work leaves the list empty."""
    from retr.trainers.training import loop

    calls = []
    monkeypatch.setattr(loop, "train", lambda cfg, **kw: calls.append((cfg, kw)) or {})
    return calls


def record_manifest(features: Path, manifest: Path) -> None:
    """Record ``manifest``'s SHA-256 in the feature set (its index and shards), as extraction does."""
    digest = manifest_sha256(manifest)
    with h5py.File(features, "r+") as f:
        f.attrs["manifest_sha256"] = digest
        shards = json.loads(f.attrs["shards"])
    for shard in shards:
        with h5py.File(features.parent / shard["file"], "r+") as f:
            f.attrs["manifest_sha256"] = digest


@pytest.fixture(scope="module")
def two_sets(synthetic_data, tmp_path_factory):
    """Two synthetic datasets with the same ids and relative paths but other images (seeds 0 and 1); the first's
    feature set records its manifest's SHA-256, as an extracted one does (so this module has its own copy)."""
    manifest, features = synthetic_data(images=40, seed=0, copy_to=tmp_path_factory.mktemp("preflight") / "a")
    record_manifest(features, manifest)
    other, _ = synthetic_data(images=40, seed=1)
    return manifest, features, other


def nothing_written(folder: Path) -> bool:
    return not folder.exists() or not any(folder.rglob("*"))


# ------------------------------------------------------------------------------------------------ reproduce

def test_reproduce_refuses_the_split_size_before_training(two_sets, run_cli, trainings, tmp_path):
    manifest, features, _ = two_sets
    out = tmp_path / "runs"
    code, stdout, stderr = run_cli.as_user("train", "reproduce", "scan-f30k-t2i-avg", "--features", features,
                                           "--manifest", manifest, "--out", out, "--epochs", "1", "--device", "cpu")
    assert_one_error_line(code, stdout, stderr)
    assert "f30k-1k expects a split of 1000 images, this one has 4" in stderr
    assert trainings == [] and nothing_written(out)


def _two_member_recipe(name: str, second) -> object:
    """A recipe whose first member (VSE++) can train and whose second (``second``) cannot."""
    from retr.trainers.reproduction.recipes import BUTD, Member, Published, Recipe

    return Recipe(name, "a test ensemble", BUTD, (Member("first-vsepp", "vsepp", "f30k"), second), "f30k-1k",
                  Published((1.0, 2.0, 3.0), (1.0, 2.0, 3.0), "a test"))


@pytest.mark.parametrize("second, extra, reason", [
    (("scan", "f30k", {"word_vectors": "glove"}), [], "glove.840B.300d.zip"),
    (("jgcar", "f30k", {"num_regions": 4}), ["--labels", "LABELS"], "training image(s) have no entry in"),
])
def test_reproduce_checks_every_member_before_the_first_trains(two_sets, run_cli, trainings, tmp_path,
                                                               monkeypatch, second, extra, reason):
    """The second member's word vectors are not on disk (offline) / its labels lack the training images: refused
    before the first member, which could train, starts. (JGCAR's paper used VGG-16 maps, and a reproduction on
    regions is refused for that first: here its spec takes any kind, so that the labels are what is checked.)"""
    import dataclasses

    from retr.store.labels import write_label_file
    from retr.trainers.models import registry
    from retr.trainers.reproduction.recipes import RECIPES, Member

    manifest, features, _ = two_sets
    model, preset_name, settings = second
    monkeypatch.setitem(registry._SPECS, model, dataclasses.replace(registry.get_spec(model), feature_kinds=()))
    monkeypatch.setitem(RECIPES, "test-two", _two_member_recipe("test-two", Member("second", model, preset_name,
                                                                                  settings)))
    labels = tmp_path / "labels.json"
    write_label_file(labels, {"synth_00000": ["circle"]}, {"source": "test"})
    out = tmp_path / "runs"
    code, stdout, stderr = run_cli.as_user("train", "reproduce", "test-two", "--features", features, "--manifest",
                                           manifest, "--out", out, "--epochs", "1", "--allow-size-mismatch",
                                           "--device", "cpu", *[labels if a == "LABELS" else a for a in extra])
    assert_one_error_line(code, stdout, stderr)
    assert reason in stderr
    assert trainings == [] and nothing_written(out)


def test_reproduce_refuses_an_output_folder_below_a_file(two_sets, run_cli, trainings, tmp_path):
    manifest, features, _ = two_sets
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, stdout, stderr = run_cli.as_user("train", "reproduce", "scan-f30k-t2i-avg", "--features", features,
                                           "--manifest", manifest, "--out", blocker / "runs", "--allow-size-mismatch")
    assert_one_error_line(code, stdout, stderr)
    assert f"{blocker} is a file, so the folder cannot be made" in stderr
    assert trainings == [] and blocker.read_text() == "x"


def test_a_misspelled_recipe_names_the_closest_ones(two_sets, run_cli, tmp_path):
    manifest, features, _ = two_sets
    code, stdout, stderr = run_cli.as_user("train", "reproduce", "scan-f30k-t2i-agv", "--features", features,
                                           "--manifest", manifest, "--out", tmp_path / "o")
    assert_one_error_line(code, stdout, stderr)
    assert "unknown recipe 'scan-f30k-t2i-agv' (did you mean scan-f30k-t2i-avg" in stderr
    code, _, stderr = run_cli.as_user("train", "reproduce", "zzzz", "--features", features, "--manifest",
                                      manifest, "--out", tmp_path / "o")
    assert code == 1 and "did you mean" not in stderr


def test_reproduce_runs_when_every_check_passes(two_sets, run_cli, trainings, tmp_path, monkeypatch):
    """The checks pass the synthetic data with --allow-size-mismatch: each member is handed to the loop (the
    recorder), in order — so the refusals above are the checks', not a broken setup's."""
    from retr.trainers.reproduction import reproduce as module

    manifest, features, _ = two_sets
    monkeypatch.setattr(module, "train_member", lambda planned, quiet: (trainings.append(planned.member.run),
                                                                        planned.run)[1])
    monkeypatch.setattr(module, "evaluate_runs",
                        lambda runs, protocol, **kw: ({side: {k: 0.0 for k in ("r1", "r5", "r10")}
                                                       for side in ("i2t", "t2i")} | {"rsum": 0.0}, None))
    run_cli("train", "reproduce", "scan-f30k-ensemble", "--features", features, "--manifest", manifest, "--out",
            tmp_path / "runs", "--epochs", "1", "--allow-size-mismatch", "--device", "cpu", "--quiet")
    assert trainings == ["scan-f30k-t2i-avg", "scan-f30k-i2t-lse"]


# ------------------------------------------------------------------------------------- features ↔ manifest

def test_features_with_another_datasets_manifest_are_refused(two_sets, run_cli, trainings, tmp_path):
    """Same ids and relative paths, other image files: the feature set records another manifest's SHA-256, the
    manifest it was made from lies beside it, and its images are not --manifest's."""
    manifest, features, other = two_sets
    out = tmp_path / "run"
    code, stdout, stderr = run_cli.as_user("train", "vse-infinity", "--features", features, "--manifest", other,
                                           "--out", out, *TINY)
    assert_one_error_line(code, stdout, stderr)
    assert f"{other} names other images than {features} was made from ({manifest})" in stderr
    assert "other image files (first: synth_" in stderr
    assert trainings == [] and nothing_written(out)


def test_a_manifest_whose_paths_moved_is_refused(two_sets, run_cli, trainings, tmp_path):
    manifest, features, _ = two_sets
    records = read_manifest(manifest)
    moved = tmp_path / "moved.jsonl"
    write_manifest(moved, [type(r)(r.id, r.path.replace("synth_", "other_"), r.split, r.captions) for r in records])
    code, stdout, stderr = run_cli.as_user("train", "vsepp", "--features", features, "--manifest", moved, "--out",
                                           tmp_path / "run", *TINY)
    assert_one_error_line(code, stdout, stderr)
    assert "40 shared id(s) have another path (first: synth_00000 is images/other_00000.jpg here" in stderr
    assert trainings == []


def test_only_other_captions_train_with_one_note(two_sets, run_cli, trainings, tmp_path):
    """The same images (the same paths, beside the same files) with one caption edited: one note, then training."""
    manifest, features, _ = two_sets
    records = read_manifest(manifest)
    edited = manifest.parent / "edited.jsonl"
    write_manifest(edited, [r if i else type(r)(r.id, r.path, r.split, ("a new caption", *r.captions[1:]))
                            for i, r in enumerate(records)])
    try:
        run_cli("train", "vsepp", "--features", features, "--manifest", edited, "--out", tmp_path / "run", *TINY)
    finally:
        edited.unlink()
    (cfg, kwargs), = trainings
    notes = [n for n in kwargs["notes"] if "is not the manifest" in n]
    assert notes == [f"note: {edited} is not the manifest {features} was made from ({manifest}), but its 40 shared "
                     f"ids name the same images; 1 have other captions and 0 another split: using {edited}'s"]
    assert cfg.manifest == str(edited)


def test_the_same_manifest_and_unrecorded_ones_give_no_note(two_sets, tmp_path, make_feature_set):
    from retr.store.features import FeatureSet
    from retr.trainers.data.pairing import check_manifest_pairing

    manifest, features, other = two_sets
    assert check_manifest_pairing(FeatureSet(features), manifest) == []
    copy = tmp_path / "copy.jsonl"                  # the same bytes elsewhere: the same SHA-256
    shutil.copy(manifest, copy)
    assert check_manifest_pairing(FeatureSet(features), copy) == []
    unrecorded, _ = make_feature_set(num_shards=1, rows_per_shard=2, shape=(4, 8))   # manifest_sha256 0…0
    assert check_manifest_pairing(FeatureSet(unrecorded), other) == []


def test_a_source_manifest_that_cannot_be_found_is_a_note(two_sets, tmp_path):
    from retr.store.features import FeatureSet
    from retr.trainers.data.pairing import check_manifest_pairing

    manifest, features, other = two_sets
    moved = tmp_path / "features"
    shutil.copytree(features.parent, moved, ignore=shutil.ignore_patterns("*.jsonl", "images"))
    (note,) = check_manifest_pairing(FeatureSet(moved / features.name), other)
    assert "was made from another manifest than" in note and "cannot be checked" in note


# ------------------------------------------------------------------------------------------------- --resume

def _models() -> list[str]:
    from retr.trainers.models.registry import list_models

    return list(list_models())


@pytest.mark.parametrize("model", _models())
def test_resume_without_a_run_says_there_is_none(run_cli, tmp_path, model, trainings):
    code, stdout, stderr = run_cli.as_user("train", model, "--resume", "--out", tmp_path / "runs" / "nope")
    assert_one_error_line(code, stdout, stderr)
    assert f"nothing to resume in {tmp_path / 'runs' / 'nope'}: no run there" in stderr
    assert trainings == [] and not (tmp_path / "runs").exists()


def test_resume_with_the_whole_command_still_starts_a_run_that_never_wrote_its_settings(two_sets, run_cli,
                                                                                           trainings, tmp_path):
    """A requeued job passes --resume with its whole command: a run killed before config.json starts."""
    manifest, features, _ = two_sets
    result = run_cli("train", "vsepp", "--resume", "--features", features, "--manifest", manifest, "--out",
                     tmp_path / "run", *TINY)
    assert "nothing to resume" in result.output and len(trainings) == 1 and trainings[0][1]["resume"] is False


@pytest.mark.parametrize("model, extra, reason", [
    ("vse-infinity", ["--word-vectors", "glove", "--word-dim", "300"], "glove.840B.300d.zip"),
    ("jgcar", ["--labels", "LABELS", "--num-regions", "4"], "training image(s) have no entry in"),
])
def test_train_checks_side_files_and_word_vectors_first(two_sets, run_cli, trainings, tmp_path, model, extra,
                                                        reason):
    """GloVe not on disk (offline) / labels for one training image only: one line, the loop never called."""
    from retr.store.labels import write_label_file

    manifest, features, _ = two_sets
    labels = tmp_path / "labels.json"
    first = next(r.id for r in read_manifest(manifest) if r.split == "train")
    write_label_file(labels, {first: ["circle"]}, {"source": "test"})
    out = tmp_path / "run"
    code, stdout, stderr = run_cli.as_user("train", model, "--features", features, "--manifest", manifest, "--out",
                                           out, *TINY, *[labels if a == "LABELS" else a for a in extra])
    assert_one_error_line(code, stdout, stderr)
    assert reason in stderr and trainings == [] and nothing_written(out)


# ------------------------------------------------------------------------------------------------ eval-clip

@pytest.fixture
def encodings(monkeypatch):
    """Calls of the CLIP text tower's encoding: a refusal before any work leaves it empty."""
    from retr.trainers.evaluation import clip_zero_shot

    calls = []
    real = clip_zero_shot.text_embeddings
    monkeypatch.setattr(clip_zero_shot, "text_embeddings", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def test_eval_clip_refuses_a_weights_file_it_would_ignore(clip_set, run_cli, encodings, tmp_path):  # noqa: F811
    manifest, features = clip_set
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"not the weights")
    code, stdout, stderr = run_cli.as_user("train", "eval-clip", "--features", features, "--manifest", manifest,
                                           "--protocol", "f30k-1k", "--allow-size-mismatch", "--weights", weights)
    assert_one_error_line(code, stdout, stderr)
    assert f"was extracted from a randomly initialised CLIP, not from a file: --weights {weights} would be ignored" \
        in stderr and encodings == []


def test_eval_clip_refuses_another_datasets_manifest(clip_set, run_cli, encodings, tmp_path):  # noqa: F811
    """One test image of another synthetic dataset with an id of the set: formerly R@1 100 without a word."""
    from retr.manifests.synthetic import generate_synthetic

    manifest, features = clip_set
    generate_synthetic(tmp_path / "other", 20, 1)
    records = read_manifest(tmp_path / "other" / "manifest.jsonl")
    one = tmp_path / "other" / "one.jsonl"
    write_manifest(one, [r for r in records if r.split == "test"][:1])
    code, stdout, stderr = run_cli.as_user("train", "eval-clip", "--features", features, "--manifest", one,
                                           "--protocol", "f30k-1k", "--allow-size-mismatch")
    assert_one_error_line(code, stdout, stderr)
    assert f"{one} names other images than {features} was made from ({manifest})" in stderr and encodings == []


def test_eval_clip_refuses_the_split_size_before_encoding(clip_set, run_cli, encodings):  # noqa: F811
    manifest, features = clip_set
    code, stdout, stderr = run_cli.as_user("train", "eval-clip", "--features", features, "--manifest", manifest,
                                           "--protocol", "coco-5k", "--device", "cpu")
    assert_one_error_line(code, stdout, stderr)
    assert "coco-5k expects a split of 5000 images, this one has 2" in stderr and encodings == []


@pytest.mark.parametrize("slot, kind", [("--weights", k) for k in KINDS] +
                         [("--manifest", k) for k in KINDS if k != "jsonl"])
def test_eval_clip_wrong_kinds_are_one_line(clip_set, run_cli, encodings, wrong_kinds, slot, kind):  # noqa: F811
    manifest, features = clip_set
    args = {"--features": features, "--manifest": manifest, slot: wrong_kinds[kind]}
    code, stdout, stderr = run_cli.as_user("train", "eval-clip", *[x for kv in args.items() for x in kv],
                                           "--protocol", "f30k-1k", "--allow-size-mismatch", "--device", "cpu")
    assert_one_error_line(code, stdout, stderr)
    assert encodings == []


# ---------------------------------------------------------------------------------- vse-infinity wrong inputs

@pytest.fixture
def wrong_kinds(tmp_path, two_sets):
    """One input of each wrong kind (``tests/test_pipeline_wrong_inputs.py``'s kinds)."""
    manifest, features, _ = two_sets
    paths = {"empty": tmp_path / "empty.txt", "folder": tmp_path / "a_folder", "jsonl": manifest,
             "latin1": tmp_path / "latin1.jsonl", "hdf5": features}
    paths["empty"].write_bytes(b"")
    paths["folder"].mkdir()
    first = manifest.read_text().splitlines()[0]
    paths["latin1"].write_bytes(first.replace('captions": ["', 'captions": ["caf\xe9 ').encode("latin-1") + b"\n")
    return paths


#: each slot of vse-infinity and the kind it takes (None: none of KINDS)
VSE_INFINITY_SLOTS = {"--manifest": "jsonl", "--word-vectors": None, "--vocab": None, "--out": "folder"}


@pytest.mark.parametrize("slot, kind", [(slot, kind) for slot, expected in VSE_INFINITY_SLOTS.items()
                                        for kind in KINDS if kind != expected])
def test_vse_infinity_wrong_kinds_are_one_line_and_leave_nothing(two_sets, run_cli, trainings, wrong_kinds,
                                                                 tmp_path, slot, kind):
    manifest, features, _ = two_sets
    out = tmp_path / "run"
    args = {"--features": features, "--manifest": manifest, "--out": out, slot: wrong_kinds[kind]}
    before = sorted(p.name for p in tmp_path.iterdir())
    code, stdout, stderr = run_cli.as_user("train", "vse-infinity", *[x for kv in args.items() for x in kv],
                                           *[a for a in TINY if a != "--word-dim" and a != "8"], "--word-dim", "300")
    assert_one_error_line(code, stdout, stderr)
    assert trainings == [] and sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("command", ["eval", "search", "show"])
def test_a_run_given_another_datasets_manifest_is_refused(two_sets, run_cli, tmp_path, command):
    """A trained run opened with --manifest of other images under the same ids (eval, search, show) is refused in
    one line, as training is: its numbers would be for images the features do not hold."""
    manifest, features, other = two_sets
    run = tmp_path / "run"
    run_cli("train", "vsepp", "--features", features, "--manifest", manifest, "--out", run, *TINY)
    argv = {"eval": ["eval", run, "--protocol", "f30k-1k", "--allow-size-mismatch", "--quiet"],
            "search": ["search", run, "--query", "a red circle", "--quiet"],
            "show": ["show", run, "--protocol", "f30k-1k", "--allow-size-mismatch", "--out", tmp_path / "report",
                     "--quiet"]}[command]
    before = sorted(p.name for p in run.iterdir())
    code, stdout, stderr = run_cli.as_user("train", *argv, "--manifest", other, "--device", "cpu")
    assert_one_error_line(code, stdout, stderr)
    assert f"{other} names other images than {features} was made from ({manifest})" in stderr
    assert sorted(p.name for p in run.iterdir()) == before and not (tmp_path / "report").exists()


# ------------------------------------------------------------------------------------------------ feature kinds

def test_jgcar_on_regions_is_refused_in_the_options_to_give_before_any_work(two_sets, run_cli, trainings, tmp_path):
    """JGCAR's per-region bias has one row per map cell (196): a set of 4 regions cannot be trained with it, which
    the loop found only after its start line and 'epochs 1..128'."""
    manifest, features, _ = two_sets
    out = tmp_path / "run"
    code, stdout, stderr = run_cli.as_user("train", "jgcar", "--features", features, "--manifest", manifest, "--out",
                                           out, *TINY)
    assert_one_error_line(code, stdout, stderr)
    assert stderr == (f"error: jgcar on --features {features} (regions, 4×16 per image): JGCAR's per-region bias b_v "
                      f"is built for --num-regions 196, the features have 4 positions per image; give --num-regions "
                      f"4, or --shared-bias (one bias for every position)\n")
    assert trainings == [] and not out.exists()
    for given in (["--num-regions", "4"], ["--shared-bias"]):          # either option the line names trains
        run_cli("train", "jgcar", "--features", features, "--manifest", manifest, "--out", out, *TINY, *given)
    assert len(trainings) == 2


def test_smfea_on_another_number_of_regions_names_its_options(two_sets, run_cli, trainings, tmp_path):
    manifest, features, _ = two_sets
    code, stdout, stderr = run_cli.as_user("train", "smfea", "--features", features, "--manifest", manifest, "--out",
                                           tmp_path / "run", "--trees", manifest, "--concepts", manifest, *TINY)
    assert_one_error_line(code, stdout, stderr)
    assert ("batch norm over region positions is built for --num-regions 36, the features have 4 positions per "
            "image; give --num-regions 4, or --instance-bn features") in stderr and trainings == []


@pytest.mark.parametrize("model, noted", [("sman", "grid"), ("seam", "tencrop"), ("vsepp", None), ("scan", None),
                                          ("vse-infinity", None)])
def test_another_kind_than_the_papers_is_said_before_training(two_sets, run_cli, trainings, tmp_path, model, noted):
    manifest, features, _ = two_sets
    run_cli("train", model, "--features", features, "--manifest", manifest, "--out", tmp_path / "run", *TINY)
    (cfg, kwargs), = trainings
    kind_notes = [n for n in kwargs["notes"] if "paper used" in n]
    if noted is None:
        assert kind_notes == []
    else:
        assert kind_notes == [f"note: --features {features} holds regions features (4×16 per image); {model}'s "
                              f"paper used {noted} features, so this run is not its paper's setting"]


def test_every_spec_names_its_papers_feature_kinds():
    from retr.trainers.models import get_spec, list_models

    assert {name: get_spec(name).feature_kinds for name in list_models()} == {
        "jgcar": ("maps",), "scan": ("regions",), "seam": ("tencrop",), "sman": ("grid",), "smfea": ("regions",),
        "vse-infinity": ("regions", "grid"), "vsepp": ()}


def test_reproduce_refuses_features_of_another_kind_than_the_papers(two_sets, run_cli, trainings, tmp_path):
    manifest, features, _ = two_sets
    out = tmp_path / "runs"
    code, stdout, stderr = run_cli.as_user("train", "reproduce", "jgcar-coco", "--features", features, "--manifest",
                                           manifest, "--out", out, "--allow-size-mismatch", "--device", "cpu")
    assert_one_error_line(code, stdout, stderr)
    assert stderr == (f"error: jgcar-coco: jgcar's paper used maps features (the recipe's: vgg16-maps), --features "
                      f"{features} holds regions features; no reproduction trains on them (retr-train jgcar does, "
                      f"with a note)\n")
    assert trainings == [] and nothing_written(out)
