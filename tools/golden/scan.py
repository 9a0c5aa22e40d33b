"""Golden figures of SCAN computed by the authors' code (kuanghuei/SCAN); run by hand, never by CI.

Usage (a scratch checkout outside this repository; the figures were made at the commit in provenance.json)::

    git clone https://github.com/kuanghuei/SCAN /tmp/authors/SCAN
    git -C /tmp/authors/SCAN checkout 806355736e3c9158c9bcf2f0501ed1e961a893e9
    OMP_NUM_THREADS=1 .venv/bin/python tools/golden/scan.py /tmp/authors/SCAN

It copies the checkout to a temporary folder, applies :data:`PATCHES` (only what Python 3 and torch 2.x need),
hides CUDA (their code moves everything to the GPU when one is visible; here it runs on the CPU in float64) and
writes ``tests/data/golden/scan/``, which ``tests/test_golden_scan.py`` reads:

* ``inputs.npz`` — two initial states (``state.A.*``, ``state.B.*``: the authors' own initialisation under seeds
  1 and 2, in float32, so the float32 round trip of retr's checkpoint importer is exact; both sides then run in
  float64), the options of each scoring setting (``config.<name>``: their ``opt`` Namespace as JSON, and which
  state it starts from), an evaluation split (``eval.*``: 40 images × 10 regions × 32 dims, 5 captions each) and
  16 training batches over a pool of 8 images (``train.*``, in the order their ``collate_fn`` sorts a batch);
* ``figures.npz`` — per setting (``t2i_lse``, ``t2i_avg``: state A, λ_softmax 9, λ_lse 6; ``i2t_lse``, ``i2t_avg``:
  state B, λ_softmax 4, λ_lse 5; all bi-GRU, clipped_l2norm, hardest negatives, margin 0.2):

  - ``sims.<name>`` [40, 200]: their evaluation path, ``encode_data`` → ``img_embs[0::5]`` →
    ``shard_xattn_t2i``/``shard_xattn_i2t`` (``xattn_score_t2i``/``xattn_score_i2t``, two caption shards);
  - ``recall.<name>.{1k,first}.{i2t,t2i}`` (r1, r5, r10, medr, meanr) from their ``i2t``/``t2i`` on the whole
    split / on the first of five folds, and ``recall.<name>.fold5`` (13 numbers: the mean over five folds of
    ``r[5] + ri[5] + [ar, ari, rsum]``, ``evalrank(fold5=True)``'s ``mean_metrics``, folds of 8 images here
    instead of 1,000); the same for ``ensemble`` (the mean of ``sims.t2i_lse`` and ``sims.i2t_lse``, the paper's
    ensemble of a t-i and an i-t model);
  - ``loss.<name>`` and ``grad.<name>.<parameter>``: ``ContrastiveLoss(max_violation=True)`` on training batch 0
    from the initial state, and the gradient of every parameter;
  - ``train.<name>.{loss,lr}`` [16] and ``train.<name>.param.<parameter>`` for ``t2i_lse`` and ``i2t_avg``: 16
    steps of their ``train`` loop (``train_emb``: Adam, grad-norm clip 2.0) over 4 epochs of 4 batches, with
    ``adjust_learning_rate`` before each epoch (lr 2e-3, ``lr_update`` 2: ×0.1 from step 9).

Glue written here (their ``evalrank`` reads a checkpoint, a vocabulary and data files and hard-codes COCO's
5,000-caption folds): the loader stand-in (their ``collate_fn`` over the stored items, ``ids`` as a list as their
DataLoader's ``pin_memory`` made of the tuple), the fold loop (``evalrank``'s, with the fold size as a
parameter) and the epoch loop (``main``'s, without validation and checkpoints).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = ""     # before torch is imported: their code calls .cuda() when it can

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Patch, patched_copy, write_figures  # noqa: E402

REPOSITORY = "https://github.com/kuanghuei/SCAN"

PATCHES = [
    Patch("model.py",
          "cap_emb = (cap_emb[:,:,:cap_emb.size(2)/2] + cap_emb[:,:,cap_emb.size(2)/2:])/2",
          "cap_emb = (cap_emb[:,:,:cap_emb.size(2)//2] + cap_emb[:,:,cap_emb.size(2)//2:])/2",
          "Python 3: `/` gives a float slice index (TypeError) in the bi-GRU average; `//` is Python 2's `/` here"),
    Patch("model.py",
          "self.logger.update('Le', loss.data[0], img_emb.size(0))",
          "self.logger.update('Le', loss.item(), img_emb.size(0))",
          "torch >= 0.4: the loss is a 0-d tensor and `.data[0]` raises; `.item()` is the same number"),
    Patch("evaluation.py",
          "for i, (k, v) in enumerate(self.meters.iteritems()):",
          "for i, (k, v) in enumerate(self.meters.items()):",
          "Python 3 dicts have no iteritems (LogCollector.__str__, logging only)"),
    Patch("evaluation.py",
          "for k, v in self.meters.iteritems():",
          "for k, v in self.meters.items():",
          "Python 3 dicts have no iteritems (LogCollector.tb_log, called by train() after every step; logging only)"),
    Patch("evaluation.py",
          "Computer pairwise t2i image-caption distance with locality sharding\n    \"\"\"\n"
          "    n_im_shard = (len(images)-1)/shard_size + 1\n    n_cap_shard = (len(captions)-1)/shard_size + 1",
          "Computer pairwise t2i image-caption distance with locality sharding\n    \"\"\"\n"
          "    n_im_shard = (len(images)-1)//shard_size + 1\n    n_cap_shard = (len(captions)-1)//shard_size + 1",
          "Python 3: `/` makes the shard counts floats and range() refuses them (shard_xattn_t2i)"),
    Patch("evaluation.py",
          "Computer pairwise i2t image-caption distance with locality sharding\n    \"\"\"\n"
          "    n_im_shard = (len(images)-1)/shard_size + 1\n    n_cap_shard = (len(captions)-1)/shard_size + 1",
          "Computer pairwise i2t image-caption distance with locality sharding\n    \"\"\"\n"
          "    n_im_shard = (len(images)-1)//shard_size + 1\n    n_cap_shard = (len(captions)-1)//shard_size + 1",
          "Python 3: `/` makes the shard counts floats and range() refuses them (shard_xattn_i2t)"),
    Patch("evaluation.py",
          "shard_xattn_t2i batch (%d,%d)' % (i,j))\n"
          "            cap_start, cap_end = shard_size*j, min(shard_size*(j+1), len(captions))\n"
          "            im = Variable(torch.from_numpy(images[im_start:im_end]), volatile=True).cuda()\n"
          "            s = Variable(torch.from_numpy(captions[cap_start:cap_end]), volatile=True).cuda()",
          "shard_xattn_t2i batch (%d,%d)' % (i,j))\n"
          "            cap_start, cap_end = shard_size*j, min(shard_size*(j+1), len(captions))\n"
          "            im = Variable(torch.from_numpy(images[im_start:im_end]), volatile=True)\n"
          "            s = Variable(torch.from_numpy(captions[cap_start:cap_end]), volatile=True)",
          "CPU run: shard_xattn_t2i moves its shards to CUDA unconditionally (the rest of their code asks "
          "torch.cuda.is_available() first)"),
    Patch("evaluation.py",
          "shard_xattn_i2t batch (%d,%d)' % (i,j))\n"
          "            cap_start, cap_end = shard_size*j, min(shard_size*(j+1), len(captions))\n"
          "            im = Variable(torch.from_numpy(images[im_start:im_end]), volatile=True).cuda()\n"
          "            s = Variable(torch.from_numpy(captions[cap_start:cap_end]), volatile=True).cuda()",
          "shard_xattn_i2t batch (%d,%d)' % (i,j))\n"
          "            cap_start, cap_end = shard_size*j, min(shard_size*(j+1), len(captions))\n"
          "            im = Variable(torch.from_numpy(images[im_start:im_end]), volatile=True)\n"
          "            s = Variable(torch.from_numpy(captions[cap_start:cap_end]), volatile=True)",
          "CPU run: shard_xattn_i2t moves its shards to CUDA unconditionally"),
    Patch("train.py",
          "import tensorboard_logger as tb_logger\n",
          "class tb_logger:  # golden patch: tensorboard_logger (logging only) is not installed\n"
          "    @staticmethod\n    def log_value(*args, **kwargs):\n        pass\n\n"
          "    @staticmethod\n    def configure(*args, **kwargs):\n        pass\n",
          "tensorboard_logger is an unmaintained logging package; train() only logs through it"),
]
#: left as they are, since they still work: ``Variable(..., volatile=True)`` (a warning, no effect; the
#: generator runs evaluation under ``torch.no_grad()``), ``clip_grad_norm`` (the deprecated alias of
#: ``clip_grad_norm_``), ``nn.Softmax()`` without ``dim`` (picks dim 1 of the 2-D input, as it always did).

# ---------------------------------------------------------------------------------------------- sizes
SEED = 20180318
REGIONS, IMG_DIM, EMBED, WORD_DIM, VOCAB = 10, 32, 16, 8, 30
EVAL_IMAGES, EVAL_BATCH, FOLDS = 40, 32, 5
POOL_IMAGES, BATCH, EPOCHS, LR, LR_UPDATE, GRAD_CLIP = 8, 10, 4, 2e-3, 2, 2.0
MIN_WORDS, MAX_WORDS = 1, 10            # words between <start> and <end>
SETTINGS = {   # name → (state, cross_attn, agg_func, lambda_softmax, lambda_lse)
    "t2i_lse": ("A", "t2i", "LogSumExp", 9.0, 6.0),
    "t2i_avg": ("A", "t2i", "Mean", 9.0, 6.0),
    "i2t_lse": ("B", "i2t", "LogSumExp", 4.0, 5.0),
    "i2t_avg": ("B", "i2t", "Mean", 4.0, 5.0),
}
TRAINED = ("t2i_lse", "i2t_avg")
ENSEMBLE = ("t2i_lse", "i2t_lse")


def options(name: str) -> argparse.Namespace:
    """The ``opt`` of their train.py (every argument at its default) with this setting's values."""
    _, cross_attn, agg, lambda_softmax, lambda_lse = SETTINGS[name]
    return argparse.Namespace(
        data_path="./data/", data_name="precomp", vocab_path="./vocab/", margin=0.2, num_epochs=EPOCHS,
        batch_size=BATCH, word_dim=WORD_DIM, embed_size=EMBED, grad_clip=GRAD_CLIP, num_layers=1,
        learning_rate=LR, lr_update=LR_UPDATE, workers=0, log_step=10 ** 9, val_step=10 ** 9,
        logger_name="./runs/golden/log", model_name="./runs/golden/checkpoint", resume="", max_violation=True,
        img_dim=IMG_DIM, no_imgnorm=False, no_txtnorm=False, raw_feature_norm="clipped_l2norm", agg_func=agg,
        cross_attn=cross_attn, precomp_enc_type="basic", bi_gru=True, lambda_lse=lambda_lse,
        lambda_softmax=lambda_softmax, vocab_size=VOCAB)


def captions(rng: np.random.Generator, count: int, taken: set) -> list[list[int]]:
    """``count`` distinct token lists ``<start> w… <end>`` (words 3..VOCAB-1: <unk> included, no <pad>)."""
    out = []
    while len(out) < count:
        words = rng.integers(3, VOCAB, size=int(rng.integers(MIN_WORDS, MAX_WORDS + 1))).tolist()
        tokens = (1, *words, 2)
        if tokens not in taken:
            taken.add(tokens)
            out.append(list(tokens))
    return out


def padded(token_lists) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(t) for t in token_lists], dtype=np.int64)
    tokens = np.zeros((len(token_lists), int(lengths.max())), dtype=np.int64)
    for row, t in enumerate(token_lists):
        tokens[row, :len(t)] = t
    return tokens, lengths


class Loader(list):
    """Stands in for their ``DataLoader`` (``shuffle=False`` for evaluation): the batches in order and a
    ``dataset`` to take ``len`` of."""

    def __init__(self, batches, size: int):
        super().__init__(batches)
        self.dataset = range(size)


def collated(collate_fn, items):
    """Their ``collate_fn`` over ``(image, caption, index, image id)`` items; ``ids`` comes back a list, as their
    DataLoader's ``pin_memory=True`` turned the tuple into one (``encode_data`` indexes numpy arrays with it)."""
    images, targets, lengths, ids = collate_fn(list(items))
    return images, targets, lengths, list(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a checkout of kuanghuei/SCAN")
    source = parser.parse_args().checkout.resolve()
    work = patched_copy(source, PATCHES)
    sys.path.insert(0, str(work))
    warnings.filterwarnings("ignore")

    import torch
    import model as their_model                      # noqa: E402  (the patched copy)
    import data as their_data                        # noqa: E402
    import evaluation as their_eval                  # noqa: E402
    import train as their_train                      # noqa: E402

    assert not torch.cuda.is_available()
    rng = np.random.default_rng(SEED)
    inputs: dict = {}
    figures: dict = {}

    # ------------------------------------------------------------------ initial states: their own initialisation
    states = {}
    for label, seed in (("A", 1), ("B", 2)):
        torch.manual_seed(seed)
        fresh = their_model.SCAN(options("t2i_lse"))
        states[label] = [{k: v.detach().float().numpy().copy() for k, v in enc.state_dict().items()}
                         for enc in (fresh.img_enc, fresh.txt_enc)]
        for prefix, state in zip(("img_enc", "txt_enc"), states[label]):
            for key, value in state.items():
                inputs[f"state.{label}.{prefix}.{key}"] = value
    for name in SETTINGS:
        inputs[f"config.{name}"] = np.array(json.dumps({"opt": vars(options(name)), "state": SETTINGS[name][0]}))

    def build(name: str):
        """Their ``SCAN`` for setting ``name`` with its stored state, in float64 (optimizer built on the same
        Parameter objects: ``.double()`` converts them in place)."""
        scan = their_model.SCAN(options(name))
        scan.img_enc.double()
        scan.txt_enc.double()
        img_state, txt_state = states[SETTINGS[name][0]]
        scan.load_state_dict([{k: torch.from_numpy(v).double() for k, v in img_state.items()},
                              {k: torch.from_numpy(v).double() for k, v in txt_state.items()}])
        assert all(p.dtype == torch.float64 for p in scan.params)
        assert {id(p) for p in scan.optimizer.param_groups[0]["params"]} == {id(p) for p in scan.params}
        return scan

    # ------------------------------------------------------------------ data
    taken: set = set()
    eval_features = rng.standard_normal((EVAL_IMAGES, REGIONS, IMG_DIM)).astype(np.float32)
    eval_tokens, eval_lengths = padded(captions(rng, 5 * EVAL_IMAGES, taken))
    inputs.update({"eval.features": eval_features, "eval.tokens": eval_tokens, "eval.lengths": eval_lengths,
                   "eval.caption_image": np.arange(5 * EVAL_IMAGES) // 5})
    pool = rng.standard_normal((POOL_IMAGES, REGIONS, IMG_DIM)).astype(np.float32)
    pool_tokens = captions(rng, 5 * POOL_IMAGES, taken)
    steps = []                       # per step: (epoch, image index per pair, token lists), collate order
    for epoch in range(EPOCHS):
        order = rng.permutation(5 * POOL_IMAGES)
        for start in range(0, len(order), BATCH):
            chosen = order[start:start + BATCH]
            items = [(torch.from_numpy(pool[c // 5]).double(), torch.Tensor(pool_tokens[c]), int(c), int(c // 5))
                     for c in chosen]
            _, _, _, ids = collated(their_data.collate_fn, items)
            steps.append((epoch, [i // 5 for i in ids], [pool_tokens[i] for i in ids]))
    width = max(len(t) for _, _, toks in steps for t in toks)
    train_tokens = np.zeros((len(steps), BATCH, width), dtype=np.int64)
    for s, (_, _, toks) in enumerate(steps):
        train_tokens[s, :, :] = np.pad(padded(toks)[0], ((0, 0), (0, width - max(len(t) for t in toks))))
    inputs.update({"train.pool": pool, "train.epoch": np.array([e for e, _, _ in steps]),
                   "train.images": np.array([img for _, img, _ in steps]),
                   "train.tokens": train_tokens,
                   "train.lengths": np.array([[len(t) for t in toks] for _, _, toks in steps])})

    def train_batch(s: int):
        """Step ``s``'s batch as their collate_fn gave it: (images, targets, lengths, ids)."""
        _, img, toks = steps[s]
        items = [(torch.from_numpy(pool[i]).double(), torch.Tensor(t), n, i) for n, (i, t) in enumerate(zip(img, toks))]
        batch = collated(their_data.collate_fn, items)
        assert batch[3] == list(range(BATCH)), "stored batches are already in collate order"
        return batch

    eval_items = [(torch.from_numpy(eval_features[c // 5]).double(), torch.Tensor(eval_tokens[c, :eval_lengths[c]]),
                   c, c // 5) for c in range(5 * EVAL_IMAGES)]
    eval_loader = Loader([collated(their_data.collate_fn, eval_items[s:s + EVAL_BATCH])
                          for s in range(0, len(eval_items), EVAL_BATCH)], len(eval_items))

    # ------------------------------------------------------------------ evaluation
    def recalls(prefix: str, img_embs, cap_embs, cap_lens, sims, fold_sims) -> None:
        """1K-style (whole split), first fold, and evalrank(fold5=True)'s mean over five folds (``fold_sims``:
        each fold scored on its own, as evalrank does)."""
        r, _ = their_eval.i2t(img_embs, cap_embs, cap_lens, sims, return_ranks=True)
        ri, _ = their_eval.t2i(img_embs, cap_embs, cap_lens, sims, return_ranks=True)
        figures[f"{prefix}.1k.i2t"], figures[f"{prefix}.1k.t2i"] = np.array(r), np.array(ri)
        n = EVAL_IMAGES // FOLDS                         # images per fold (their 1,000)
        results = []
        for i in range(FOLDS):                           # evalrank's fold loop
            images, caps = slice(i * n, (i + 1) * n), slice(5 * i * n, 5 * (i + 1) * n)
            fold = fold_sims[i]
            r, _ = their_eval.i2t(img_embs[images], cap_embs[caps], cap_lens[caps], fold, return_ranks=True)
            ri, _ = their_eval.t2i(img_embs[images], cap_embs[caps], cap_lens[caps], fold, return_ranks=True)
            if i == 0:
                figures[f"{prefix}.first.i2t"], figures[f"{prefix}.first.t2i"] = np.array(r), np.array(ri)
            ar, ari = (r[0] + r[1] + r[2]) / 3, (ri[0] + ri[1] + ri[2]) / 3
            results += [list(r) + list(ri) + [ar, ari, r[0] + r[1] + r[2] + ri[0] + ri[1] + ri[2]]]
        figures[f"{prefix}.fold5"] = np.array(results).mean(axis=0).flatten()

    per_setting = {}
    notes = []
    for name in SETTINGS:
        scan = build(name)
        opt = options(name)
        with torch.no_grad():
            img_embs_repeated, cap_embs, cap_lens = their_eval.encode_data(scan, eval_loader, logging=lambda *a: None)
            img_embs = np.array([img_embs_repeated[i] for i in range(0, len(img_embs_repeated), 5)])
            shard = their_eval.shard_xattn_t2i if opt.cross_attn == "t2i" else their_eval.shard_xattn_i2t
            sims = shard(img_embs, cap_embs, cap_lens, opt, shard_size=128)
            # evalrank(fold5=True) scores each fold on its own (their 5,000 captions, 5 × 8 here)
            per_fold = 5 * EVAL_IMAGES // FOLDS
            folds = [shard(img_embs_repeated[i * per_fold:(i + 1) * per_fold:5],
                           cap_embs[i * per_fold:(i + 1) * per_fold], cap_lens[i * per_fold:(i + 1) * per_fold],
                           opt, shard_size=128) for i in range(FOLDS)]
        figures[f"sims.{name}"] = sims
        per_setting[name] = (img_embs, cap_embs, cap_lens, folds)
        recalls(f"recall.{name}", img_embs, cap_embs, cap_lens, sims, folds)
        worst_fold = max(np.abs(f - sims[i * 8:(i + 1) * 8, i * 40:(i + 1) * 40]).max() for i, f in enumerate(folds))
        notes.append(f"{name}: folds scored alone differ from the whole matrix by {worst_fold:.1e}")
    ensemble = (figures[f"sims.{ENSEMBLE[0]}"] + figures[f"sims.{ENSEMBLE[1]}"]) / 2
    ensemble_folds = [(a + b) / 2 for a, b in zip(per_setting[ENSEMBLE[0]][3], per_setting[ENSEMBLE[1]][3])]
    recalls("recall.ensemble", *per_setting[ENSEMBLE[0]][:3], ensemble, ensemble_folds)

    # ------------------------------------------------------------------ loss and gradients at the initial state
    for name in SETTINGS:
        scan = build(name)
        scan.train_start()
        images, targets, lengths, _ = train_batch(0)
        img_emb, cap_emb, cap_lens = scan.forward_emb(images, targets, lengths)
        loss = scan.criterion(img_emb, cap_emb, cap_lens)
        for p in scan.params:
            p.grad = None
        loss.backward()
        figures[f"loss.{name}"] = np.array(loss.item())
        for prefix, enc in (("img_enc", scan.img_enc), ("txt_enc", scan.txt_enc)):
            for key, p in enc.named_parameters():
                figures[f"grad.{name}.{prefix}.{key}"] = p.grad.numpy().copy()

    # ------------------------------------------------------------------ training steps through their loop
    kinks: list[float] = []          # |margin + S_ij - S_ii| nearest to 0 (where the hinge bends)
    switches: list[float] = []       # gap between the hardest and the next hardest negative (distinct images)
    for name in TRAINED:
        scan = build(name)
        opt = options(name)
        losses, rates, norms = [], [], []
        forward_loss = scan.forward_loss

        def recording_loss(img_emb, cap_emb, cap_len, **kwargs):
            loss = forward_loss(img_emb, cap_emb, cap_len, **kwargs)
            losses.append(loss.item())
            rates.append(scan.optimizer.param_groups[0]["lr"])
            with torch.no_grad():       # how far each step is from a hinge's kink or a change of hardest negative
                score = their_model.xattn_score_t2i if opt.cross_attn == "t2i" else their_model.xattn_score_i2t
                s = score(img_emb, cap_emb, cap_len, opt).numpy()
                image = np.asarray(steps[len(losses) - 1][1])
                d = np.diag(s)
                for cost, same in ((opt.margin + s - d[:, None], np.zeros(s.shape, bool)),       # rows: captions
                                   ((opt.margin + s - d[None, :]).T, image[:, None] == image[None, :])):  # images
                    off = ~np.eye(len(d), dtype=bool)
                    kinks.append(float(np.abs(cost[off]).min()))
                    for row in range(len(d)):
                        distinct = np.unique(cost[row][off[row] & ~same[row]])
                        if len(distinct) > 1 and distinct[-1] > 0:
                            switches.append(float(distinct[-1] - distinct[-2]))
            return loss

        scan.forward_loss = recording_loss
        clip = their_model.clip_grad_norm

        def recording_clip(parameters, max_norm, *args, **kwargs):    # train_emb's clip, its norm recorded
            norm = clip(parameters, max_norm, *args, **kwargs)
            norms.append(float(norm))
            return norm

        their_model.clip_grad_norm = recording_clip
        for epoch in range(EPOCHS):                      # main()'s epoch loop, without validation/checkpoints
            their_train.adjust_learning_rate(opt, scan.optimizer, epoch)
            loader = [train_batch(s) for s in range(len(steps)) if steps[s][0] == epoch]
            their_train.train(opt, loader, scan, epoch, None)
        assert len(losses) == len(steps) == scan.Eiters
        figures[f"train.{name}.loss"], figures[f"train.{name}.lr"] = np.array(losses), np.array(rates)
        for prefix, enc in (("img_enc", scan.img_enc), ("txt_enc", scan.txt_enc)):
            for key, p in enc.named_parameters():
                figures[f"train.{name}.param.{prefix}.{key}"] = p.detach().numpy().copy()
        their_model.clip_grad_norm = clip
        notes.append(f"{name}: the gradient norm exceeded {GRAD_CLIP} (was clipped) at "
                     f"{sum(n > GRAD_CLIP for n in norms)} of {len(norms)} steps "
                     f"(norms {min(norms):.2f}..{max(norms):.2f})")

    # ------------------------------------------------------------------ distances from ties (the figures' stability)
    def rank_gap(sims: np.ndarray) -> float:
        owner = np.arange(sims.shape[1]) // 5
        true = sims[owner, np.arange(sims.shape[1])]
        t2i = np.abs(sims - true[None, :])
        t2i[owner, np.arange(sims.shape[1])] = np.inf
        best = np.array([sims[i, owner == i].max() for i in range(sims.shape[0])])
        i2t = np.abs(sims - best[:, None])
        i2t[owner, np.arange(sims.shape[1])] = np.inf
        return float(min(t2i.min(), i2t.min()))

    gaps = {name: rank_gap(figures[f"sims.{name}"]) for name in SETTINGS}
    gaps["ensemble"] = rank_gap(ensemble)
    assert min(gaps.values()) > 1e-9, f"a near-tie would make the recalls fragile: {gaps}"
    notes.append("smallest distance of a score from the one it is ranked against: "
                 + ", ".join(f"{k} {v:.2e}" for k, v in gaps.items()))
    notes.append(f"training: the hinge is at least {min(kinks):.2e} from its kink and the hardest negative at least "
                 f"{min(switches):.2e} ahead of the next (copies of one image in a batch tie exactly: same gradient)")
    notes.append("float64 on the CPU (CUDA hidden); the initial states are float32 values; generator: "
                 "tools/golden/scan.py (its docstring lists what each figure is)")
    folder = write_figures("scan", repository=REPOSITORY, source=source, patches=PATCHES, inputs=inputs,
                           figures=figures, notes="; ".join(notes))
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"wrote {folder} ({size / 1024:.0f} KiB)")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
