"""Golden figures of VSE∞ (BiGRU text) computed by the authors' code (woodfrog/vse_infty, ``bigru`` branch), for
``tests/test_golden_vse_infinity.py``.

Run by hand (never by CI), from the repository root, with the authors' repository in a scratch folder outside it::

    git clone --branch bigru https://github.com/woodfrog/vse_infty /tmp/authors/vse_infty   # commit 8600f891…
    OMP_NUM_THREADS=1 .venv/bin/python tools/golden/vse_infinity.py /tmp/authors/vse_infty

It copies that checkout to a temporary folder, applies :data:`PATCHES` (CPU only; nothing computed changes),
imports their ``lib.vse``, ``lib.loss`` and ``train`` and runs them on the CPU in float64:

* the initial state is their ``VSEModel(opt)`` built with ``torch.manual_seed(SEED)`` in float32, with the image
  MLP's batch-norm running statistics set to seeded float32 values (so eval mode is not the identity); every
  stored number is float32 and loads exactly into a float64 model;
* GPO (initial state): their image-side and caption-side ``GPO`` on a stored set ``[B, K, d]`` with lengths from 1
  to K: the pooled vectors and the pooling weights;
* embeddings (eval mode): their ``forward_emb`` on images with varying numbers of regions (zero-padded, as their
  ``collate_fn`` pads) and captions sorted by decreasing length;
* loss (train mode, training batch 0): ``ContrastiveLoss`` with the sum of violations and with hardest negatives,
  and every parameter's gradient of the latter (the former's gradients drive the warm-up steps below; storing
  them too would double the figures' size);
* training: their ``main`` loop's epoch body (``adjust_learning_rate``, then ``set_max_violation(True)`` from epoch
  ``vse_mean_warmup_epochs``) and their ``train`` over the stored batches (``train_emb``: AdamW, gradient-norm
  clip): loss, learning rate and pre-clip gradient norm of every step, the state after step 1 and after the last.
  Training batches hold full region sets: their MLP's batch norm then sees the same rows as retr's, which
  normalises real regions only (docs/models-vse-infinity.md).

Their dataset's size augmentation is not run (it is random): batches enter ``train_emb`` as their ``collate_fn``
would hand them over without it. Modules their files import but nothing here calls are stubbed when absent
(:data:`STUBBED`); ``tensorboard_logger`` is replaced by a recorder of their per-step log.
"""
from __future__ import annotations

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import argparse
import json
import sys
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Patch, authors_checkout, padded, recorded_clip_norms, write_figures  # noqa: E402
from vsepp import Recorder  # noqa: E402

REPOSITORY = "https://github.com/woodfrog/vse_infty"
COMMIT = "8600f891e143bda1a33d2228999d0d4c63acd4fd"     # head of the bigru branch

PATCHES = [
    Patch("lib/vse.py", "lengths = torch.Tensor(lengths).cuda()", "lengths = torch.Tensor(lengths)",
          "forward_emb moves the caption lengths to CUDA unconditionally (everything else moves only when "
          "torch.cuda.is_available()); the figures are computed on the CPU"),
]

STUBBED = {"imageio": "lib/datasets/image_caption.py reads raw images with imageio.imread (unused: precomputed "
                      "region features are fed directly)",
           "cv2": "as imageio (image resizing)"}

SEED = 4321
IMG_DIM, EMBED, WORD_DIM, VOCAB, REGIONS = 24, 16, 8, 30, 6     # VOCAB words; their <mask> is id VOCAB
BATCH, TRAIN_BATCHES, EPOCHS, LR_UPDATE, WARMUP = 8, 2, 3, 2, 1
LEARNING_RATE, GRAD_CLIP, MARGIN = 0.01, 5.0, 0.2
MIN_LEN, MAX_LEN = 3, 9


def authors_opt() -> argparse.Namespace:
    """Every option of their ``arguments.py`` (its defaults, except the sizes and schedule of this run)."""
    return argparse.Namespace(
        data_path="/nonexistent", data_name="f30k", vocab_path="./vocab/", margin=MARGIN, num_epochs=EPOCHS,
        batch_size=BATCH, word_dim=WORD_DIM, embed_size=EMBED, num_layers=1, grad_clip=GRAD_CLIP,
        learning_rate=LEARNING_RATE, lr_update=LR_UPDATE, optim="adam", workers=0, log_step=10 ** 9,
        val_step=10 ** 9, logger_name="runs/golden", model_name="runs/golden", resume="", max_violation=False,
        img_dim=IMG_DIM, no_imgnorm=False, no_txtnorm=False, precomp_enc_type="basic", backbone_path="",
        backbone_source="detector", vse_mean_warmup_epochs=WARMUP, reset_start_epoch=False,
        backbone_warmup_epochs=5, embedding_warmup_epochs=2, backbone_lr_factor=0.01, input_scale_factor=1,
        drop=True, vocab_size=VOCAB + 1)


def import_authors(copy: Path):
    recorder = Recorder()
    sys.modules["tensorboard_logger"] = recorder
    for name in STUBBED:
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].imread = None
    sys.path.insert(0, str(copy))
    import lib.evaluation as a_eval
    import lib.loss as a_loss
    import lib.vse as a_vse
    import train as a_train
    return a_vse, a_loss, a_eval, a_train, recorder


def make_captions(rng: np.random.Generator, n: int) -> list[list[int]]:
    """``n`` token lists ``[<start>=1, words in 4..VOCAB-1, <end>=2]``, sorted by decreasing length."""
    out = [[1, *rng.integers(4, VOCAB, size=int(rng.integers(MIN_LEN, MAX_LEN + 1)) - 2).tolist(), 2]
           for _ in range(n)]
    return sorted(out, key=len, reverse=True)


def main() -> None:
    source, copy = authors_checkout(__doc__.split("\n")[0], "woodfrog/vse_infty, branch bigru", COMMIT, PATCHES)
    a_vse, a_loss, a_eval, a_train, recorder = import_authors(copy)
    import torch
    torch.set_num_threads(1)
    assert not torch.cuda.is_available()

    opt = authors_opt()
    rng = np.random.default_rng(SEED)
    torch.manual_seed(SEED)
    initial = a_vse.VSEModel(opt)
    bn = initial.img_enc.mlp.bns[0]
    bn.running_mean.copy_(torch.from_numpy(rng.normal(0, 0.5, bn.num_features).astype(np.float32)))
    bn.running_var.copy_(torch.from_numpy(rng.uniform(0.5, 2.0, bn.num_features).astype(np.float32)))
    img_state, txt_state = (dict(s) for s in initial.state_dict())
    state = {**{f"img_enc.{k}": v.detach().clone() for k, v in img_state.items()},
             **{f"txt_enc.{k}": v.detach().clone() for k, v in txt_state.items()}}
    assert all(v.dtype == torch.float32 for k, v in state.items() if not k.endswith("num_batches_tracked"))
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

    inputs = {f"init.{k}": v.numpy() for k, v in state.items()}
    inputs["opt_json"] = np.array(json.dumps(vars(opt), sort_keys=True))
    figures: dict[str, np.ndarray] = {}

    # ---- GPO on a stored set with lengths 1..K (the two GPOs of the initial state)
    model = fresh_model()
    model.val_start()
    gpo_x = rng.standard_normal((5, 7, EMBED)).astype(np.float32)
    gpo_lengths = np.array([7, 3, 1, 5, 2], dtype=np.int64)
    gpo_x[np.arange(7)[None, :] >= gpo_lengths[:, None]] = 0.0            # as pad_packed_sequence pads
    inputs["gpo.x"], inputs["gpo.lengths"] = gpo_x, gpo_lengths
    with torch.no_grad():
        for side, gpo in (("image", model.img_enc.gpool), ("caption", model.txt_enc.gpool)):
            pooled, weights = gpo(torch.from_numpy(gpo_x).double(), torch.from_numpy(gpo_lengths))
            figures[f"gpo.{side}.pooled"] = pooled.numpy().copy()
            figures[f"gpo.{side}.weights"] = weights.squeeze(-1).numpy().copy()

    # ---- embeddings in eval mode: varying region counts (zero-padded), captions sorted by length
    n_eval = 6
    eval_counts = np.array([REGIONS, 2, 5, 1, REGIONS, 3], dtype=np.int64)
    eval_images = np.abs(rng.standard_normal((n_eval, REGIONS, IMG_DIM))).astype(np.float32)
    eval_images[np.arange(REGIONS)[None, :] >= eval_counts[:, None]] = 0.0
    eval_captions = make_captions(rng, n_eval)
    inputs["eval.images"], inputs["eval.counts"] = eval_images, eval_counts
    inputs["eval.tokens"] = padded(eval_captions, max(map(len, eval_captions)))
    inputs["eval.lengths"] = np.array([len(c) for c in eval_captions], dtype=np.int64)
    with torch.no_grad():
        img_emb, cap_emb = model.forward_emb(torch.from_numpy(eval_images).double(),
                                             torch.from_numpy(inputs["eval.tokens"]),
                                             inputs["eval.lengths"].tolist(),
                                             image_lengths=torch.tensor(eval_counts, dtype=torch.float64))
    figures["eval.img_emb"], figures["eval.cap_emb"] = img_emb.numpy().copy(), cap_emb.numpy().copy()

    # ---- training batches: full region sets, captions sorted by decreasing length (their collate_fn)
    train_images = np.abs(rng.standard_normal((TRAIN_BATCHES, BATCH, REGIONS, IMG_DIM))).astype(np.float32)
    train_captions = [make_captions(rng, BATCH) for _ in range(TRAIN_BATCHES)]
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
            if max_violation and p.grad is not None:      # (the MLP's last batch norm is built but never used)
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
    with recorded_clip_norms(a_vse, "clip_grad_norm_") as grad_norms:
        for epoch in range(opt.num_epochs):               # their main(), without validation and checkpoints
            a_train.adjust_learning_rate(opt, model.optimizer, epoch, [opt.lr_update])
            if epoch >= opt.vse_mean_warmup_epochs:
                opt.max_violation = True
                model.set_max_violation(opt.max_violation)
            a_train.train(opt, loader, model, epoch, None)
    figures["train.loss"] = recorder.series("Le")
    figures["train.lr"] = recorder.series("lr")
    figures["train.grad_norm"] = np.array(grad_norms)
    assert len(figures["train.loss"]) == len(grad_norms) == EPOCHS * TRAIN_BATCHES == model.Eiters
    for key, v in full_state(model).items():
        figures[f"step1.{key}"] = snapshots[key]
        figures[f"trained.{key}"] = v.detach().numpy().copy()
    assert (figures["train.grad_norm"] > GRAD_CLIP).any() and (figures["train.grad_norm"] < GRAD_CLIP).any(), \
        "choose GRAD_CLIP so that some steps clip and some do not"

    notes = (f"CPU, float64 (torch.set_default_dtype after the float32 initial state), torch.set_num_threads(1); "
             f"seed {SEED}; img_dim {IMG_DIM}, embed {EMBED}, word_dim {WORD_DIM}, vocab {VOCAB} + <mask>, "
             f"{REGIONS} regions; training: {TRAIN_BATCHES} batches of {BATCH} x {EPOCHS} epochs, AdamW lr "
             f"{LEARNING_RATE} x0.1 from epoch {LR_UPDATE}, {WARMUP} warm-up epoch on summed violations, grad clip "
             f"{GRAD_CLIP}. Stubbed when absent: {STUBBED}. tensorboard_logger replaced by a recorder of train's "
             "per-step log; lib.vse.clip_grad_norm_ wrapped to record its return value.")
    folder = write_figures("vse_infinity", repository=REPOSITORY, source=source, patches=PATCHES,
                           inputs=inputs, figures=figures, notes=notes)
    for f in sorted(folder.iterdir()):
        print(f"{f}: {f.stat().st_size} bytes")
    print("loss per step:", np.round(figures["train.loss"], 4).tolist())
    print("lr per step:", figures["train.lr"].tolist())
    print("grad norm per step:", np.round(figures["train.grad_norm"], 4).tolist())


if __name__ == "__main__":
    main()
