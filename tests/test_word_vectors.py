"""GloVe word vectors (``retr.store.word_vectors``, ``--word-vectors``, ``--concept-vectors glove``): a small
GloVe-format file the test writes, zipped as ``glove.840B.300d.zip`` and served by ``tests/local_server.py``
through ``--mirror`` with its own size and sha256 in the sources table."""
from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path
from dataclasses import replace

import numpy as np
import pytest
import torch

from retr.common import downloads
from retr.common.downloads import SOURCES
from retr.common.errors import MissingResourceError, UserError
from retr.store import word_vectors as wv
from retr.store.vocab import SPECIALS, Vocabulary
from tests.local_server import LocalServer
from trainer_synthetic import write_trees_and_concepts

DIM = 8
ZIP, TXT = "glove.840B.300d.zip", "glove.840B.300d.txt"


def _glove(words, absent, seed=0) -> tuple[str, dict]:
    """GloVe text for ``words`` minus ``absent`` (4-decimal values, so the text is exact), and the table."""
    rng = np.random.default_rng(seed)
    table = {w: rng.standard_normal(DIM).round(4).astype(np.float32) for w in words if w not in absent}
    lines = [f"{w} {' '.join(f'{x:.4f}' for x in v)}" for w, v in table.items()]
    return "\n".join(["unrelated " + " ".join(["0.5"] * DIM), *lines]) + "\n", table


def _zip(text: str, name: str = TXT) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(zipfile.ZipInfo(name, (2014, 1, 1, 0, 0, 0)), text, zipfile.ZIP_DEFLATED)
    return buffer.getvalue()


@pytest.fixture
def data(tmp_path, synthetic_data):
    """The synthetic scenes (40 images, scene region features; shared, read-only) and their vocabulary file."""
    from retr.manifests.schema import read_manifest

    manifest, features = synthetic_data(images=40, seed=0)
    vocab = Vocabulary.build(c for r in read_manifest(manifest, splits=["train", "restval"]) for c in r.captions)
    vocab.save(tmp_path / "vocab.json")
    absent = set(vocab.idx2word[4:6])                  # two real words the vectors lack
    text, table = _glove([w for w in vocab.idx2word if w not in SPECIALS], absent)
    return {"manifest": manifest, "features": features, "vocab": vocab, "vocab_path": tmp_path / "vocab.json",
            "absent": absent, "table": table, "text": text}


@pytest.fixture
def mirror(monkeypatch, data, tmp_path):
    """The test's vectors as GloVe 840B on a local mirror (the table holds the zip's size and sha256); downloads
    and caches go to the test's own folder."""
    body = _zip(data["text"])
    monkeypatch.setenv("RETR_OFFLINE", "0")
    monkeypatch.setenv("RETR_WORD_VECTORS", str(tmp_path / "word-vectors"))
    monkeypatch.setattr(downloads, "DEFAULT_RETRY_WAIT", 0.0)
    monkeypatch.setitem(SOURCES, "glove-840b", replace(SOURCES["glove-840b"], size=len(body),
                                                       sha256=hashlib.sha256(body).hexdigest()))
    with LocalServer() as server:
        server.files[f"/{ZIP}"] = body
        monkeypatch.setenv("RETR_MIRROR", server.url)
        server.body = body
        yield server


def test_the_reader_rules(tmp_path):
    """Own line first (cased lines are other words), then CVSE's cleaned form, then the mean of ``_`` parts; a
    line whose word holds spaces is skipped; a short line is one error naming it; a zip's member is read."""
    text = ("dog 1 2\nDog 9 9\ntshirt 3 3\ntennis 0 2\nracket 2 0\n. . . 5 5\n. 7 7\n")
    path = tmp_path / "v.txt"
    path.write_text(text, encoding="utf-8")
    words = ["dog", "t-shirt", "tennis_racket", ".", "unicorn"]
    vectors, missing = wv.read_word_vectors(path, words)
    np.testing.assert_array_equal(vectors, [[1, 2], [3, 3], [1, 1], [7, 7], [0, 0]])
    assert missing == ["unicorn"]
    archive = tmp_path / "v.zip"
    archive.write_bytes(_zip(text, "inner/v.txt"))
    located = wv.resolve_vectors(str(archive))
    assert located.member == "inner/v.txt" and located.sha256 == hashlib.sha256(archive.read_bytes()).hexdigest()
    np.testing.assert_array_equal(wv.read_word_vectors(archive, words, located.member)[0], vectors)
    path.write_text("dog 1 2\ncat 1\n", encoding="utf-8")
    with pytest.raises(UserError, match="line 2: 1 value where the first line has 2 "):
        wv.read_word_vectors(path, ["cat"])
    path.write_text("the 0.1 0.2 abc 0.4\n", encoding="utf-8")       # a word's value is not a number
    with pytest.raises(UserError, match=r"line 1: 'abc' is not a number \(GloVe text format"):
        wv.read_word_vectors(path, ["the"])
    path.write_text("nothing here is a vector\n", encoding="utf-8")
    with pytest.raises(UserError, match="covers none of the 2 words asked for: is it a GloVe-format file"):
        wv.read_word_vectors(path, ["dog", "cat"])
    named_zip = tmp_path / "text.zip"                                   # text under an archive's name
    named_zip.write_text("dog 1 2\n", encoding="utf-8")
    with pytest.raises(UserError, match="is named .zip but is not a zip archive"):
        wv.resolve_vectors(str(named_zip))
    with pytest.raises(MissingResourceError, match="GloVe-format"):
        wv.resolve_vectors(str(tmp_path / "absent.txt"))


def test_first_use_downloads_checks_and_resumes_and_offline_is_one_line(mirror, monkeypatch, data):
    folder = wv.vectors_dir()
    monkeypatch.setenv("RETR_OFFLINE", "1")
    with pytest.raises(MissingResourceError) as offline:
        wv.resolve_vectors("glove")
    message = str(offline.value)
    assert "\n" not in message and str(folder / ZIP) in message and "retr-pipeline fetch-word-vectors glove" in message
    assert mirror.requests == []
    monkeypatch.setenv("RETR_OFFLINE", "0")
    half = len(mirror.body) // 2                           # an earlier run stopped half way
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{ZIP}.partial").write_bytes(mirror.body[:half])
    located = wv.resolve_vectors("glove", quiet=True)
    assert mirror.requests == [(f"/{ZIP}", f"bytes={half}-")]
    assert located.path.read_bytes() == mirror.body and located.member == TXT
    assert located.label == f"{ZIP} sha256:{hashlib.sha256(mirror.body).hexdigest()}"
    assert wv.resolve_vectors("glove").path == located.path and len(mirror.requests) == 1   # no second download
    located.path.unlink()
    monkeypatch.setitem(SOURCES, "glove-840b", replace(SOURCES["glove-840b"], sha256="0" * 64))
    with pytest.raises(UserError, match="sha256 check"):
        wv.resolve_vectors("glove", quiet=True)
    assert not any(folder.glob(f"{ZIP}*"))


def test_vocabulary_rows_equal_the_file_and_the_cache_is_reused(mirror, monkeypatch, data):
    located = wv.resolve_vectors("glove", quiet=True)
    words = data["vocab"].idx2word
    matrix, found = wv.vocabulary_vectors(located, words)
    assert matrix.shape == (len(words), DIM) and matrix.dtype == np.float32
    for i, word in enumerate(words):
        assert found[i] == (word in data["table"])
        np.testing.assert_array_equal(matrix[i], data["table"].get(word, np.zeros(DIM)))
    (cache,) = wv.vectors_dir().glob("*.npz")
    assert located.sha256[:16] in cache.name

    def no_text(*args, **kwargs):
        raise AssertionError("the text file was read again")

    monkeypatch.setattr(wv, "read_word_vectors", no_text)
    again, found_again = wv.vocabulary_vectors(located, words)
    np.testing.assert_array_equal(again, matrix)
    np.testing.assert_array_equal(found_again, found)
    with pytest.raises(AssertionError, match="read again"):          # another vocabulary: another cache entry
        wv.vocabulary_vectors(located, words[:-1])


def _train_args(data, out, *more):
    return ["train", "scan", "--features", data["features"], "--manifest", data["manifest"], "--out", out,
            "--epochs", "1", "--batch-size", "16", "--embed-size", "16", "--word-dim", str(DIM), "--val-images", "10",
            "--device", "cpu", "--quiet", "--vocab", data["vocab_path"], *more]


def _embedding(run, key="txt_enc.embed.weight"):
    from retr.trainers.runs import checkpoint as ckpt

    (_, last), *_ = reversed(ckpt.list_checkpoints(run))
    return ckpt.load_checkpoint(last)["model"][key]


def test_scan_trains_with_glove_fetched_on_first_use_and_reproduce_refuses_other_vectors(mirror, data, tmp_path,
                                                                                        run_cli):
    from retr.store.features import FeatureSet
    from retr.trainers.reproduction.recipes import Member
    from retr.trainers.reproduction.reproduce import plan_member

    out = tmp_path / "runs" / "scan-glove"
    result = run_cli(*_train_args(data, out, "--word-vectors", "glove", "--freeze-word-vectors"))
    kept = len(data["table"])
    assert f"{kept} of {kept + 2} vocabulary words found; 2 keep the model's random init" in result.output
    config = json.loads((out / "config.json").read_text())
    assert config["model_args"]["word_vectors"] == "glove"
    assert config["model_args"]["word_vectors_file"] == f"{ZIP} sha256:{hashlib.sha256(mirror.body).hexdigest()}"
    weight = _embedding(out)                    # frozen: the trained run's rows are the file's, exactly
    for i, word in enumerate(data["vocab"].idx2word):
        if word in data["table"]:
            torch.testing.assert_close(weight[i], torch.from_numpy(data["table"][word]), rtol=0, atol=0)
    assert weight.abs().max() < 10
    # reproduce reuses the run only for a recipe asking for these vectors
    overrides = {"epochs": 1, "batch_size": 16, "embed_size": 16, "word_dim": DIM, "val_images": 10,
                 "vocab": str(data["vocab_path"]), "freeze_word_vectors": True}
    plan = lambda vectors: plan_member(Member("scan-glove", "scan", None, {"word_vectors": vectors}),  # noqa: E731
                                       tmp_path / "runs", {k: str(data[k]) for k in ("features", "manifest")},
                                       overrides, FeatureSet(data["features"]), {})
    assert plan("glove").differences == []
    assert [d.name for d in plan("glove-6b").differences] == ["word_vectors"]
    assert [d.name for d in plan("random").differences] == ["word_vectors"]
    resumed = run_cli("train", "scan", "--resume", "--out", out, "--epochs", "2", "--quiet")   # from the cache
    assert "vocabulary words found" in resumed.output and len(mirror.requests) == 1
    torch.testing.assert_close(_embedding(out), weight, rtol=0, atol=0)


def test_sman_and_smfea_start_from_the_rows_absent_words_keep_their_init(tmp_path, data):
    """``--word-vectors FILE`` with a local file: the found rows are the file's, the others the model's init;
    fine-tuned by default, fixed with ``freeze_word_vectors``; a word size other than the file's is one error."""
    from retr.trainers.models import ModelInputs
    from retr.trainers.models.sman import SMAN, SMANConfig
    from retr.trainers.models.smfea import SMFEA, SMFEAConfig
    from retr.trainers.models.side_inputs import add_word_vectors

    path = tmp_path / "vectors.txt"
    path.write_text(data["text"], encoding="utf-8")
    vocab = data["vocab"]
    rows = torch.tensor([w in data["table"] for w in vocab.idx2word])
    with pytest.raises(UserError, match="--word-dim 8"):
        add_word_vectors(ModelInputs(), SMANConfig(word_vectors=str(path)), vocab)
    with pytest.raises(UserError, match="this run's word vectors were other.txt sha256:0"):       # on --resume
        add_word_vectors(ModelInputs(), SMANConfig(word_vectors=str(path), word_dim=DIM), vocab, "other.txt sha256:0")
    for freeze in (False, True):
        sman_cfg = SMANConfig(word_vectors=str(path), word_dim=DIM, embed_size=16, freeze_word_vectors=freeze)
        smfea_cfg = SMFEAConfig(word_vectors=str(path), word_dim=DIM, embed_size=16, tree_hidden=4,
                                freeze_word_vectors=freeze, num_regions=4)
        for model, cfg in ((SMAN(len(vocab), img_dim=16, config=sman_cfg), sman_cfg),
                           (SMFEA(len(vocab), 5, 5, 3, img_dim=16, config=smfea_cfg), smfea_cfg)):
            inputs = add_word_vectors(ModelInputs(), cfg, vocab)
            assert inputs.sizes["word_vectors_file"] == f"vectors.txt sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
            before = model.txt_enc.embed.weight.detach().clone()
            if isinstance(model, SMFEA):
                inputs.tensors.update(adjacency=torch.eye(3), token_concepts=torch.full((len(vocab),), -1),
                                      image_labels=torch.zeros(1, 3))
            model.prepare_training(inputs.tensors)
            weight = model.txt_enc.embed.weight
            expected = torch.stack([torch.from_numpy(data["table"][w]) for w in vocab.idx2word if w in data["table"]])
            torch.testing.assert_close(weight[rows].detach(), expected, rtol=0, atol=0)
            torch.testing.assert_close(weight[~rows].detach(), before[~rows], rtol=0, atol=0)
            assert weight.requires_grad is not freeze


@pytest.mark.slow
def test_smfea_trains_with_glove_words_and_concepts(mirror, data, tmp_path, run_cli):
    """``--word-vectors glove --concept-vectors glove``: one download, both recorded; the fixed concept vectors
    of the concepts GloVe has are the file's."""
    from retr.store.concepts import ConceptSet

    write_trees_and_concepts(data["manifest"], tmp_path)
    out = tmp_path / "smfea"
    run_cli("train", "smfea", "--features", data["features"], "--manifest", data["manifest"], "--out", out,
            "--trees", tmp_path / "trees.h5", "--concepts", tmp_path / "concepts.h5", "--concept-vectors", "glove",
            "--word-vectors", "glove", "--epochs", "1", "--batch-size", "16", "--embed-size", "16",
            "--word-dim", str(DIM), "--tree-hidden", "4", "--num-regions", "4", "--val-images", "10",
            "--device", "cpu", "--quiet", "--vocab", data["vocab_path"])
    label = f"{ZIP} sha256:{hashlib.sha256(mirror.body).hexdigest()}"
    args = json.loads((out / "config.json").read_text())["model_args"]
    assert args["word_vectors_file"] == label and args["concept_vectors_file"] == label
    assert len(mirror.requests) == 1
    concepts = ConceptSet(tmp_path / "concepts.h5").concepts
    vectors = _embedding(out, "gcn.vectors")
    known = [(i, c) for i, c in enumerate(concepts) if c in data["table"]]
    assert known
    for i, concept in known:
        torch.testing.assert_close(vectors[i], torch.from_numpy(data["table"][concept]), rtol=0, atol=0)


def test_a_named_vectors_set_stays_a_name_in_the_stored_paths(tmp_path):
    """``--concept-vectors glove`` is a resource fetched on first use, not a file of the working directory: the
    stored config keeps the name, so ``--config run/config.json`` finds it again."""
    from retr.trainers.config import TrainConfig
    from retr.trainers.runs.checkpoint import absolute_paths, paths_from_run

    cfg = TrainConfig(model="smfea", features="f.h5", manifest="m.jsonl", out=str(tmp_path / "run"),
                      inputs={"concept_vectors": "glove", "trees": "trees.h5"})
    stored = absolute_paths(cfg)
    assert stored.inputs["concept_vectors"] == "glove" and Path(stored.inputs["trees"]).is_absolute()
    assert set(paths_from_run(stored, tmp_path / "run")["inputs"]) == {"trees"}


def test_a_vectors_folder_that_takes_no_files_still_gives_the_rows(tmp_path):
    """A shared, read-only folder of vectors (here a cache folder below a file): the rows are read, not cached."""
    from retr.store.word_vectors import resolve_vectors, vocabulary_vectors

    text = tmp_path / "vectors.txt"
    text.write_text("the 0.5 0.25\ncat 0.125 1.0\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for _ in range(2):
        matrix, found = vocabulary_vectors(resolve_vectors(str(text)), ["the", "dog"], cache_dir=blocker / "cache")
        assert found.tolist() == [True, False] and matrix[0].tolist() == [0.5, 0.25]
    assert blocker.read_text() == ""
