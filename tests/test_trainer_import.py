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
from retr.trainers.commands import cli
from retr.trainers.data.splits import ImageFeatures, load_split
from retr.trainers.evaluation.similarity import similarity_matrix
from retr.trainers.models import create_model
from retr.store.vocab import Vocabulary, tokenize
from trainer_synthetic import D


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
def test_official_checkpoint_imports_and_evaluates(tmp_path, weight_norm, synthetic_data):
    manifest, features = synthetic_data(images=40)
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
                                      "--manifest", str(manifest), "--save-sims", str(sims_path), "--json",
                                      "--device", "cpu"],                   # the reference below runs on the CPU
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


def test_two_layer_gru_and_no_txtnorm_import_exactly(tmp_path, synthetic_data):
    """The official model with ``num_layers=2`` and ``no_txtnorm`` scores as retr's model with those settings."""
    manifest, features = synthetic_data(images=20)
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
    from retr.trainers.runs import checkpoint as ckpt
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


def test_vsepp_checkpoint_imports_and_scores_as_the_official_encoders(tmp_path):
    """fartashf/vsepp's precomputed-feature model, written out here: image ``l2norm(fc(x))``; text the GRU output
    at the last word, l2norm; score the dot product."""
    from torch import nn
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(7)
    vocab = Vocabulary(["a", "dog", "runs", "cat", "sits"])
    vocab_path = vocab.save(tmp_path / "vocab.json")
    fc, embed, rnn = nn.Linear(D, 10), nn.Embedding(len(vocab), 6), nn.GRU(6, 10, 2, batch_first=True)
    opt = argparse.Namespace(data_name="coco_precomp", img_dim=D, embed_size=10, word_dim=6, num_layers=2,
                             measure="cosine", use_abs=False, no_imgnorm=False, margin=0.2, max_violation=True,
                             learning_rate=2e-4, logger_name="runs/x", cnn_type="resnet152", finetune=False)
    official = tmp_path / "model_best.pth.tar"
    torch.save({"epoch": 3, "model": [{f"fc.{k}": v for k, v in fc.state_dict().items()}, {**{f"embed.{k}": v for k, v in embed.state_dict().items()},
                                                         **{f"rnn.{k}": v for k, v in rnn.state_dict().items()}}],
                "best_rsum": 1.0, "opt": opt, "Eiters": 5}, official)
    run = tmp_path / "imported"
    result = CliRunner().invoke(cli, ["import-vsepp-checkpoint", str(official), "--vocab", str(vocab_path), "--out",
                                      str(run)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    from retr.trainers.runs import checkpoint as ckpt
    model, _, config = ckpt.load_run_model(run)
    assert config["model"] == "vsepp" and config["model_args"]["num_layers"] == 2
    images = torch.randn(3, 1, D)
    tokens = torch.tensor([[1, 5, 6, 2, 0], [1, 7, 2, 0, 0], [1, 5, 8, 6, 2]])
    lengths = torch.tensor([4, 3, 5])
    with torch.no_grad():
        want_img = F_normalize(fc(images[:, 0]))
        out, _ = rnn(pack_padded_sequence(embed(tokens), lengths, batch_first=True, enforce_sorted=False))
        out, _ = pad_packed_sequence(out, batch_first=True)
        want_cap = F_normalize(out[torch.arange(3), lengths - 1])
        got = model.score(model.encode_images(images, torch.ones(3, 1, dtype=torch.bool)),
                          model.encode_captions(tokens, lengths))
    torch.testing.assert_close(got, want_img @ want_cap.t(), rtol=1e-5, atol=1e-6)
    for bad, message in ((dict(measure="order"), "cosine only"), (dict(use_abs=True), "absolute value"),
                         (dict(data_name="coco"), "raw images"), (dict(strange=1), "strange=1")):
        opt2 = argparse.Namespace(**{**vars(opt), **bad})
        state = torch.load(official, weights_only=False)
        state["opt"] = opt2
        bad_file = tmp_path / "bad.pth.tar"
        torch.save(state, bad_file)
        with pytest.raises(UserError, match=message):
            CliRunner().invoke(cli, ["import-vsepp-checkpoint", str(bad_file), "--vocab", str(vocab_path), "--out",
                                     str(tmp_path / "r")], catch_exceptions=False)


def F_normalize(x):
    return x / (x.norm(dim=-1, keepdim=True) + 1e-8)
