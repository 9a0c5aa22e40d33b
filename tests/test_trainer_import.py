"""import-scan-checkpoint on a checkpoint in the official layout; vocabulary files; eval with --features/--manifest."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from retr.common.errors import UserError
from retr.store.features import FeatureSet
from retr.trainers.cli import cli
from retr.trainers.data import ImageFeatures, load_split
from retr.trainers.similarity import similarity_matrix
from retr.trainers.models import create_model
from retr.store.vocab import Vocabulary, tokenize
from trainer_synthetic import D, make_synthetic


def test_vocabulary_threshold_specials_and_scan_format(tmp_path):
    vocab = Vocabulary.build(["A dog runs.", "a dog sits", "a dog, a cat", "A dog"], threshold=4)
    assert vocab.idx2word == ["<pad>", "<start>", "<end>", "<unk>", "a", "dog"]
    assert vocab.encode("A cat dog") == [1, 4, 3, 5, 2]
    assert tokenize("A man's hat, red.") == ["a", "man", "'s", "hat", ",", "red", "."]
    path = vocab.save(tmp_path / "f30k_precomp_vocab.json")
    data = json.loads(path.read_text())
    assert data["idx"] == 6 and data["idx2word"]["0"] == "<pad>" and data["word2idx"]["dog"] == 5
    assert Vocabulary.load(path).idx2word == vocab.idx2word
    path.write_text(json.dumps({"idx2word": {"0": "dog"}}))
    with pytest.raises(UserError, match="ids 0-3"):
        Vocabulary.load(path)


@pytest.mark.parametrize("weight_norm", [False, True])
def test_official_checkpoint_imports_and_evaluates(tmp_path, weight_norm):
    manifest, features = make_synthetic(tmp_path, images=40)
    from retr.manifests.schema import read_manifest
    vocab = Vocabulary.build([c for r in read_manifest(manifest, ["train"]) for c in r.captions], 4)
    vocab_path = vocab.save(tmp_path / "synth_precomp_vocab.json")
    opt = argparse.Namespace(img_dim=D, embed_size=12, word_dim=6, vocab_size=len(vocab), cross_attn="i2t",
                             agg_func="Mean", raw_feature_norm="clipped_l2norm", lambda_softmax=4.0,
                             lambda_lse=None, bi_gru=True, no_imgnorm=False, margin=0.2, max_violation=True,
                             precomp_enc_type="weight_norm" if weight_norm else "basic", num_layers=1)
    torch.manual_seed(3)
    reference = create_model("scan", vocab_size=len(vocab), img_dim=D, embed_size=12, word_dim=6, direction="i2t",
                             agg="avg", lambda_softmax=4.0, bi_gru=True,
                             precomp_enc_type="weight_norm" if weight_norm else "basic")
    img_state = {k[len("img_enc."):]: v for k, v in reference.state_dict().items() if k.startswith("img_enc.")}
    txt_state = {k[len("txt_enc."):]: v for k, v in reference.state_dict().items() if k.startswith("txt_enc.")}
    assert ("weight_g" in " ".join(img_state)) == weight_norm and "rnn.weight_hh_l0_reverse" in txt_state
    official = tmp_path / "model_best.pth.tar"
    torch.save({"epoch": 7, "model": [img_state, txt_state], "best_rsum": 400.0, "opt": opt, "Eiters": 99}, official)

    run = tmp_path / "imported"
    result = CliRunner().invoke(cli, ["import-scan-checkpoint", str(official), "--vocab", str(vocab_path),
                                      "--out", str(run)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    config = json.loads((run / "config.json").read_text())
    assert config["model_args"]["direction"] == "i2t" and config["model_args"]["agg"] == "avg"
    assert config["model_args"]["lambda_lse"] == 6.0                  # the authors' fallback when absent
    with pytest.raises(UserError, match="--features"):
        CliRunner().invoke(cli, ["eval", str(run), "--protocol", "f30k-1k", "--allow-size-mismatch"],
                           catch_exceptions=False)
    sims_path = tmp_path / "sims.npy"
    result = CliRunner().invoke(cli, ["eval", str(run), "--protocol", "f30k-1k", "--allow-size-mismatch",
                                      "--features", str(features),
                                      "--manifest", str(manifest), "--save-sims", str(sims_path), "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    fs = FeatureSet(features)
    data, _ = load_split(manifest, ["test"], vocab, fs)
    want = similarity_matrix(reference.eval(), data, ImageFeatures(fs, data.image_ids), quiet=True)
    np.testing.assert_allclose(np.load(sims_path), want, rtol=1e-12, atol=1e-12)


def test_import_rejects_wrong_vocabulary_and_files(tmp_path):
    bad = tmp_path / "x.pth.tar"
    torch.save({"something": 1}, bad)
    vocab = Vocabulary(["a"]).save(tmp_path / "v.json")
    with pytest.raises(UserError, match="not an official SCAN checkpoint"):
        CliRunner().invoke(cli, ["import-scan-checkpoint", str(bad), "--vocab", str(vocab), "--out",
                                 str(tmp_path / "r")], catch_exceptions=False)


def _official_file(tmp_path, vocab, reference, **opt_fields):
    img_state = {k[len("img_enc."):]: v for k, v in reference.state_dict().items() if k.startswith("img_enc.")}
    txt_state = {k[len("txt_enc."):]: v for k, v in reference.state_dict().items() if k.startswith("txt_enc.")}
    fields = dict(img_dim=D, embed_size=12, word_dim=6, vocab_size=len(vocab), cross_attn="t2i",
                  agg_func="LogSumExp", raw_feature_norm="clipped_l2norm", lambda_softmax=9.0, lambda_lse=6.0,
                  bi_gru=True, no_imgnorm=False, margin=0.2, max_violation=True, precomp_enc_type="basic",
                  num_layers=1, data_path="/data", logger_name="runs/x")
    opt = argparse.Namespace(**{**fields, **opt_fields})
    path = tmp_path / f"model_best_{len(list(tmp_path.glob('model_best_*')))}.pth.tar"
    torch.save({"epoch": 1, "model": [img_state, txt_state], "best_rsum": 1.0, "opt": opt, "Eiters": 1}, path)
    return path


def test_two_layer_gru_and_no_txtnorm_import_exactly(tmp_path):
    """The official model with ``num_layers=2`` and ``no_txtnorm`` scores as retr's model with those settings."""
    manifest, features = make_synthetic(tmp_path, images=20)
    from retr.manifests.schema import read_manifest
    vocab = Vocabulary.build([c for r in read_manifest(manifest, ["train"]) for c in r.captions], 4)
    vocab_path = vocab.save(tmp_path / "vocab.json")
    torch.manual_seed(5)
    reference = create_model("scan", vocab_size=len(vocab), img_dim=D, embed_size=12, word_dim=6, num_layers=2,
                             no_txtnorm=True, lambda_softmax=9.0, lambda_lse=6.0, agg="lse")
    official = _official_file(tmp_path, vocab, reference, no_txtnorm=True)
    state = torch.load(official, weights_only=False)
    state["opt"].num_layers = 2
    torch.save(state, official)
    run = tmp_path / "imported"
    result = CliRunner().invoke(cli, ["import-scan-checkpoint", str(official), "--vocab", str(vocab_path), "--out",
                                      str(run)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    config = json.loads((run / "config.json").read_text())
    assert config["model_args"]["num_layers"] == 2 and config["model_args"]["no_txtnorm"] is True
    from retr.trainers import checkpoint as ckpt
    model, _, _ = ckpt.load_run_model(run)
    fs = FeatureSet(features)
    data, _ = load_split(manifest, ["test"], vocab, fs)
    feats = ImageFeatures(fs, data.image_ids)
    np.testing.assert_allclose(similarity_matrix(model, data, feats, quiet=True),
                               similarity_matrix(reference.eval(), data, feats, quiet=True), rtol=1e-12, atol=1e-12)
    with torch.no_grad():       # the words are not normalised: an official no_txtnorm model's vectors
        tokens = torch.tensor([data.tokens[0]])
        words = model.encode_captions(tokens, torch.tensor([tokens.shape[1]]))["words"]
    assert not torch.allclose(words.norm(dim=-1), torch.ones(1, tokens.shape[1]))


@pytest.mark.parametrize("field, value, message", [("raw_feature_norm", "l1norm", "cannot run it"),
                                                   ("raw_feature_norm", "clipped_l1norm", "cannot run it"),
                                                   ("measure", "order", "cosine only"),
                                                   ("mystery_flag", 3, "mystery_flag=3")])
def test_options_retr_cannot_reproduce_are_refused_by_name(tmp_path, field, value, message):
    vocab = Vocabulary(["a", "b"])
    vocab_path = vocab.save(tmp_path / "v.json")
    reference = create_model("scan", vocab_size=len(vocab), img_dim=D, embed_size=12, word_dim=6)
    official = _official_file(tmp_path, vocab, reference, **{field: value})
    with pytest.raises(UserError, match=message):
        CliRunner().invoke(cli, ["import-scan-checkpoint", str(official), "--vocab", str(vocab_path), "--out",
                                 str(tmp_path / "r")], catch_exceptions=False)
