"""VSE∞ with ``--text-encoder bert`` as a user runs it, nothing downloaded: a tiny random BERT
(``tests/bert_support.py``) in a Hugging Face cache laid out as huggingface_hub lays it out, a run trained from it
offline, and that run evaluated, searched, served, exported, loaded with ``retr.load_model`` and as ``hf-hub:``
with the pretrained BERT gone from the cache (the run carries its configuration and vocabulary); the word-piece
augmentation's proportions; and every wrong input one line, with nothing written."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from bert_support import wordpiece_tokens, write_tiny_bert
from test_hub import hub_cache
from test_pipeline_wrong_inputs import assert_one_error_line

pytest.importorskip("huggingface_hub", reason="the hub extra is not installed: pip install 'retr[hub]'")

TINY = ["--embed-size", "16", "--batch-size", "8", "--epochs", "1", "--val-images", "5", "--device", "cpu",
        "--quiet"]
BERT = "tiny-lab/tiny-bert"


def set_cache(monkeypatch, root: Path) -> Path:
    """huggingface_hub's cache (read at call time by retr) set to ``root``; offline."""
    import huggingface_hub.constants

    root.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setenv("RETR_OFFLINE", "1")
    return root


@pytest.fixture(scope="module")
def bert_world(tmp_path_factory, synthetic_data):
    """A tiny BERT cached as ``tiny-lab/tiny-bert``, a BERT run trained from it offline, and its export."""
    from click.testing import CliRunner

    from retr.trainers.commands import cli

    folder = tmp_path_factory.mktemp("bert")
    manifest, features = synthetic_data(images=40)
    captions = [c for line in Path(manifest).read_text().splitlines() for c in json.loads(line)["captions"]]
    model = write_tiny_bert(folder / "tiny-bert", wordpiece_tokens(captions))
    with pytest.MonkeyPatch.context() as monkeypatch:
        hub_cache(set_cache(monkeypatch, folder / "hf-cache"), BERT, model)
        for args in (["vse-infinity", "--text-encoder", "bert", "--bert-model", BERT, "--features", str(features),
                      "--manifest", str(manifest), "--out", str(folder / "run"), *TINY],
                     ["export", str(folder / "run"), "--out", str(folder / "export")]):
            result = CliRunner().invoke(cli, args)
            assert result.exit_code == 0, result.output
    return {"run": folder / "run", "export": folder / "export", "manifest": Path(manifest),
            "features": Path(features), "model": model, "captions": captions}


def caption_vectors(model, vocab, texts):
    from retr.trainers.data.splits import pad_tokens

    tokens, lengths = pad_tokens([vocab.encode(t) for t in texts])
    with torch.no_grad():
        return model.eval().encode_captions(tokens, lengths)["vector"]


def test_a_bert_run_stores_its_wordpiece_vocabulary_and_bert_configuration(bert_world):
    config = json.loads((bert_world["run"] / "config.json").read_text())
    args = config["model_args"]
    assert args["text_encoder"] == "bert" and args["bert_model"] == BERT
    assert args["bert_config"]["hidden_size"] == 16 and args["bert_config"]["vocab_size"] == args["vocab_size"]
    vocab = json.loads((bert_world["run"] / "vocab.json").read_text())
    assert vocab["format"] == "wordpiece" and vocab["tokens"] == (bert_world["model"] / "vocab.txt").read_text().split()


def test_a_bert_run_works_offline_without_its_pretrained_bert(bert_world, run_cli, tmp_path, monkeypatch):
    """The pretrained BERT gone from the cache, offline: eval, search, serve, export, retr.load_model (run, export
    and hf-hub:) all work, and give the same caption embeddings."""
    import retr

    cache = set_cache(monkeypatch, tmp_path / "empty-cache")
    run, manifest, features = bert_world["run"], bert_world["manifest"], bert_world["features"]
    code, stdout, stderr = run_cli.as_user("train", "eval", run, "--protocol", "f30k-1k", "--allow-size-mismatch",
                                           "--features", features, "--manifest", manifest, "--device", "cpu")
    assert code == 0, stderr
    assert "rsum" in stdout
    code, stdout, stderr = run_cli.as_user("train", "search", run, "--query", "a red circle", "--features", features,
                                           "--manifest", manifest, "--device", "cpu")
    assert code == 0, stderr
    assert "synth_" in stdout
    run_cli("train", "export", run, "--out", tmp_path / "export")
    hub_cache(cache, "my-lab/tiny-bert-vse", bert_world["export"])
    texts = bert_world["captions"][:3]
    vectors = []
    for source in (run, tmp_path / "export", "hf-hub:my-lab/tiny-bert-vse"):
        model, vocab, config = retr.load_model(source)
        assert config["model_args"]["text_encoder"] == "bert"
        vectors.append(caption_vectors(model, vocab, texts))
    for other in vectors[1:]:
        torch.testing.assert_close(other, vectors[0], rtol=0, atol=1e-6)   # float16 exports: ≤ 1e-6 here
    assert not any(p.name.startswith("models--tiny-lab") for p in cache.iterdir())


def test_a_bert_run_is_served(bert_world, monkeypatch, tmp_path):
    pytest.importorskip("flask", reason="the serve extra is not installed: pip install 'retr[serve]'")
    from retr.trainers.search.retrieval import Retriever
    from retr.trainers.search.serve_app import SearchPage, create_app

    set_cache(monkeypatch, tmp_path / "empty-cache")
    retriever = Retriever.from_run(bert_world["run"], manifest=str(bert_world["manifest"]),
                                   features=str(bert_world["features"]), device="cpu")
    page = SearchPage(retriever, bert_world["run"], manifest=str(bert_world["manifest"]))
    try:
        body = create_app(page).test_client().get("/api/search", query_string={"q": "a red zebra", "k": 3}).get_json()
        assert body == page.r.text_to_images(["a red zebra"], 3)[0].to_json()
        assert body["unknown_words"] == ["zebra"] and len(body["hits"]) == 3
    finally:
        page.close()


def test_word_piece_augmentation_proportions():
    """Over many words: each word hit with probability p = 0.2 (every piece alike), a hit word masked ½ of the time,
    removed 4/10; [CLS] and [SEP] never touched (the draws word by word against the authors': the golden test)."""
    from retr.store.wordpiece import WordPieceVocabulary
    from retr.trainers.models import create_model

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "big", "##gest", "red", "ball"]
    vocab = WordPieceVocabulary(tokens, max_length=64)
    config = {"vocab_size": len(tokens), "hidden_size": 4, "num_hidden_layers": 1, "num_attention_heads": 1,
              "intermediate_size": 8, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
              "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 64, "type_vocab_size": 2,
              "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0}
    model = create_model("vse-infinity", vocab_size=len(tokens), img_dim=4, embed_size=4, text_encoder="bert",
                         bert_config=config, augment_words=0.2)
    model.prepare_training({"word_continues": torch.from_numpy(vocab.continuation()),
                            "mask_token": torch.tensor(vocab.mask_id)})
    caption = vocab.encode("biggest red ball " * 15)                  # 45 words, 60 pieces
    assert len(caption) == 62
    rows = 1000
    ids = torch.tensor([caption] * rows)
    lengths = torch.full((rows,), len(caption))
    torch.manual_seed(0)
    out, new_lengths = model.augment_word_pieces(ids, lengths)
    assert (out[:, 0] == vocab.cls_id).all()
    assert (out.gather(1, (new_lengths - 1).view(-1, 1)) == vocab.sep_id).all()
    masked = removed = 0
    for row, n in zip(out.tolist(), new_lengths.tolist()):
        body = row[1:n - 1]
        masked += body.count(vocab.mask_id)
        removed += 60 - len(body)
    pieces = rows * 60
    # masked pieces: P(hit)·½ = 0.1 of the words, every piece of a masked word, so 0.1 of the pieces (3 sigma of
    # the words' draws, pieces of one word drawn together: their count counts up to twice)
    assert abs(masked / pieces - 0.1) < 3 * 2 * (0.1 * 0.9 / pieces) ** 0.5
    # removed pieces: 0.2·0.4 = 0.08 of the words, "biggest" removed whole, so 0.08 of the pieces too
    assert abs(removed / pieces - 0.08) < 3 * 2 * (0.08 * 0.92 / pieces) ** 0.5


# ----------------------------------------------------------------------------------------------- wrong inputs

def train_args(world, out, *extra):
    return ["vse-infinity", "--features", world["features"], "--manifest", world["manifest"], "--out", out, *TINY,
            *extra]


def test_bert_without_the_extra_is_one_line(bert_world, run_cli, tmp_path, monkeypatch):
    """transformers (and tokenizers) not installed: training with --text-encoder bert, and evaluating a BERT run,
    each stop with one line naming the extra; nothing is written."""
    for module in ("transformers", "tokenizers"):
        monkeypatch.setitem(sys.modules, module, None)            # what the import sees when it is not installed
    code, stdout, stderr = run_cli.as_user("train", *train_args(bert_world, tmp_path / "run", "--text-encoder", "bert",
                                                                "--bert-model", str(bert_world["model"])))
    assert_one_error_line(code, stdout, stderr)
    assert "pip install 'retr[bert]'" in stderr and not (tmp_path / "run").exists()
    before = sorted(p.name for p in bert_world["run"].iterdir())
    code, stdout, stderr = run_cli.as_user("train", "eval", bert_world["run"], "--protocol", "f30k-1k",
                                           "--allow-size-mismatch", "--features", bert_world["features"],
                                           "--manifest", bert_world["manifest"], "--device", "cpu")
    assert_one_error_line(code, stdout, stderr)
    assert "pip install 'retr[bert]'" in stderr and sorted(p.name for p in bert_world["run"].iterdir()) == before


@pytest.mark.parametrize("cached", ["nothing", "config and vocabulary"])
def test_offline_and_bert_not_cached_is_one_line_naming_hf_download(bert_world, run_cli, tmp_path, monkeypatch,
                                                                    cached):
    """Offline, the default bert-base-uncased absent from the cache (or there without its weights): one line naming
    the model and `hf download bert-base-uncased`; nothing is written."""
    cache = set_cache(monkeypatch, tmp_path / "cache")           # (what is read is remembered per cache)
    if cached != "nothing":
        partial = tmp_path / "partial"
        partial.mkdir()
        for name in ("config.json", "vocab.txt"):
            shutil.copyfile(bert_world["model"] / name, partial / name)
        hub_cache(cache, "bert-base-uncased", partial)
    code, stdout, stderr = run_cli.as_user("train", *train_args(bert_world, tmp_path / "run", "--text-encoder", "bert"))
    assert_one_error_line(code, stdout, stderr)
    assert "bert-base-uncased" in stderr and "hf download bert-base-uncased" in stderr
    assert not (tmp_path / "run").exists()


def test_wrong_bert_inputs_are_one_line(bert_world, run_cli, tmp_path, monkeypatch):
    """A BiGRU vocabulary given to a BERT run, an unknown encoder name, GloVe vectors with BERT, a --bert-model folder
    without its files, and a resumed BERT run whose --bert-model now has another size: one line each, nothing
    written."""
    from retr.store.vocab import Vocabulary

    set_cache(monkeypatch, tmp_path / "cache")
    bigru_vocab = Vocabulary(["a", "red", "circle"]).save(tmp_path / "f30k_precomp_vocab.json")
    (tmp_path / "empty-bert").mkdir()
    cases = {
        "bigru vocabulary": (["--text-encoder", "bert", "--bert-model", bert_world["model"], "--vocab", bigru_vocab],
                             "(a vocabulary file is for the BiGRU); leave --vocab out"),
        "unknown encoder": (["--text-encoder", "lstm"], "--text-encoder"),
        "word vectors": (["--text-encoder", "bert", "--bert-model", bert_world["model"], "--word-vectors", "glove.6B.300d"],
                         "--word-vectors"),
        "empty folder": (["--text-encoder", "bert", "--bert-model", tmp_path / "empty-bert"],
                         "the folder has no config.json"),
    }
    for label, (extra, expected) in cases.items():
        code, stdout, stderr = run_cli.as_user("train", *train_args(bert_world, tmp_path / label, *extra))
        assert_one_error_line(code, stdout, stderr)
        assert expected in stderr, (label, stderr)
        assert not (tmp_path / label).exists(), label
    assert "lstm" in run_cli.as_user("train", *train_args(bert_world, tmp_path / "x", "--text-encoder", "lstm"))[2]


def test_the_bert_recipe_reproduces_with_bert_base_uncased_from_the_cache(bert_world, run_cli, tmp_path, monkeypatch):
    """``reproduce vse-infinity-bert-f30k`` trains its member with --text-encoder bert from the cached
    bert-base-uncased (here the tiny BERT under that name) and compares with the README's numbers (R@10 not
    printed there)."""
    cache = set_cache(monkeypatch, tmp_path / "cache")
    hub_cache(cache, "bert-base-uncased", bert_world["model"])
    run_cli("train", "reproduce", "vse-infinity-bert-f30k", "--features", bert_world["features"], "--manifest",
            bert_world["manifest"], "--out", tmp_path / "runs", "--epochs", "1", "--batch-size", "8",
            "--set", "embed_size=16", "--allow-size-mismatch", "--device", "cpu")
    config = json.loads((tmp_path / "runs" / "vse-infinity-bert-f30k" / "config.json").read_text())
    assert config["model_args"]["text_encoder"] == "bert" and config["model_args"]["bert_model"] == "bert-base-uncased"
    report = json.loads((tmp_path / "runs" / "reproduce-vse-infinity-bert-f30k.json").read_text())
    published = report["rows"][0]["published"]
    assert published["i2t"] == {"r1": 81.7, "r5": 95.4, "r10": None} and published["t2i"]["r1"] == 61.4
    assert published["rsum"] is None and report["rows"][0]["measured"]["rsum"] is not None
