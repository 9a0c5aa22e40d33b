"""Parity of retr's VSE∞ with the BERT text encoder and the authors' code (woodfrog/vse_infty, ``master``), from
figures their code computed.

``tests/data/golden/vse_infinity_bert/`` holds a tiny random BERT's WordPiece vocabulary and configuration, a seeded
float32 initial state of the authors' ``VSEModel`` (BUTD-region encoder + ``EncoderText``: BERT, linear, GPO),
stored inputs, and what their code computed from them in float64 on the CPU (``tools/golden/vse_infinity_bert.py``,
run by hand; ``provenance.json`` names the commit and the patches). Here the state is renamed to retr's parameters
(the importer's ``vse_infinity_name``) and retr's caption processing (:class:`~retr.store.wordpiece.
WordPieceVocabulary`, the model's word-piece augmentation), encoders, loss and training (the loop's ``train_step``,
the model's AdamW groups, the loop's ``StepLR`` and warm-up flag) run in float64 on the same inputs.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the bert extra is not installed: pip install 'retr[bert]'")

from golden_support import WidenFeatures, assert_relative_gap, load_golden, one_torch_thread  # noqa: E402, F401
from retr.store.wordpiece import WordPieceVocabulary  # noqa: E402
from retr.trainers.models import create_model  # noqa: E402
from retr.trainers.models.layers import lengths_mask  # noqa: E402
from retr.trainers.models.optim import apply_implementation  # noqa: E402
from retr.trainers.runs.official_checkpoints import vse_infinity_name  # noqa: E402
from retr.trainers.training.loop import lr_schedule, train_step  # noqa: E402

pytestmark = pytest.mark.numerical

PROVENANCE, INPUTS, FIGURES = load_golden("vse_infinity_bert")
OPT = json.loads(str(INPUTS["opt_json"]))
TOKENS = [str(t) for t in INPUTS["tokens"]]
BERT_CONFIG = {**json.loads(str(INPUTS["bert_config_json"])), "vocab_size": len(TOKENS)}
CPU = torch.device("cpu")

#: Largest relative gap (max |retr − authors| / max |authors|) and why: the arithmetic is the same, operation by
#: operation; what is left is float64 rounding where a reduction runs in another order (attention through PyTorch's
#: scaled_dot_product_attention with a boolean mask against their additive −10000 mask, whose exp is exactly 0 in
#: float64; GPO's weights from one GRU call over every size; the gradient-norm sum; AdamW's foreach kernels):
#: measured ≤ 1e-13 with 1, 2 and 4 threads. 1e-11 leaves room for other BLAS builds and still catches a real change:
#: BERT's learning rate at 1× instead of 0.1×, a weight decay of 1e-2, the pooler's output instead of the tokens',
#: or the [PAD] key mask left out each fails these tests by many orders of magnitude.
TOL = 1e-11
#: As for the BiGRU figures: the bias of the image MLP's first Linear feeds a batch norm that removes it, so its
#: gradient is rounding noise that AdamW turns into steps of up to lr·|g|/eps; 1e-8 bounds that.
NOISE_DRIVEN = {"img_enc.mlp.0.bias": 1e-8, "img_enc.mlp.1.running_mean": 1e-8}
#: Likewise each attention layer's key bias: adding it shifts every score of a query by the same amount, which the
#: softmax removes, so its gradient is rounding noise (~1e-16) and, starting at 0, so is its value (~1e-15 after
#: the steps, lr·|g|/eps at most). Compared on an absolute scale: within 1e-12 of theirs (a real step of that
#: bias, at BERT's lr 1e-3, would move it by ~1e-3).
KEY_BIAS, KEY_BIAS_ABS = "attention.self.key.bias", 1e-12


def assert_close(got, want, what: str, tol: float = TOL, scale: float | None = None) -> float:
    return assert_relative_gap(got, want, what, tol, scale)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Every test here on one thread (golden_support.one_torch_thread)."""


def vocabulary() -> WordPieceVocabulary:
    return WordPieceVocabulary(TOKENS, lowercase=True, max_length=BERT_CONFIG["max_position_embeddings"])


def authors_model(augment_words: float = 0.0):
    """retr's BERT VSE∞ in float64 holding the stored initial state, region dropping off (random)."""
    torch.manual_seed(0)
    model = create_model("vse-infinity", vocab_size=len(TOKENS), img_dim=OPT["img_dim"], text_encoder="bert",
                         bert_config=BERT_CONFIG, embed_size=OPT["embed_size"], margin=OPT["margin"],
                         drop_regions=0.0, augment_words=augment_words)
    state = {vse_infinity_name(k[len("init."):]): torch.from_numpy(v) for k, v in INPUTS.items()
             if k.startswith("init.")}
    state.pop(None)
    model.load_state_dict(state, strict=True)
    vocab = vocabulary()
    model.prepare_training({"word_continues": torch.from_numpy(vocab.continuation()),
                            "mask_token": torch.tensor(vocab.mask_id)})
    return model.double()


def train_batch(b: int) -> dict:
    lengths = torch.from_numpy(INPUTS["train.lengths"][b])
    features = torch.from_numpy(INPUTS["train.images"][b])
    return {"features": features, "mask": torch.ones(features.shape[:2], dtype=torch.bool),
            "tokens": torch.from_numpy(INPUTS["train.tokens"][b])[:, :int(lengths.max())], "lengths": lengths}


def test_golden_set_is_what_the_generator_describes():
    assert PROVENANCE["repository"] == "https://github.com/woodfrog/vse_infty"
    assert PROVENANCE["commit"] == "29df9d65f0e0b5bac3b6f6e6697a285ff89f52dc"
    assert all(p["why"] for p in PROVENANCE["patches"])
    norms = FIGURES["train.grad_norm"]
    assert (norms > OPT["grad_clip"]).any() and (norms < OPT["grad_clip"]).any()
    assert OPT["vse_mean_warmup_epochs"] == 1 and len({tuple(r) for r in FIGURES["train.group_lr"]}) == 2
    assert (FIGURES["captions.ids"] == TOKENS.index("[UNK]")).any()


def test_captions_are_tokenised_as_their_process_caption_does():
    """Punctuation, accents, capitals, a Chinese character, a control character, words cut into pieces, words
    WordPiece cannot cut ([UNK]) and the text "[MASK]" (their basic tokenizer matches no special token)."""
    vocab = vocabulary()
    captions = [str(c) for c in INPUTS["captions"]]
    for caption, ids, n in zip(captions, FIGURES["captions.ids"], FIGURES["captions.lengths"]):
        assert vocab.encode(caption) == ids[:n].tolist(), caption
    lists = vocab.encode_all(captions)
    assert [list(map(int, lists[i])) for i in range(len(captions))] == [
        ids[:n].tolist() for ids, n in zip(FIGURES["captions.ids"], FIGURES["captions.lengths"])]


def test_word_piece_augmentation_fed_their_draws(monkeypatch):
    """Their ``process_caption(train=True)`` fed stored draws (one uniform a word, one token a replaced piece) and
    retr's augmentation fed the same: masked, replaced and removed words, every piece of a word alike."""
    model = authors_model(augment_words=0.2).train()
    tokens = torch.from_numpy(FIGURES["captions.ids"])
    lengths = torch.from_numpy(FIGURES["captions.lengths"])
    u, replacement = torch.from_numpy(INPUTS["augment.u"]), torch.from_numpy(INPUTS["augment.random"])
    monkeypatch.setattr(torch, "rand", lambda shape, **k: u.clone().to(torch.get_default_dtype()))
    monkeypatch.setattr(torch, "randint", lambda low, high, shape, **k: replacement.clone())
    out, new_lengths = model.augment_word_pieces(tokens, lengths)
    assert new_lengths.tolist() == FIGURES["augment.lengths"].tolist()
    width = FIGURES["augment.ids"].shape[1]
    assert out[:, :width].tolist() == FIGURES["augment.ids"].tolist()
    assert not out[:, width:].any()


def test_eval_embeddings_and_similarities():
    """Eval mode: images of 1 to 6 regions, the captions above (4 to 15 pieces): embeddings and similarities."""
    model = authors_model().eval()
    counts = torch.from_numpy(INPUTS["eval.counts"])
    with torch.no_grad():
        images = model.encode_images(torch.from_numpy(INPUTS["eval.images"]).double(), lengths_mask(counts, 6))
        captions = model.encode_captions(torch.from_numpy(FIGURES["captions.ids"]),
                                         torch.from_numpy(FIGURES["captions.lengths"]))
    assert_close(images["vector"], FIGURES["eval.img_emb"], "image embeddings")
    assert_close(captions["vector"], FIGURES["eval.cap_emb"], "caption embeddings")
    assert_close(images["vector"] @ captions["vector"].T, FIGURES["eval.sims"], "similarities")


def test_loss_and_every_gradient():
    """Batch 0 in train mode: the sum-of-violations loss and the hardest-negative loss with every parameter's
    gradient (BERT's included; its pooler is not in retr's model, and their forward never uses it)."""
    model = authors_model().train()
    b = train_batch(0)
    args = (b["features"].double(), b["mask"], b["tokens"], b["lengths"])
    model.warming_up = True
    assert_close(model(*args).item(), FIGURES["loss.sum"], "loss (sum of violations)")
    model.warming_up = False
    model.zero_grad()
    loss = model(*args)
    loss.backward()
    assert_close(loss.item(), FIGURES["loss.max"], "loss (hardest negatives)")
    theirs = {vse_infinity_name(k[len("grad."):]) for k in FIGURES if k.startswith("grad.")}
    assert theirs == {n for n, _ in model.named_parameters()}
    largest = max(float(np.abs(FIGURES[k]).max()) for k in FIGURES if k.startswith("grad."))
    for key in (k for k in FIGURES if k.startswith("grad.")):
        assert_close(dict(model.named_parameters())[vse_infinity_name(key[5:])].grad, FIGURES[key], key, scale=largest)


def test_training_steps():
    """Their ``main``/``train`` (AdamW in three groups, BERT at 0.1 × lr, weight decay 1e-4, clip, ×0.1 at
    ``lr_update``, one warm-up epoch of summed violations) against retr's ``train_step`` with
    ``configure_optimizer``, ``lr_schedule`` and the loop's ``warming_up``: loss, every group's learning rate and
    the gradient norm of every step, the whole state after step 1 and after the last."""
    model = authors_model()
    optimizer = model.configure_optimizer(OPT["learning_rate"])
    assert [g["weight_decay"] for g in optimizer.param_groups] == [1e-4] * 3
    apply_implementation(optimizer, "auto", CPU)
    scheduler = lr_schedule(optimizer, OPT["lr_update"])
    norms, clip = [], torch.nn.utils.clip_grad_norm_
    losses, lrs, after_first = [], [], None

    def recording_clip(params, max_norm, *a, **k):
        norms.append(float(clip(params, max_norm, *a, **k)))
        return norms[-1]
    torch.nn.utils.clip_grad_norm_ = recording_clip
    try:
        for epoch in range(OPT["num_epochs"]):
            model.warming_up = epoch < OPT["vse_mean_warmup_epochs"]
            for b in range(INPUTS["train.images"].shape[0]):
                lrs.append([g["lr"] for g in optimizer.param_groups])
                losses.append(train_step(WidenFeatures(model), train_batch(b), optimizer, None, OPT["grad_clip"], CPU))
                if after_first is None:
                    after_first = {k: v.clone() for k, v in model.state_dict().items()}
            scheduler.step()
    finally:
        torch.nn.utils.clip_grad_norm_ = clip
    np.testing.assert_allclose(lrs, FIGURES["train.group_lr"], rtol=1e-15, atol=0)
    assert_close(losses, FIGURES["train.loss"], "loss per step")
    assert_close(norms, FIGURES["train.grad_norm"], "gradient norm per step")
    for key in (k for k in FIGURES if k.startswith("trained.")):
        name = vse_infinity_name(key[len("trained."):])
        if name is None or name.endswith("num_batches_tracked"):
            continue
        tol, scale = (KEY_BIAS_ABS, 1.0) if name.endswith(KEY_BIAS) else (NOISE_DRIVEN.get(name, TOL), None)
        assert_close(after_first[name], FIGURES[f"step1.{key[8:]}"], f"{name} after step 1", tol, scale)
        assert_close(model.state_dict()[name], FIGURES[key], f"{name} after {len(losses)} steps", tol, scale)


# ---------------------------------------------------------------------------------------------- their checkpoints

def bert_folder(folder, **changes):
    """``folder`` as a pretrained BERT's files for ``--bert-model``: the golden BERT's config.json and vocab.txt
    (no weights: importing reads none, the checkpoint holds BERT's)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", **BERT_CONFIG, **changes}))
    (folder / "vocab.txt").write_text("".join(t + "\n" for t in TOKENS), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    return folder


def authors_checkpoint(folder, opt: dict | None = None, image_state: dict | None = None):
    """The stored initial state as ``folder/model_best.pth`` in the authors' checkpoint layout (their
    ``save_checkpoint``: ``{'model': [img_enc.state_dict(), txt_enc.state_dict()], 'opt': Namespace, …}``)."""
    import argparse

    folder.mkdir(parents=True, exist_ok=True)
    state = {k[len("init."):]: torch.from_numpy(v) for k, v in INPUTS.items() if k.startswith("init.")}
    parts = [{k[len(side):]: v for k, v in state.items() if k.startswith(side)} for side in ("img_enc.", "txt_enc.")]
    if image_state is not None:
        parts[0] = {**parts[0], **image_state}
    checkpoint = folder / "model_best.pth"
    torch.save({"model": parts, "opt": argparse.Namespace(**(opt or OPT)), "epoch": 25, "best_rsum": 520.5},
               checkpoint)
    return checkpoint


def assert_their_eval_embeddings(run) -> None:
    from retr.trainers.runs.checkpoint import load_run_model

    model, vocab, config = load_run_model(run)
    assert config["model_args"]["text_encoder"] == "bert" and vocab.idx2word == TOKENS
    model = model.double().eval()
    counts = torch.from_numpy(INPUTS["eval.counts"])
    with torch.no_grad():
        images = model.encode_images(torch.from_numpy(INPUTS["eval.images"]).double(), lengths_mask(counts, 6))
        ids = [vocab.encode(str(c)) for c in INPUTS["captions"]]
        from retr.trainers.data.splits import pad_tokens
        tokens, lengths = pad_tokens(ids)
        captions = model.encode_captions(tokens, lengths)
    assert_close(images["vector"] @ captions["vector"].T, FIGURES["eval.sims"], "imported model's similarities")


def test_an_imported_master_checkpoint_gives_their_similarities(tmp_path, run_cli):
    """import-vse-infinity-checkpoint on a master-branch checkpoint (BERT) holding the state their code computed the
    figures from, with --bert-model the BERT's configuration and vocabulary: the run tokenises the captions and
    scores them against the images as their code did."""
    checkpoint = authors_checkpoint(tmp_path / "released")
    run_cli("train", "import-vse-infinity-checkpoint", checkpoint, "--bert-model", bert_folder(tmp_path / "bert"),
            "--out", tmp_path / "run")
    assert_their_eval_embeddings(tmp_path / "run")
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model_args"]["bert_config"] == BERT_CONFIG and config["epoch"] == 25


def test_a_released_folder_and_a_hub_folder_import_offline(tmp_path, run_cli, monkeypatch):
    """CHECKPOINT as the released model's folder (``hf download`` leaves ``<folder>/model_best.pth``) and as
    ``hf-hub:ORG/NAME/FOLDER`` read offline from a Hugging Face cache laid out as huggingface_hub lays it out, with
    the BERT from the cache too; nothing is downloaded and nothing written into the cache."""
    import huggingface_hub.constants

    from test_hub import COMMIT

    released = tmp_path / "vse-infty" / "f30k_butd_region_bert"
    authors_checkpoint(released)
    bert = bert_folder(tmp_path / "bert")
    run_cli("train", "import-vse-infinity-checkpoint", released, "--bert-model", bert, "--out", tmp_path / "run1")
    assert_their_eval_embeddings(tmp_path / "run1")

    cache = tmp_path / "hf-cache"
    for repo, files in (("cccjc/vse-infty", tmp_path / "vse-infty"), ("tiny-lab/tiny-bert", bert)):
        snapshot = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / COMMIT
        for file in (p for p in files.rglob("*") if p.is_file()):
            (snapshot / file.relative_to(files)).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / file.relative_to(files)).write_bytes(file.read_bytes())
        (snapshot.parents[1] / "refs").mkdir()
        (snapshot.parents[1] / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("RETR_OFFLINE", "1")
    before = sorted(str(p) for p in cache.rglob("*"))
    run_cli("train", "import-vse-infinity-checkpoint", "hf-hub:cccjc/vse-infty/f30k_butd_region_bert",
            "--bert-model", "tiny-lab/tiny-bert", "--out", tmp_path / "run2")
    assert_their_eval_embeddings(tmp_path / "run2")
    assert sorted(str(p) for p in cache.rglob("*")) == before
    code, stdout, stderr = run_cli.as_user("train", "import-vse-infinity-checkpoint",
                                           "hf-hub:cccjc/vse-infty/coco_butd_region_bert", "--bert-model",
                                           "tiny-lab/tiny-bert", "--out", tmp_path / "run3")
    assert code != 0 and "coco_butd_region_bert/model_best.pth" in stderr and "hf download cccjc/vse-infty" in stderr
    assert not (tmp_path / "run3").exists()


MASTER_REFUSED = {
    "vocab": "is a BERT model (the authors' master branch), which tokenises captions with --bert-model",
    "bert-size": ("the checkpoint's BERT has hidden_size 16 but --bert-model ", "bert has 32: give --bert-model"),
    "bert-layers": ("the checkpoint's BERT has num_hidden_layers 2 but --bert-model ", "bert has 3: give"),
    "backbone": "precomp_enc_type='backbone': a VSE∞ model over a CNN backbone it fine-tunes end to end on raw images",
    "grid-weights": "a CNN backbone in its image encoder: a VSE∞ model over a CNN backbone",
    "unknown-field": "field(s) retr does not know: text_pooling='max'",
    "vocab-size": "the checkpoint's options say vocab_size=30522 but its BERT has",
}


@pytest.mark.parametrize("case", list(MASTER_REFUSED))
def test_master_checkpoints_retr_cannot_express_are_refused_in_one_line(tmp_path, run_cli, case):
    from test_pipeline_wrong_inputs import assert_one_error_line

    opt, image_state, bert_changes, extra = dict(OPT), None, {}, []
    if case == "vocab":
        from retr.store.vocab import Vocabulary
        extra = ["--vocab", Vocabulary([f"word{i}" for i in range(20)]).save(tmp_path / "f30k_precomp_vocab.json")]
    elif case == "bert-size":
        bert_changes = {"hidden_size": 32}
    elif case == "bert-layers":
        bert_changes = {"num_hidden_layers": 3}
    elif case == "backbone":
        opt["precomp_enc_type"] = "backbone"
    elif case == "grid-weights":
        image_state = {"backbone.base.0.weight": torch.zeros(4, 3, 7, 7)}
    elif case == "unknown-field":
        opt["text_pooling"] = "max"
    elif case == "vocab-size":
        opt["vocab_size"] = 30522
    checkpoint = authors_checkpoint(tmp_path / "released", opt, image_state)
    code, stdout, stderr = run_cli.as_user("train", "import-vse-infinity-checkpoint", checkpoint, "--bert-model",
                                           bert_folder(tmp_path / "bert", **bert_changes), *extra,
                                           "--out", tmp_path / "run")
    assert_one_error_line(code, stdout, stderr)
    expected = MASTER_REFUSED[case]
    assert all(part in stderr for part in ((expected,) if isinstance(expected, str) else expected))
    assert not (tmp_path / "run").exists()


def test_online_the_hub_folder_s_checkpoint_is_asked_for_by_name(tmp_path, run_cli, monkeypatch):
    """Online, hf-hub:ORG/NAME/FOLDER[@REVISION] asks huggingface_hub (replaced by a recorder: nothing goes out) for
    FOLDER/model_best.pth of ORG/NAME into the Hugging Face cache, and imports what it returns."""
    import huggingface_hub
    import huggingface_hub.constants

    monkeypatch.delenv("RETR_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    checkpoint = authors_checkpoint(tmp_path / "downloaded")
    calls = []

    def hf_hub_download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs))
        return str(checkpoint)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    run_cli("train", "import-vse-infinity-checkpoint", "hf-hub:cccjc/vse-infty/coco_butd_region_bert@v1",
            "--bert-model", bert_folder(tmp_path / "bert"), "--out", tmp_path / "run")
    assert calls == [("cccjc/vse-infty", "model_best.pth",
                      {"subfolder": "coco_butd_region_bert", "revision": "v1", "cache_dir": str(tmp_path / "hf-cache"),
                       "local_files_only": False})]
    assert_their_eval_embeddings(tmp_path / "run")
    code, stdout, stderr = run_cli.as_user("train", "import-vse-infinity-checkpoint", "hf-hub:cccjc/vse-infty",
                                           "--out", tmp_path / "run2")
    assert code != 0 and "names no folder of a Hub repository: write hf-hub:ORG/NAME/FOLDER" in stderr
