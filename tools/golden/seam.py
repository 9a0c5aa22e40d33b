"""Golden figures for SEAM-E, SEAM-C and SEAM-G from the authors' public code (``jwehrmann/seam-retrieval``).

Run by hand, never by CI, with the authors' repository checked out in a scratch folder outside this one::

    git clone https://github.com/jwehrmann/seam-retrieval /tmp/authors/seam      # commit ff94dcc… (the only one)
    OMP_NUM_THREADS=1 .venv/bin/python tools/golden/seam.py /tmp/authors/seam

It copies that checkout to a temporary folder, applies :data:`PATCHES` (Python 3 / torch 2.x / CPU only, each
with its reason), imports the copy, and in float64 (``torch.set_default_dtype``) runs, for each of the three
text encoders, the authors' own objects on a tiny seeded setting (:data:`SIZES`):

* ``VSE(opt)`` built with ``train.py``'s argument defaults plus the README's arguments for the encoder (order
  violation, ``--use_abs``, ``--att_coef 0.5``) and tiny sizes; its freshly initialised state (the authors'
  initialisers) is the stored initial state;
* one training batch through ``data.collate_fn`` → ``forward_emb`` → ``forward_loss`` → ``backward``: the
  embeddings, score matrix, loss and every parameter's gradient (before clipping);
* :data:`STEPS` steps of ``VSE.train_emb`` (Adam 1e-3, gradient-norm clip 1.0) from the initial state: the loss
  of each step and every parameter and BatchNorm buffer afterwards;
* the evaluation as ``evaluation.encode_data`` runs it (``data.PrecompDataset`` → ``get_precomp_loader``, batches
  of ``--batch_size`` consecutive captions, unshuffled) and ``evaluation.i2t`` / ``t2i`` (order measure) at
  ``npts`` = the stored images: embeddings, the order-violation matrix, R@1/5/10, medr, meanr and the ranks —
  once from the initial state and once from the state after the steps;
* SEAM-E and SEAM-G: the attention penalty the public code *would* add (``model.Frobenius`` of ``AAᵀ − I``;
  ``forward_loss`` never adds it: see ``docs/models-seam-sman.md``).

Written to ``tests/data/golden/seam/`` (``common.write_figures``): ``inputs.npz`` (sizes, crops, batches, each
encoder's initial state under the authors' parameter names), ``figures.npz`` and ``provenance.json``.
``tests/test_golden_seam.py`` loads the same state into retr's SEAM and compares.

Inputs both sides share: each image is 10 crops of ``img_dim`` non-negative values exactly representable in
float32 (retr's loaders hand float32 to the model; the cast is then lossless). The authors' precomputed-feature
files hold one l2-normalised crop mean per image (``reference/models.md``: the public pipeline); that vector is
computed here in float64 and written as the ``test_ims.npy`` their ``PrecompDataset`` reads. Captions are
token ids with ``<start>`` (1) and ``<end>`` (2), ``<pad>`` = 0, as both vocabularies number them; the
tokenizer below only parses the stored ids (the word tokenizer is not what is compared).
"""
from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Patch, patched_copy, write_figures  # noqa: E402

REPOSITORY = "https://github.com/jwehrmann/seam-retrieval"

PATCHES = [
    Patch("data.py", "lengths = map(len, captions)", "lengths = list(map(len, captions))",
          "Python 3: map() is a one-pass iterator; collate_fn takes max(lengths) and then indexes lengths[i]"),
    Patch("data.py", "img_id = index/self.im_div", "img_id = index//self.im_div",
          "Python 3: / is true division; the image row index must stay an int (Python 2's int / floors)"),
    Patch("model.py", "self.logger.update('ContrLoss', loss.data[0], img_emb.size(0))",
          "self.logger.update('ContrLoss', loss.item(), img_emb.size(0))",
          "torch >= 0.4: the loss is a 0-d tensor and .data[0] raises IndexError; .item() is the same number "
          "(only the log line; the returned loss is untouched)"),
    Patch("evaluation.py", "for i, (k, v) in enumerate(self.meters.iteritems()):",
          "for i, (k, v) in enumerate(self.meters.items()):",
          "Python 3: dicts have no iteritems(); encode_data prints this log line on its first batch"),
    Patch("evaluation.py", "img_embs[ids] = img_emb.data.cpu().numpy().copy()",
          "img_embs[list(ids)] = img_emb.data.cpu().numpy().copy()",
          "torch 2.x on the CPU: collate_fn's ids arrive as a tuple, which numpy reads as a multi-dimensional "
          "index; on the authors' CUDA machines the DataLoader's pin_memory (torch <= 0.4 pin_memory_batch) "
          "turned every sequence of the batch into a list"),
    Patch("evaluation.py", "cap_embs[ids] = cap_emb.data.cpu().numpy().copy()",
          "cap_embs[list(ids)] = cap_emb.data.cpu().numpy().copy()",
          "as the line above, for the caption embeddings"),
    Patch("evaluation.py", "d2 = order_sim(torch.Tensor(im2).cuda(),\n                               "
          "torch.Tensor(captions).cuda())",
          "d2 = order_sim(torch.Tensor(im2),\n                               torch.Tensor(captions))",
          "run on the CPU (no CUDA device needed): .cuda() only moves the tensors; the arithmetic is the same "
          "order_sim (float64 here, torch.Tensor follows the default dtype)"),
    Patch("evaluation.py", "d2 = order_sim(torch.Tensor(ims).cuda(),\n                               "
          "torch.Tensor(q2).cuda())",
          "d2 = order_sim(torch.Tensor(ims),\n                               torch.Tensor(q2))",
          "as the line above, in t2i"),
]

#: modules the copy imports but the precomputed-feature path never uses: stubbed in ``sys.modules`` (no file of
#: the authors' code changes); ``pycocotools`` only reads raw COCO annotation JSON (``CocoDataset``, ``vocab.py``)
STUBS = {"pycocotools": None, "pycocotools.coco": "COCO"}

ENCODERS = {"e": "seam-e", "c": "seam-c", "g": "seam-g"}
#: tiny sizes; SEAM-C's 100 filters are hard-coded in the authors' ConvAttentiveTextEncoder, and SEAM-G's GRU
#: is ``embed_size`` wide (get_text_encoder falls back to embed_size: train.py defines no --norm_words)
SIZES = {"vocab_size": 30, "word_dim": 12, "embed_size": 16, "att_units": 8, "att_hops": 3, "img_dim": 20,
         "crops": 10, "batch_size": 8, "conv_filters": 100}
STEPS = 3
EVAL_IMAGES = 6                     # 30 captions: evaluation batches of 8, 8, 8 and 6 captions
TRAIN_IMAGES = 16
SEEDS = {"data": 20240611, "e": 1, "c": 2, "g": 3}


def stub_modules() -> None:
    for name, attribute in STUBS.items():
        module = types.ModuleType(name)
        module.__doc__ = "stub: tools/golden/seam.py (never used on the precomputed-feature path)"
        if attribute:
            setattr(module, attribute, None)
        sys.modules[name] = module


def options(kind: str) -> argparse.Namespace:
    """``train.py``'s argument defaults, the README's arguments for ``kind`` and the tiny sizes."""
    s = SIZES
    return argparse.Namespace(
        data_path="unused", data_name="golden_precomp", vocab_path="./vocab/", margin=0.05, num_epochs=30,
        batch_size=s["batch_size"], word_dim=s["word_dim"], embed_size=s["embed_size"], gru_units=1024,
        grad_clip=1.0, crop_size=224, num_layers=1, learning_rate=0.001, lr_update=15, workers=0, log_step=10,
        val_step=500, logger_name="unused", resume="", max_violation=False, img_dim=s["img_dim"], finetune=False,
        cnn_type="vgg19", use_restval=False, measure="order", test_measure="order", use_abs=True,
        no_imgnorm=False, text_encoder=ENCODERS[kind], att_units=s["att_units"], att_hops=s["att_hops"],
        att_coef=0.5, vocab_size=s["vocab_size"])


def captions_with_lengths(rng: np.random.Generator, lengths: list[int]) -> np.ndarray:
    """``[n, max(lengths)]`` ids: <start> words… <end>, then <pad> (0). No two captions hold the same words in
    any order (SEAM-E's pooling ignores word order: such captions would tie exactly)."""
    tokens = np.zeros((len(lengths), max(lengths)), dtype=np.int64)
    seen: set[tuple[int, ...]] = set()
    for row, n in enumerate(lengths):
        while True:
            words = rng.integers(4, SIZES["vocab_size"], size=n - 2)
            if tuple(sorted(words)) not in seen:
                seen.add(tuple(sorted(words)))
                break
        tokens[row, 0], tokens[row, n - 1] = 1, 2
        tokens[row, 1:n - 1] = words
    return tokens


def make_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEEDS["data"])
    s = SIZES
    crops = lambda n: rng.random((n, s["crops"], s["img_dim"])).astype(np.float32)   # noqa: E731 (ReLU'd: ≥ 0)
    b = s["batch_size"]
    # evaluation: 5 captions per image in order; batches of 8 consecutive captions: batch 0 has one longest
    # caption (9), batch 1 two tied (8), batch 2 one (10), the last (6 captions) one (7)
    eval_lengths = [5, 9, 4, 6, 3, 7, 5, 6,   8, 4, 8, 5, 6, 3, 7, 4,   6, 10, 5, 4, 7, 3, 6, 5,   4, 7, 3, 5, 6, 4]
    # training: three batches (stored longest first, as collate_fn orders them); image 3 twice in batch 0 (two
    # captions of one image are each other's negatives), batch 1 with a tie for the longest caption
    train_lengths = [[9, 8, 7, 6, 5, 5, 4, 3], [8, 8, 7, 6, 6, 5, 4, 3], [10, 9, 7, 6, 5, 4, 4, 3]]
    train_images = [[3, 0, 3, 5, 7, 1, 2, 9], [4, 6, 8, 10, 11, 12, 13, 14], [15, 2, 0, 7, 9, 1, 5, 6]]
    width = max(max(l) for l in train_lengths)
    tokens = np.zeros((STEPS, b, width), dtype=np.int64)
    for step, lengths in enumerate(train_lengths):
        part = captions_with_lengths(rng, lengths)
        tokens[step, :, :part.shape[1]] = part
    return {
        **{f"sizes/{k}": np.int64(v) for k, v in SIZES.items()}, "sizes/steps": np.int64(STEPS),
        "eval/features": crops(EVAL_IMAGES), "eval/tokens": captions_with_lengths(rng, eval_lengths),
        "eval/lengths": np.array(eval_lengths, dtype=np.int64),
        "eval/caption_image": np.arange(len(eval_lengths), dtype=np.int64) // 5,
        "train/features": crops(TRAIN_IMAGES), "train/tokens": tokens,
        "train/lengths": np.array(train_lengths, dtype=np.int64), "train/image": np.array(train_images, np.int64),
    }


def precomputed(features: np.ndarray) -> np.ndarray:
    """The public pipeline's stored vector: the crops' mean, l2-normalised (float64)."""
    mean = features.astype(np.float64).mean(axis=1)
    return mean / np.sqrt((mean ** 2).sum(axis=1, keepdims=True))


class IdTokenizer:
    """``tokenize_text`` as the authors' WordTokenizer returns it (a float tensor of ids), from stored ids."""

    def __init__(self, torch):
        self.torch = torch

    def tokenize_text(self, line: bytes):
        return self.torch.Tensor([float(t) for t in line.split()])


def state(torch, vse) -> dict[str, np.ndarray]:
    """Every parameter and buffer of the authors' model, ``img_enc.…`` / ``txt_enc.…``."""
    out = {}
    for prefix, module in (("img_enc", vse.img_enc), ("txt_enc", vse.txt_enc)):
        for name, value in module.state_dict().items():
            out[f"{prefix}.{name}"] = value.detach().cpu().numpy().copy()
    return out


def run_encoder(kind: str, mods: dict, torch, inputs: dict, folder: Path) -> tuple[dict, dict, list[str]]:
    """``(initial state, figures, notes)`` of one text encoder."""
    model_mod, data_mod, eval_mod = mods["model"], mods["data"], mods["evaluation"]
    opt = options(kind)
    torch.manual_seed(SEEDS[kind])
    vse = model_mod.VSE(opt)
    notes = []
    assert vse.attention is False          # the penalty branch is off: the encoders are not named 'attentive…'
    init = state(torch, vse)
    figures: dict[str, np.ndarray] = {}
    train_images = precomputed(inputs["train/features"])

    def train_batch(step: int):
        items = []
        for row in range(SIZES["batch_size"]):
            n = int(inputs["train/lengths"][step, row])
            image = int(inputs["train/image"][step, row])
            items.append((torch.Tensor(train_images[image]),
                          torch.Tensor(inputs["train/tokens"][step, row, :n].astype(np.float64)), row, image))
        images, targets, lengths, ids = data_mod.collate_fn(items)
        assert list(ids) == list(range(len(items)))        # stored longest first: collate keeps the order
        return images, targets, lengths, ids

    def evaluate(prefix: str) -> None:
        vse.logger = eval_mod.LogCollector()
        loader = data_mod.get_precomp_loader(str(folder), "test", IdTokenizer(torch), opt, opt.batch_size, False)
        img_embs, cap_embs = eval_mod.encode_data(vse, loader, log_step=10 ** 9, logging=lambda *a: None)
        npts = EVAL_IMAGES
        i2t, (i2t_ranks, _) = eval_mod.i2t(img_embs, cap_embs, npts=npts, measure="order", return_ranks=True)
        t2i, (t2i_ranks, _) = eval_mod.t2i(img_embs, cap_embs, npts=npts, measure="order", return_ranks=True)
        images = img_embs[::5]
        sims = model_mod.order_sim(torch.Tensor(images), torch.Tensor(cap_embs)).numpy()
        gaps = min(np.diff(np.sort(sims, axis=1), axis=1).min(), np.diff(np.sort(sims, axis=0), axis=0).min())
        assert gaps > 1e-9, f"near-tied scores ({gaps:.1e}): the ranks would be fragile"
        figures.update({f"{kind}/{prefix}/img_emb": images, f"{kind}/{prefix}/cap_emb": cap_embs,
                        f"{kind}/{prefix}/sims": sims, f"{kind}/{prefix}/i2t": np.array(i2t, dtype=np.float64),
                        f"{kind}/{prefix}/t2i": np.array(t2i, dtype=np.float64),
                        f"{kind}/{prefix}/i2t_ranks": i2t_ranks, f"{kind}/{prefix}/t2i_ranks": t2i_ranks})
        notes.append(f"{kind}/{prefix}: smallest gap between two scores of one row or column {gaps:.1e}")

    # one training batch: embeddings, scores, loss, gradients (before clipping); the model is then reset
    vse.logger = eval_mod.LogCollector()
    vse.train_start()
    images, targets, lengths, ids = train_batch(0)
    img_emb, cap_emb = vse.forward_emb(images, targets, lengths)
    loss = vse.forward_loss(img_emb, cap_emb)
    vse.optimizer.zero_grad()
    loss.backward()
    figures.update({f"{kind}/train/img_emb": img_emb.detach().numpy(),
                    f"{kind}/train/cap_emb": cap_emb.detach().numpy(),
                    f"{kind}/train/scores": model_mod.order_sim(img_emb, cap_emb).detach().numpy(),
                    f"{kind}/train/loss": np.float64(loss.item())})
    for prefix, module in (("img_enc", vse.img_enc), ("txt_enc", vse.txt_enc)):
        for name, p in module.named_parameters():
            figures[f"{kind}/grad/{prefix}.{name}"] = p.grad.detach().numpy().copy()
    weights = vse.txt_enc.attention_weights
    if kind == "c":
        # SEAM-C stores the embedding module's pooled output M = A·H ([B, hops, word_dim]) as "attention_weights"
        assert weights.shape[-1] == SIZES["word_dim"] and weights.shape[1] == SIZES["att_hops"]
        notes.append("seam-c: txt_enc.attention_weights is the pooled output M = A·H of the word-embedding "
                     f"module, shape {tuple(weights.shape)}, not the annotation matrix A")
    else:
        hops = SIZES["att_hops"]
        eye = torch.eye(hops).expand(weights.shape[0], hops, hops)
        frobenius = model_mod.Frobenius(torch.bmm(weights, weights.transpose(1, 2)) - eye)
        figures[f"{kind}/train/frobenius"] = np.float64(frobenius.item())
    for prefix, module in (("img_enc", vse.img_enc), ("txt_enc", vse.txt_enc)):
        module.load_state_dict({k[len(prefix) + 1:]: torch.from_numpy(v) for k, v in init.items()
                                if k.startswith(prefix + ".")})
    vse.optimizer.zero_grad()
    assert not vse.optimizer.state                                    # no step taken yet: Adam starts fresh

    evaluate("eval")
    vse.logger = eval_mod.LogCollector()
    vse.train_start()
    losses = []
    for step in range(STEPS):
        vse.train_emb(*train_batch(step))
        losses.append(vse.logger.meters["ContrLoss"].val)
    figures[f"{kind}/steps/loss"] = np.array(losses, dtype=np.float64)
    figures.update({f"{kind}/steps/{k}": v for k, v in state(torch, vse).items()})
    evaluate("eval_trained")
    return init, figures, notes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("authors", type=Path, help="checkout of jwehrmann/seam-retrieval (scratch folder)")
    args = parser.parse_args(argv)
    source = args.authors.resolve()
    copy = patched_copy(source, PATCHES)
    stub_modules()
    sys.path.insert(0, str(copy))
    import torch
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    mods = {name: importlib.import_module(name) for name in ("layers", "text_encoders", "model", "data", "evaluation")}

    inputs = make_inputs()
    folder = Path(tempfile.mkdtemp(prefix="golden-seam-data-"))
    np.save(folder / "test_ims.npy", precomputed(inputs["eval/features"]))
    with open(folder / "test_caps.txt", "w", encoding="ascii") as f:
        for tokens, n in zip(inputs["eval/tokens"], inputs["eval/lengths"]):
            f.write(" ".join(str(int(t)) for t in tokens[:n]) + "\n")

    figures, notes = {}, []
    for kind in ENCODERS:
        init, encoder_figures, encoder_notes = run_encoder(kind, mods, torch, inputs, folder)
        inputs.update({f"{kind}/init/{k}": v for k, v in init.items()})
        figures.update(encoder_figures)
        notes += encoder_notes
    notes = ("float64 (torch.set_default_dtype), one thread, CPU. Stubbed modules (sys.modules, no file changed): "
             + ", ".join(STUBS) + ". Options: train.py's defaults + the README's arguments per encoder "
             "(--measure order --use_abs --att_coef 0.5 --att_hops 3 --att_units 8) + tiny sizes "
             f"{SIZES}. VSE.attention is False for seam-e/c/g (checked): the penalty branch of forward_loss never "
             "runs, and it returns the plain contrastive loss. " + "; ".join(notes))
    folder = write_figures("seam", repository=REPOSITORY, source=source, patches=PATCHES, inputs=inputs,
                           figures=figures, notes=notes)
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
