"""Zero-shot CLIP (``retr-train eval-clip``, the ``clip-zero-shot-*`` recipes) and SCAN on CLIP patches, on a
small synthetic set extracted with ``clip-vit-b-32`` and random weights (no CLIP weights can be downloaded here,
so no number of a trained CLIP is measured)."""
from __future__ import annotations

import json

import h5py
import numpy as np
import open_clip
import pytest
import torch

from retr.manifests.schema import read_manifest
from retr.manifests.synthetic import generate_synthetic
from retr.trainers.evaluation.metrics import retrieval_metrics


@pytest.fixture(scope="module")
def clip_set(tmp_path_factory):
    """(manifest, clip-vit-b-32 feature set) of 20 synthetic images, extracted by the real command."""
    from click.testing import CliRunner

    from retr.pipeline.commands import cli

    folder = tmp_path_factory.mktemp("clip")
    generate_synthetic(folder, 20, 0)
    result = CliRunner().invoke(cli, ["extract", "--manifest", str(folder / "manifest.jsonl"), "--extractor",
                                      "clip-vit-b-32", "--weights", "random", "--workers", "0", "--out",
                                      str(folder / "features"), "--quiet"])
    assert result.exit_code == 0, result.output
    return folder / "manifest.jsonl", folder / "features" / "clip-vit-b-32.h5"


@pytest.mark.numerical
def test_eval_clip_ranks_the_stored_embeddings_against_the_text_tower(clip_set, run_cli):
    """The command's numbers are the protocol's metrics of cosine similarities computed here independently: row 0
    of the stored features × open_clip's encode_text of 'a photo of' + each caption (the same random model).
    Metrics are compared exactly: both sides rank float64 cosines of the same float32 embeddings."""
    manifest, features = clip_set
    out = run_cli("train", "eval-clip", "--features", features, "--manifest", manifest, "--protocol", "f30k-1k",
                  "--allow-size-mismatch", "--json", "--quiet").output
    result = json.loads(out)
    records = read_manifest(manifest, splits=["test"])
    with h5py.File(features) as f:
        ids = [i.decode() for i in f["ids"][:]]
        images = np.stack([f["features"][ids.index(r.id), 0] for r in records]).astype(np.float64)
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32", pretrained=None, force_quick_gelu=True).eval()
    captions = [c for r in records for c in r.captions]
    with torch.no_grad():
        texts = model.encode_text(open_clip.get_tokenizer("ViT-B-32")([f"a photo of {c}" for c in captions]))
    texts = texts.double().numpy()
    sims = (images / np.linalg.norm(images, axis=1, keepdims=True)) @ (
        texts / np.linalg.norm(texts, axis=1, keepdims=True)).T
    expected = retrieval_metrics(sims, np.repeat(np.arange(len(records)), [len(r.captions) for r in records]))
    assert {k: result[k] for k in ("i2t", "t2i", "rsum")} == expected
    assert (result["images"], result["captions"], result["clip_model"], result["weights"], result["prompt"]) == (
        len(records), len(captions), "ViT-B-32", "random", "a photo of")
    assert result["size_mismatch"] == {"expected": 1000, "images": len(records)}
    # without the prompt the captions are other texts: other similarities (not compared further: random weights)
    bare = json.loads(run_cli("train", "eval-clip", "--features", features, "--manifest", manifest, "--protocol",
                              "f30k-1k", "--allow-size-mismatch", "--json", "--quiet", "--prompt", "").output)
    assert bare["prompt"] == ""


def test_the_zero_shot_recipes_evaluate_without_training(clip_set, run_cli, tmp_path):
    """Table 13's rows are recipes without members: reproduce evaluates, trains nothing, and names every way the
    random ViT-B/32 set differs from the ViT-L/14@336px features the paper's numbers need."""
    manifest, features = clip_set
    listed = json.loads(run_cli("train", "recipes", "--json").output)["recipes"]
    row = next(r for r in listed if r["name"] == "clip-zero-shot-coco5k")
    assert (row["members"], row["zero_shot"], row["protocol"]) == ([], {"prompt": "a photo of"}, "coco-5k")
    assert row["published"]["i2t"] == {"r1": 58.4, "r5": 81.5, "r10": 88.1} and "Table 13" in row["published"]["source"]
    out = run_cli("train", "reproduce", "clip-zero-shot-f30k", "--features", features, "--manifest", manifest,
                  "--out", tmp_path / "rep", "--allow-size-mismatch", "--quiet").output
    report = json.loads((tmp_path / "rep" / "reproduce-clip-zero-shot-f30k.json").read_text())
    assert report["runs"] == [] and not any((tmp_path / "rep").glob("*/config.json"))
    assert [r["kind"] for r in report["rows"]] == ["zero-shot"] and report["rows"][0]["published"]["rsum"] == 540.6
    assert report["reasons"] == ["features: extractor clip-vit-b-32 (recipe clip-vit-l-14-336)",
                                 "features: 50×512 per image (recipe 577×768)", "split size 2, protocol 1000"]
    assert out.startswith("reproduction: no (3 reasons)")
    code, _, err = run_cli.as_user("train", "reproduce", "clip-zero-shot-f30k", "--features", features, "--manifest",
                                   manifest, "--out", tmp_path / "rep", "--epochs", "2")
    assert code == 1 and err == "error: clip-zero-shot-f30k trains nothing (zero-shot): it has no setting to override\n"


def test_eval_clip_refuses_other_feature_sets_in_one_line(clip_set, run_cli, make_feature_set, tmp_path):
    manifest, _ = clip_set
    grid, _ = make_feature_set(num_shards=1, rows_per_shard=2, shape=(4, 8))
    code, out, err = run_cli.as_user("train", "eval-clip", "--features", grid, "--manifest", manifest,
                                     "--protocol", "f30k-1k")
    assert code == 1 and err.count("\n") == 1 and "not a clip extractor" in err


def test_scan_trains_on_clip_patch_tokens(clip_set, run_cli, tmp_path):
    """SCAN reads the [1 + 49, 512] rows like regions (every row a 'region', none masked) and trains."""
    manifest, features = clip_set
    out = tmp_path / "scan"
    run_cli("train", "scan", "--features", features, "--manifest", manifest, "--out", out, "--epochs", "1",
            "--batch-size", "16", "--embed-size", "16", "--word-dim", "16", "--val-images", "2", "--device", "cpu",
            "--quiet")
    config = json.loads((out / "config.json").read_text())
    assert config["model_args"]["img_dim"] == 512
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [line["train_loss"] for line in lines if line["type"] == "epoch"]
    assert len(losses) == 1 and np.isfinite(losses[0]) and losses[0] > 0 and (out / "best.pt").is_file()
