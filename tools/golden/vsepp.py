"""Golden figures of VSE++ computed by the authors' code (fartashf/vsepp), for ``tests/test_golden_vsepp.py``.

Run by hand (never by CI), from the repository root, with the authors' repository in a scratch folder outside it::

    git clone https://github.com/fartashf/vsepp /tmp/authors/vsepp     # commit abe382fd9c751d1b92c95030df8fb804a7d5ef53
    OMP_NUM_THREADS=1 .venv/bin/python tools/golden/vsepp.py /tmp/authors/vsepp

It copies that checkout to a temporary folder, applies :data:`PATCHES` (each only lets the code run on Python 3,
numpy 2, torch 2.x and a CPU; none changes what is computed), imports the authors' ``model.py``, ``evaluation.py``,
``data.py`` and ``train.py`` from the copy and runs them on the CPU in float64 on a small seeded state:

* the initial state is the authors' own ``VSE(opt)`` built with ``torch.manual_seed(SEED)`` in float32 (their
  initialisation: Xavier ``fc``, uniform(±0.1) embedding, torch's GRU default), so every stored parameter is a
  float32 number and loads exactly into a float32 checkpoint and back into a float64 model;
* image features are float32 numbers too (any loader that hands them over as float32 loses nothing);
* batches are made by the authors' ``data.collate_fn`` (captions sorted by decreasing length) from
  ``(image, caption, index, img_id)`` items as their ``PrecompDataset`` yields them (each caption with its image).

Figures (``tests/data/golden/vsepp/figures.npz``):

* evaluation (initial state; ``EVAL_FOLDS`` × ``FOLD_IMAGES`` images, 5 captions each): the embeddings from their
  ``encode_data``, the similarity matrix (their ``i2t``'s ``numpy.dot``), their ``i2t``/``t2i`` numbers and ranks
  on the whole set (a "1K-style" single set) and on each of ``EVAL_FOLDS`` folds as their ``evalrank(fold5=True)``
  cuts them, with the fold mean of ``[r(5), ri(5), rsum, ar, ari]``;
* loss (initial state, training batch 0): the score matrix, ``ContrastiveLoss`` with the sum of violations and
  with hardest negatives (``max_violation``), and every parameter's gradient of each;
* training: ``EPOCHS`` epochs of the stored batches through their ``train.train`` (``train_emb``: Adam, gradient
  norm clip) with their ``adjust_learning_rate`` before each epoch (``lr_update`` makes the rate drop ×0.1 inside
  the run): the loss, learning rate and pre-clip gradient norm of every step, every parameter after step 1 and
  after the last step.

A module the authors' files import but these computations never call is stubbed when absent (:data:`STUBBED`);
``tensorboard_logger`` is always replaced by a recorder, which is how the per-step loss and
learning rate their ``train`` logs are read. Their ``clip_grad_norm`` is wrapped (the same function, its return
value recorded) to read the pre-clip gradient norm.
"""
from __future__ import annotations

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""      # their code moves to CUDA when it sees a GPU: the figures are CPU float64

import argparse
import json
import sys
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Patch, authors_checkout, padded, recorded_clip_norms, write_figures  # noqa: E402

REPOSITORY = "https://github.com/fartashf/vsepp"
COMMIT = "abe382fd9c751d1b92c95030df8fb804a7d5ef53"

PATCHES = [
    Patch("model.py",
          "I = Variable(I.expand(x.size(0), 1, self.embed_size)-1).cuda()",
          "I = Variable(I.expand(x.size(0), 1, self.embed_size)-1)",
          "EncoderText.forward moves the gather index to CUDA unconditionally (the rest of VSE moves only when "
          "torch.cuda.is_available()); the figures are computed on the CPU"),
    Patch("model.py",
          "self.logger.update('Le', loss.data[0], img_emb.size(0))",
          "self.logger.update('Le', loss.item(), img_emb.size(0))",
          "indexing a 0-dim tensor (loss.data[0]) is an error since torch 0.5; .item() is the same number"),
    Patch("evaluation.py",
          "for i, (k, v) in enumerate(self.meters.iteritems()):",
          "for i, (k, v) in enumerate(self.meters.items()):",
          "dict.iteritems is Python 2 only (LogCollector.__str__, formatted by encode_data's and train's log lines)"),
    Patch("evaluation.py",
          "for k, v in self.meters.iteritems():",
          "for k, v in self.meters.items():",
          "dict.iteritems is Python 2 only (LogCollector.tb_log, called by train after every step)"),
    Patch("evaluation.py",
          "img_embs[ids] = img_emb.data.cpu().numpy().copy()",
          "img_embs[list(ids)] = img_emb.data.cpu().numpy().copy()",
          "collate_fn's ids is a tuple: numpy >= 1.23 reads a tuple index as one index per axis (IndexError), "
          "older numpy took it as a list of rows, which list(ids) is"),
    Patch("evaluation.py",
          "cap_embs[ids] = cap_emb.data.cpu().numpy().copy()",
          "cap_embs[list(ids)] = cap_emb.data.cpu().numpy().copy()",
          "as above, for the caption rows"),
]

#: modules imported at the top of the authors' files but unused by what runs here, stubbed only when not installed
STUBBED = {"pycocotools": "data.py and vocab.py import pycocotools.coco.COCO (raw COCO images; unused: the "
                          "precomputed-feature model is run)"}

SEED = 1234
IMG_DIM, EMBED, WORD_DIM, VOCAB = 32, 16, 8, 30
BATCH, TRAIN_BATCHES, EPOCHS, LR_UPDATE = 10, 3, 4, 2      # 12 steps, learning rate ×0.1 from epoch 2 (step 7)
LEARNING_RATE, GRAD_CLIP, MARGIN = 0.01, 6.0, 0.2
EVAL_FOLDS, FOLD_IMAGES, EVAL_BATCH = 5, 10, 32
MIN_LEN, MAX_LEN = 3, 9          # tokens, <start> and <end> included


def authors_opt() -> argparse.Namespace:
    """Every option of their ``train.py`` parser (its defaults, except the sizes and schedule of this run)."""
    return argparse.Namespace(
        data_path="/nonexistent", data_name="coco_precomp", vocab_path="./vocab/", margin=MARGIN,
        num_epochs=EPOCHS, batch_size=BATCH, word_dim=WORD_DIM, embed_size=EMBED, grad_clip=GRAD_CLIP,
        crop_size=224, num_layers=1, learning_rate=LEARNING_RATE, lr_update=LR_UPDATE, workers=0, log_step=10,
        val_step=10 ** 9, logger_name="runs/golden", resume="", max_violation=True, img_dim=IMG_DIM,
        finetune=False, cnn_type="vgg19", use_restval=False, measure="cosine", use_abs=False, no_imgnorm=False,
        reset_train=False, vocab_size=VOCAB)


class Recorder(types.ModuleType):
    """Stands in for ``tensorboard_logger``: keeps every ``log_value`` (their ``train`` logs each step's meters)."""

    def __init__(self):
        super().__init__("tensorboard_logger")
        self.values: list[tuple[str, float, int]] = []
        self.on_value = None

    def configure(self, *args, **kwargs):
        pass

    def log_value(self, name, value, step=None):
        self.values.append((name, float(value), step))
        if self.on_value is not None:
            self.on_value(name, value, step)

    def series(self, name: str) -> np.ndarray:
        return np.array([v for n, v, _ in self.values if n == name], dtype=np.float64)


def import_authors(copy: Path) -> tuple:
    recorder = Recorder()
    sys.modules["tensorboard_logger"] = recorder
    try:
        import pycocotools.coco  # noqa: F401
    except ImportError:
        stub = types.ModuleType("pycocotools")
        stub.coco = types.ModuleType("pycocotools.coco")
        stub.coco.COCO = None
        sys.modules["pycocotools"], sys.modules["pycocotools.coco"] = stub, stub.coco
    sys.path.insert(0, str(copy))
    import data as a_data
    import evaluation as a_eval
    import model as a_model
    import train as a_train
    return a_model, a_eval, a_data, a_train, recorder


def make_captions(rng: np.random.Generator, n: int) -> list[list[int]]:
    """``n`` distinct token lists ``[<start>=1, words in 4..VOCAB-1, <end>=2]``."""
    seen, out = set(), []
    while len(out) < n:
        length = int(rng.integers(MIN_LEN, MAX_LEN + 1))
        caption = (1, *rng.integers(4, VOCAB, size=length - 2).tolist(), 2)
        if caption not in seen:
            seen.add(caption)
            out.append(list(caption))
    return out


def features(rng: np.random.Generator, n: int) -> np.ndarray:
    """Non-negative float32 image vectors (as pooled CNN features are)."""
    return np.abs(rng.standard_normal((n, IMG_DIM))).astype(np.float32)


def collate(a_data, torch, images: np.ndarray, captions: list[list[int]], index: list[int], img_id: list[int]):
    """Their ``collate_fn`` over ``(image, caption, index, img_id)`` items as their ``PrecompDataset`` makes them."""
    items = [(torch.tensor(images[i], dtype=torch.float64), torch.tensor(captions[k], dtype=torch.float64), k, i)
             for k, i in zip(index, img_id)]
    return a_data.collate_fn(items)


def main() -> None:
    source, copy = authors_checkout(__doc__.split("\n")[0], "fartashf/vsepp", COMMIT, PATCHES)
    a_model, a_eval, a_data, a_train, recorder = import_authors(copy)
    import torch
    torch.set_num_threads(1)
    assert not torch.cuda.is_available()

    opt = authors_opt()
    rng = np.random.default_rng(SEED)

    # ---- initial state: their VSE in float32, their initialisation
    torch.manual_seed(SEED)
    initial = a_model.VSE(opt)
    img_state, txt_state = (dict(s) for s in initial.state_dict())
    state = {**{f"img_enc.{k}": v.detach().clone() for k, v in img_state.items()},
             **{f"txt_enc.{k}": v.detach().clone() for k, v in txt_state.items()}}
    assert all(v.dtype == torch.float32 for v in state.values())
    torch.set_default_dtype(torch.float64)

    def fresh_model():
        model = a_model.VSE(opt)
        model.load_state_dict([{k[len("img_enc."):]: v for k, v in state.items() if k.startswith("img_enc.")},
                               {k[len("txt_enc."):]: v for k, v in state.items() if k.startswith("txt_enc.")}])
        model.logger = a_eval.LogCollector()
        assert all(p.dtype == torch.float64 for p in model.params)
        return model

    def named_parameters(model):
        return {**{f"img_enc.{k}": p for k, p in model.img_enc.named_parameters()},
                **{f"txt_enc.{k}": p for k, p in model.txt_enc.named_parameters()}}

    inputs = {f"init.{k}": v.numpy() for k, v in state.items()}
    inputs["opt_json"] = np.array(json.dumps(vars(opt), sort_keys=True))
    inputs["vocab_words"] = np.array(["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(4, VOCAB)])
    figures: dict[str, np.ndarray] = {}

    # ---- training batches (pairs k: image k, caption k), collated by their collate_fn
    n_train = TRAIN_BATCHES * BATCH
    train_images, train_captions = features(rng, n_train), make_captions(rng, n_train)
    batches = [collate(a_data, torch, train_images, train_captions, list(range(b * BATCH, (b + 1) * BATCH)),
                       list(range(b * BATCH, (b + 1) * BATCH))) for b in range(TRAIN_BATCHES)]
    width = max(max(lengths) for _, _, lengths, _ in batches)
    inputs["train.images"] = np.stack([im.numpy().astype(np.float32) for im, _, _, _ in batches])
    inputs["train.tokens"] = np.stack([padded([t[:n].tolist() for t, n in zip(tok, lengths)], width)
                                       for _, tok, lengths, _ in batches])
    inputs["train.lengths"] = np.array([lengths for _, _, lengths, _ in batches], dtype=np.int64)
    inputs["train.ids"] = np.array([ids for _, _, _, ids in batches], dtype=np.int64)
    assert np.array_equal(inputs["train.images"].astype(np.float64), np.stack([b[0].numpy() for b in batches]))

    # ---- loss and gradients on batch 0, initial state
    images, captions, lengths, _ = batches[0]
    for name, max_violation in (("sum", False), ("max", True)):
        model = fresh_model()
        model.train_start()
        img_emb, cap_emb = model.forward_emb(images, captions, lengths)
        criterion = a_model.ContrastiveLoss(margin=opt.margin, measure=opt.measure, max_violation=max_violation)
        loss = criterion(img_emb, cap_emb)
        loss.backward()
        figures[f"loss.{name}"] = np.array(loss.item())
        for key, p in named_parameters(model).items():
            figures[f"grad.{name}.{key}"] = p.grad.numpy().copy()
        if max_violation:
            figures["batch.img_emb"] = img_emb.detach().numpy().copy()
            figures["batch.cap_emb"] = cap_emb.detach().numpy().copy()
            figures["batch.scores"] = a_model.cosine_sim(img_emb, cap_emb).detach().numpy().copy()

    # ---- training: their epoch loop (main without validation/checkpoints), their train() and train_emb
    model = fresh_model()
    snapshots = {}

    def on_value(name, value, step):
        if name == "Le" and step == 1:
            snapshots.update({k: p.detach().numpy().copy() for k, p in named_parameters(model).items()})
    recorder.on_value = on_value
    recorder.values.clear()
    with recorded_clip_norms(a_model, "clip_grad_norm") as grad_norms:
        for epoch in range(opt.num_epochs):
            a_train.adjust_learning_rate(opt, model.optimizer, epoch)
            a_train.train(opt, batches, model, epoch, None)
    steps = EPOCHS * TRAIN_BATCHES
    figures["train.loss"] = recorder.series("Le")
    figures["train.lr"] = recorder.series("lr")
    figures["train.grad_norm"] = np.array(grad_norms)
    assert len(figures["train.loss"]) == len(figures["train.lr"]) == len(grad_norms) == steps == model.Eiters
    for key, p in named_parameters(model).items():
        figures[f"step1.{key}"] = snapshots[key]
        figures[f"trained.{key}"] = p.detach().numpy().copy()
    assert (figures["train.grad_norm"] > GRAD_CLIP).any() and (figures["train.grad_norm"] < GRAD_CLIP).any(), \
        "choose GRAD_CLIP so that some steps clip and some do not"

    # ---- evaluation: their encode_data over their collated test batches, their i2t/t2i, their fold loop
    n_img = EVAL_FOLDS * FOLD_IMAGES
    eval_images, eval_captions = features(rng, n_img), make_captions(rng, 5 * n_img)
    width = max(len(c) for c in eval_captions)
    inputs["eval.images"] = eval_images
    inputs["eval.tokens"] = padded(eval_captions, width)
    inputs["eval.lengths"] = np.array([len(c) for c in eval_captions], dtype=np.int64)

    class Loader(list):
        """What encode_data reads of a DataLoader: iteration, len() and .dataset's len()."""
        dataset = range(5 * n_img)

    loader = Loader(collate(a_data, torch, eval_images, eval_captions, list(range(s, min(s + EVAL_BATCH, 5 * n_img))),
                            [k // 5 for k in range(s, min(s + EVAL_BATCH, 5 * n_img))])
                    for s in range(0, 5 * n_img, EVAL_BATCH))
    model = fresh_model()
    img_embs, cap_embs = a_eval.encode_data(model, loader, logging=lambda *a, **k: None)
    figures["eval.img_embs"] = img_embs[0::5]
    figures["eval.cap_embs"] = cap_embs
    figures["eval.sims"] = np.stack([np.dot(img_embs[5 * i].reshape(1, -1), cap_embs.T).flatten()
                                     for i in range(n_img)])
    r, (ranks, top1) = a_eval.i2t(img_embs, cap_embs, npts=n_img, measure=opt.measure, return_ranks=True)
    ri, (ranks_i, top1_i) = a_eval.t2i(img_embs, cap_embs, npts=n_img, measure=opt.measure, return_ranks=True)
    figures["eval.all.i2t"], figures["eval.all.t2i"] = np.array(r), np.array(ri)
    figures["eval.all.i2t_ranks"], figures["eval.all.t2i_ranks"] = ranks, ranks_i
    figures["eval.all.i2t_top1"], figures["eval.all.t2i_top1"] = top1, top1_i
    results = []                                  # their evalrank(fold5=True), 1000 → FOLD_IMAGES
    for i in range(EVAL_FOLDS):
        part = slice(i * 5 * FOLD_IMAGES, (i + 1) * 5 * FOLD_IMAGES)
        r, _ = a_eval.i2t(img_embs[part], cap_embs[part], npts=FOLD_IMAGES, measure=opt.measure, return_ranks=True)
        ri, _ = a_eval.t2i(img_embs[part], cap_embs[part], npts=FOLD_IMAGES, measure=opt.measure, return_ranks=True)
        ar, ari = (r[0] + r[1] + r[2]) / 3, (ri[0] + ri[1] + ri[2]) / 3
        rsum = r[0] + r[1] + r[2] + ri[0] + ri[1] + ri[2]
        results += [list(r) + list(ri) + [rsum, ar, ari]]
    figures["eval.folds"] = np.array(results)                  # [fold, r1 r5 r10 medr meanr (i2t, t2i), rsum ar ari]
    figures["eval.folds_mean"] = np.array(results).mean(axis=0)

    notes = (f"CPU, float64 (torch.set_default_dtype after the float32 initial state), torch.set_num_threads(1); "
             f"seed {SEED}; img_dim {IMG_DIM}, embed {EMBED}, word_dim {WORD_DIM}, vocab {VOCAB}; training: "
             f"{TRAIN_BATCHES} batches of {BATCH} x {EPOCHS} epochs, Adam lr {LEARNING_RATE} x0.1 every {LR_UPDATE} "
             f"epochs, grad clip {GRAD_CLIP}, max_violation; evaluation: {EVAL_FOLDS} folds x {FOLD_IMAGES} images "
             f"x 5 captions, initial state. Stubbed when absent: {STUBBED}. tensorboard_logger replaced by a "
             "recorder of train's per-step log; model.clip_grad_norm wrapped to record its return value.")
    folder = write_figures("vsepp", repository=REPOSITORY, source=source, patches=PATCHES,
                           inputs=inputs, figures=figures, notes=notes)
    for f in sorted(folder.iterdir()):
        print(f"{f}: {f.stat().st_size} bytes")
    print("loss per step:", np.round(figures["train.loss"], 4).tolist())
    print("lr per step:", figures["train.lr"].tolist())
    print("grad norm per step:", np.round(figures["train.grad_norm"], 4).tolist())
    print("i2t all:", figures["eval.all.i2t"].tolist(), "t2i all:", figures["eval.all.t2i"].tolist())
    print("fold mean:", np.round(figures["eval.folds_mean"], 3).tolist())


if __name__ == "__main__":
    main()
