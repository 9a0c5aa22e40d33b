"""Golden figures of VSE∞ with the BERT text encoder computed by the authors' code (woodfrog/vse_infty, ``master``
branch), for ``tests/test_golden_vse_infinity_bert.py``.

Run by hand (never by CI), from the repository root, with the authors' repository in a scratch folder outside it::

    git clone https://github.com/woodfrog/vse_infty /tmp/authors/vse_infty_master      # commit 29df9d65…
    OMP_NUM_THREADS=1 .venv/bin/python tools/golden/vse_infinity_bert.py /tmp/authors/vse_infty_master

Nothing is downloaded: their ``EncoderText`` loads ``bert-base-uncased`` by name, and here ``lib.encoders.BertModel``
is replaced by a stand-in whose ``from_pretrained`` builds transformers' ``BertModel`` of a tiny random configuration
(:data:`BERT_CONFIG`, dropout 0 so train mode is deterministic, eager attention: the additive-mask arithmetic of
the transformers 2.1 their requirements pin); their tokenizer is transformers' ``BertTokenizerLegacy`` (the Python
``BertTokenizer`` of their version, renamed in transformers 5: ``basic_tokenizer``, ``wordpiece_tokenizer``,
``vocab``) over a small WordPiece vocabulary (:data:`TOKENS`). It copies the checkout to a temporary folder, applies
:data:`PATCHES` (CPU only, the tiny BERT's width; nothing computed changes) and runs on the CPU in float64:

* captions: their ``process_caption`` with ``train=False`` on captions with punctuation, accents, capitals, digits,
  a Chinese character, a control character, words cut into pieces and words outside the vocabulary;
* augmentation: their ``process_caption`` with ``train=True``, its ``random.random`` (one draw a word) and
  ``random.choice`` (one draw a replaced piece) fed stored values, so retr's augmentation can be fed the same;
* embeddings (eval mode): their ``forward_emb`` on images with varying numbers of regions and captions of varying
  lengths (zero-padded by their ``collate_fn``), and the similarity matrix;
* loss (train mode, training batch 0): ``ContrastiveLoss`` with the sum of violations and with hardest negatives,
  and every parameter's gradient of the latter;
* training: their ``main`` loop's epoch body (``adjust_learning_rate``, ``set_max_violation(True)`` from epoch
  ``vse_mean_warmup_epochs``) and their ``train`` (``train_emb``: AdamW in their three groups — text without BERT,
  BERT at 0.1 × lr, image — weight decay 1e-4, gradient-norm clip): loss, each group's learning rate and the
  gradient norm of every step, the state after step 1 and after the last. Full region sets, as for the BiGRU
  figures (their MLP's batch norm then sees the rows retr's sees).
"""
from __future__ import annotations

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import argparse
import json
import random
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Patch, authors_checkout, padded, recorded_clip_norms, write_figures  # noqa: E402
from vsepp import Recorder  # noqa: E402

REPOSITORY = "https://github.com/woodfrog/vse_infty"
COMMIT = "29df9d65f0e0b5bac3b6f6e6697a285ff89f52dc"     # head of master (BERT)

PATCHES = [
    Patch("lib/vse.py", "lengths = torch.Tensor(lengths).cuda()", "lengths = torch.Tensor(lengths)",
          "forward_emb moves the caption lengths to CUDA unconditionally (everything else moves only when "
          "torch.cuda.is_available()); the figures are computed on the CPU"),
    Patch("lib/encoders.py", "self.linear = nn.Linear(768, embed_size)",
          "self.linear = nn.Linear(self.bert.config.hidden_size, embed_size)",
          "EncoderText hard-codes bert-base's width 768; the tiny BERT these figures use is narrower"),
]

STUBBED = {"imageio": "lib/datasets/image_caption.py reads raw images with imageio.imread (unused: precomputed "
                      "region features are fed directly)",
           "cv2": "as imageio (image resizing)"}

SEED = 8642
#: a tiny BERT (bert-base-uncased's structure, shrunk); no dropout, so train mode is deterministic
BERT_CONFIG = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32,
               "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
               "max_position_embeddings": 40, "type_vocab_size": 2, "initializer_range": 0.02,
               "layer_norm_eps": 1e-12, "pad_token_id": 0}
WORDS = ["a", "man", "dog", "in", "the", "on", "is", "with", "two", "red", "blue", "of", "and", "at", "cafe", "3",
         "people", "ball", "grass", "water", "near", "street", "woman", "her", "smiling", "running", "young",
         "playing"]
#: the vocabulary in id order: BERT's specials where bert-base-uncased has them ([PAD] 0 … ), punctuation, whole
#: words, and pieces of words cut in two (``run`` ``##ning``), so captions hold words of several pieces
TOKENS = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "!", "'", "-", "[", "]", "\u4e2d",
          *WORDS, "bicycle", "jump", "##ing", "##s", "##ed", "sk", "##ate", "##board", "##er"]
CAPTIONS = [
    "A man is running on the grass.",
    "Two dogs, playing with a red ball!",
    "A YOUNG woman smiling at her skateboarder-friend",
    "People near the café on Street 3",
    "the dog's ball is blue \u4e2d and red",
    "a\tman  jumped\x00 over the zebra",
    "A [MASK] in the water.",
    "Two young people skating near a bicycle",
]
IMG_DIM, EMBED, REGIONS = 24, 16, 6
BATCH, TRAIN_BATCHES, EPOCHS, LR_UPDATE, WARMUP = 8, 2, 3, 2, 1
LEARNING_RATE, GRAD_CLIP, MARGIN = 0.01, 30.0, 0.2


def authors_opt() -> argparse.Namespace:
    """Every option of their ``arguments.py`` (its defaults, except the sizes and schedule of this run) and the
    ``vocab_size`` their ``train.py`` sets."""
    return argparse.Namespace(
        data_path="/nonexistent", data_name="f30k", vocab_path="./vocab/", margin=MARGIN, num_epochs=EPOCHS,
        batch_size=BATCH, word_dim=300, embed_size=EMBED, grad_clip=GRAD_CLIP, learning_rate=LEARNING_RATE,
        lr_update=LR_UPDATE, optim="adam", workers=0, log_step=10 ** 9, val_step=10 ** 9,
        logger_name="runs/golden", model_name="runs/golden", resume="", max_violation=False, img_dim=IMG_DIM,
        no_imgnorm=False, no_txtnorm=False, precomp_enc_type="basic", backbone_path="", backbone_source="detector",
        vse_mean_warmup_epochs=WARMUP, reset_start_epoch=False, backbone_warmup_epochs=5, embedding_warmup_epochs=2,
        backbone_lr_factor=0.01, input_scale_factor=1, vocab_size=len(TOKENS))


def import_authors(copy: Path):
    import torch
    import transformers

    recorder = Recorder()
    sys.modules["tensorboard_logger"] = recorder
    for name in STUBBED:
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].imread = None
    sys.path.insert(0, str(copy))
    import lib.encoders as a_enc

    class TinyBert:
        """Stands in for ``transformers.BertModel`` in their ``EncoderText``: ``from_pretrained`` builds the tiny
        random BERT (the seed in force when their ``VSEModel`` is built decides its weights)."""

        @staticmethod
        def from_pretrained(name):
            assert name == "bert-base-uncased"
            return transformers.BertModel(transformers.BertConfig(vocab_size=len(TOKENS), **BERT_CONFIG,
                                                                  attn_implementation="eager"))
    a_enc.BertModel = TinyBert
    import lib.datasets.image_caption as a_data
    import lib.evaluation as a_eval
    import lib.loss as a_loss
    import lib.vse as a_vse
    import train as a_train
    assert torch is not None
    return a_vse, a_loss, a_eval, a_train, a_data, recorder


def tokenizer():
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    vocab_file = Path(tempfile.mkdtemp(prefix="golden-vocab-")) / "vocab.txt"
    vocab_file.write_text("".join(t + "\n" for t in TOKENS), encoding="utf-8")
    tok = BertTokenizerLegacy(str(vocab_file), do_lower_case=True)
    assert [tok.vocab[t] for t in TOKENS] == list(range(len(TOKENS))) and not tok.basic_tokenizer.never_split
    return tok


def main() -> None:
    source, copy = authors_checkout(__doc__.split("\n")[0], "woodfrog/vse_infty, branch master", COMMIT, PATCHES)
    a_vse, a_loss, a_eval, a_train, a_data, recorder = import_authors(copy)
    import torch
    torch.set_num_threads(1)
    assert not torch.cuda.is_available()
    tok = tokenizer()
    inputs: dict[str, np.ndarray] = {"tokens": np.array(TOKENS), "captions": np.array(CAPTIONS),
                                     "bert_config_json": np.array(json.dumps(BERT_CONFIG, sort_keys=True))}
    figures: dict[str, np.ndarray] = {}

    # ---- their caption processing, evaluation (no augmentation)
    encoded = [a_data.process_caption(tok, tok.basic_tokenizer.tokenize(c), train=False).long().tolist()
               for c in CAPTIONS]
    figures["captions.ids"] = padded(encoded, max(map(len, encoded)))
    figures["captions.lengths"] = np.array([len(e) for e in encoded], dtype=np.int64)
    assert tok.unk_token_id in figures["captions.ids"], "some caption should hold a word WordPiece cannot cut"

    # ---- their augmentation, fed stored draws: one uniform a word, one token a replaced piece
    rng = np.random.default_rng(SEED)
    words = [tok.basic_tokenizer.tokenize(c) for c in CAPTIONS]
    word_u = [np.float32(rng.choice([0.01, 0.03, 0.07, 0.105, 0.115, 0.13, 0.17, 0.19, 0.35, 0.6, 0.9], size=len(w)))
              for w in words]                              # away from 0.1, 0.12, 0.2: float32 vs float64 division
    width = int(figures["captions.ids"].shape[1])
    draws_u = np.ones((len(CAPTIONS), width), dtype=np.float32)            # per position (the word's, on its pieces)
    draws_random = np.zeros((len(CAPTIONS), width), dtype=np.int64)
    augmented = []
    for c, caption_words in enumerate(words):
        position, word_random = 1, []
        for w, word in enumerate(caption_words):
            word_random.append([])
            for _ in tok.wordpiece_tokenizer.tokenize(word):
                draws_u[c, position] = word_u[c][w]
                draws_random[c, position] = int(rng.integers(0, len(TOKENS)))
                word_random[-1].append(TOKENS[draws_random[c, position]])
                position += 1
        at = {"word": -1, "piece": 0}

        def next_uniform(_u=word_u[c], _at=at):          # their one draw a word, in word order
            _at["word"], _at["piece"] = _at["word"] + 1, 0
            return float(_u[_at["word"]])

        def next_choice(seq, _random=word_random, _at=at):   # their one draw a replaced piece
            token = _random[_at["word"]][_at["piece"]]
            assert token in seq
            _at["piece"] += 1
            return token
        real_random, real_choice = random.random, random.choice
        random.random, random.choice = next_uniform, next_choice
        try:
            out = a_data.process_caption(tok, caption_words, train=True).long().tolist()
        finally:
            random.random, random.choice = real_random, real_choice
        augmented.append(out)
    # random.choice is consumed only by hit-and-replaced words, in piece order: the stored draws at those positions
    inputs["augment.u"], inputs["augment.random"] = draws_u, draws_random
    figures["augment.ids"] = padded(augmented, width)
    figures["augment.lengths"] = np.array([len(a) for a in augmented], dtype=np.int64)
    for u in word_u:
        assert all(abs(x / 0.2 - y) > 1e-4 for x in u for y in (0.5, 0.6, 1.0))

    # ---- the initial state (float32), batch-norm statistics seeded so eval mode is not the identity
    opt = authors_opt()
    torch.manual_seed(SEED)
    initial = a_vse.VSEModel(opt)
    bn = initial.img_enc.mlp.bns[0]
    bn.running_mean.copy_(torch.from_numpy(rng.normal(0, 0.5, bn.num_features).astype(np.float32)))
    bn.running_var.copy_(torch.from_numpy(rng.uniform(0.5, 2.0, bn.num_features).astype(np.float32)))
    img_state, txt_state = (dict(s) for s in initial.state_dict())
    state = {**{f"img_enc.{k}": v.detach().clone() for k, v in img_state.items()},
             **{f"txt_enc.{k}": v.detach().clone() for k, v in txt_state.items()}}
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    torch.set_default_dtype(torch.float64)

    def fresh_model():
        model = a_vse.VSEModel(opt)
        model.load_state_dict([{k[len("img_enc."):]: v for k, v in state.items() if k.startswith("img_enc.")},
                               {k[len("txt_enc."):]: v for k, v in state.items() if k.startswith("txt_enc.")}])
        model.logger = a_eval.LogCollector()
        assert all(p.dtype == torch.float64 for p in model.params)
        return model

    def full_state(model):
        return {**{f"img_enc.{k}": v for k, v in model.img_enc.state_dict().items()},
                **{f"txt_enc.{k}": v for k, v in model.txt_enc.state_dict().items()}}

    def named_parameters(model):
        return {**{f"img_enc.{k}": p for k, p in model.img_enc.named_parameters()},
                **{f"txt_enc.{k}": p for k, p in model.txt_enc.named_parameters()}}

    inputs.update({f"init.{k}": v.numpy() for k, v in state.items()})
    inputs["opt_json"] = np.array(json.dumps(vars(opt), sort_keys=True))

    # ---- embeddings and similarities in eval mode: varying region counts and caption lengths
    model = fresh_model()
    model.val_start()
    eval_counts = np.array([REGIONS, 2, 5, 1, REGIONS, 3, 4, REGIONS], dtype=np.int64)
    eval_images = np.abs(rng.standard_normal((len(eval_counts), REGIONS, IMG_DIM))).astype(np.float32)
    eval_images[np.arange(REGIONS)[None, :] >= eval_counts[:, None]] = 0.0
    inputs["eval.images"], inputs["eval.counts"] = eval_images, eval_counts
    with torch.no_grad():
        img_emb, cap_emb = model.forward_emb(torch.from_numpy(eval_images).double(),
                                             torch.from_numpy(figures["captions.ids"]),
                                             figures["captions.lengths"].tolist(),
                                             image_lengths=torch.tensor(eval_counts, dtype=torch.float64))
    figures["eval.img_emb"], figures["eval.cap_emb"] = img_emb.numpy().copy(), cap_emb.numpy().copy()
    figures["eval.sims"] = a_eval.compute_sim(img_emb.numpy(), cap_emb.numpy())

    # ---- training batches: full region sets, captions of random words (ids 6 … V-1) between [CLS] and [SEP]
    train_images = np.abs(rng.standard_normal((TRAIN_BATCHES, BATCH, REGIONS, IMG_DIM))).astype(np.float32)
    cls, sep = TOKENS.index("[CLS]"), TOKENS.index("[SEP]")
    train_captions = [[[cls, *rng.integers(6, len(TOKENS), size=int(rng.integers(1, 10))).tolist(), sep]
                       for _ in range(BATCH)] for _ in range(TRAIN_BATCHES)]
    width = max(len(c) for b in train_captions for c in b)
    inputs["train.images"] = train_images
    inputs["train.tokens"] = np.stack([padded(b, width) for b in train_captions])
    inputs["train.lengths"] = np.array([[len(c) for c in b] for b in train_captions], dtype=np.int64)

    def batch(b: int):
        lengths = inputs["train.lengths"][b].tolist()
        return (torch.from_numpy(train_images[b]).double(), torch.full((BATCH,), float(REGIONS)),
                torch.from_numpy(inputs["train.tokens"][b][:, :max(lengths)]), lengths, list(range(BATCH)))

    # ---- loss and gradients on batch 0, initial state, train mode
    for name, max_violation in (("sum", False), ("max", True)):
        model = fresh_model()
        model.train_start()
        images, img_lengths, captions, lengths, _ = batch(0)
        img_emb, cap_emb = model.forward_emb(images, captions, lengths, image_lengths=img_lengths)
        loss = a_loss.ContrastiveLoss(opt, margin=opt.margin, max_violation=max_violation)(img_emb, cap_emb)
        loss.backward()
        figures[f"loss.{name}"] = np.array(loss.item())
        for key, p in named_parameters(model).items():
            if max_violation and p.grad is not None:      # (the MLP's last batch norm, BERT's pooler: never used)
                figures[f"grad.{key}"] = p.grad.numpy().copy()

    # ---- training: their main loop's epoch body and their train()
    model = fresh_model()
    snapshots = {}

    def on_value(name, value, step):
        if name == "Le" and step == 1:
            snapshots.update({k: v.detach().numpy().copy() for k, v in full_state(model).items()})
    recorder.on_value = on_value
    recorder.values.clear()

    class Loader(list):
        """What their ``train`` reads of a DataLoader: iteration, ``.dataset`` and ``.batch_size``."""
        dataset = range(TRAIN_BATCHES * BATCH)
        batch_size = BATCH

    loader = Loader(batch(b) for b in range(TRAIN_BATCHES))
    group_lrs = []
    step = model.optimizer.step

    def recording_step(*args, **kwargs):
        group_lrs.append([g["lr"] for g in model.optimizer.param_groups])
        return step(*args, **kwargs)
    model.optimizer.step = recording_step
    assert [g["weight_decay"] for g in model.optimizer.param_groups] == [1e-4] * 3
    with recorded_clip_norms(a_vse, "clip_grad_norm_") as grad_norms:
        for epoch in range(opt.num_epochs):               # their main(), without validation and checkpoints
            a_train.adjust_learning_rate(opt, model.optimizer, epoch, [opt.lr_update])
            if epoch >= opt.vse_mean_warmup_epochs:
                opt.max_violation = True
                model.set_max_violation(opt.max_violation)
            a_train.train(opt, loader, model, epoch, None)
    figures["train.loss"] = recorder.series("Le")
    figures["train.group_lr"] = np.array(group_lrs)
    figures["train.grad_norm"] = np.array(grad_norms)
    assert len(figures["train.loss"]) == len(grad_norms) == EPOCHS * TRAIN_BATCHES == model.Eiters
    for key, v in full_state(model).items():
        figures[f"step1.{key}"] = snapshots[key]
        figures[f"trained.{key}"] = v.detach().numpy().copy()
    assert (figures["train.grad_norm"] > GRAD_CLIP).any() and (figures["train.grad_norm"] < GRAD_CLIP).any(), \
        "choose GRAD_CLIP so that some steps clip and some do not"

    import transformers
    notes = (f"CPU, float64 (torch.set_default_dtype after the float32 initial state), torch.set_num_threads(1); "
             f"seed {SEED}; BERT {BERT_CONFIG} built by a stand-in for lib.encoders.BertModel (eager attention), "
             f"vocabulary of {len(TOKENS)} WordPiece tokens, tokenizer transformers' BertTokenizerLegacy "
             f"(transformers {transformers.__version__}; theirs pins 2.1.0); img_dim {IMG_DIM}, embed {EMBED}, "
             f"{REGIONS} regions; training: {TRAIN_BATCHES} batches of {BATCH} x {EPOCHS} epochs, AdamW lr "
             f"{LEARNING_RATE} (BERT x0.1) x0.1 from epoch {LR_UPDATE}, {WARMUP} warm-up epoch on summed violations, "
             f"grad clip {GRAD_CLIP}. Stubbed when absent: {STUBBED}. tensorboard_logger replaced by a recorder of "
             "train's per-step log; lib.vse.clip_grad_norm_ wrapped to record its return value; "
             "random.random/random.choice fed stored draws in the augmentation figures.")
    folder = write_figures("vse_infinity_bert", repository=REPOSITORY, source=source, patches=PATCHES,
                           inputs=inputs, figures=figures, notes=notes)
    for f in sorted(folder.iterdir()):
        print(f"{f}: {f.stat().st_size} bytes")
    print("captions:", [TOKENS_of(r, n) for r, n in zip(figures["captions.ids"], figures["captions.lengths"])])
    print("augmented:", [TOKENS_of(r, n) for r, n in zip(figures["augment.ids"], figures["augment.lengths"])])
    print("loss per step:", np.round(figures["train.loss"], 4).tolist())
    print("group lr per step:", figures["train.group_lr"].tolist())
    print("grad norm per step:", np.round(figures["train.grad_norm"], 4).tolist())


def TOKENS_of(row, n):
    return " ".join(TOKENS[int(i)] for i in row[:n])


if __name__ == "__main__":
    main()
