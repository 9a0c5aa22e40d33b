"""Benchmark: training steps/s and evaluation pairs/s of each model on CPU, at one fixed synthetic size.

Every model's cases live in :data:`CASES` (``@bench_case("name")``); a case returns result dicts and each
result carries the baseline it is compared with, measured in the same run:

* ``train_steps_per_s`` — forward + backward + clip + optimiser step on a batch of ``--batch`` matching pairs
  (random features of the model's input kind and random captions of 8–16 tokens), the model's own optimiser.
  Baseline: VSE++ (the global-vector reference every paper compares to) on the same features and batch.
* ``eval_pairs_per_s`` — encode ``--images`` images and ``5 ×`` as many captions, then fill the full
  similarity matrix with the evaluator's blockwise scorer (:func:`retr.trainers.evaluation.similarity.score_blocks`);
  pairs = images × captions. Baseline: for pair-specific models (SMAN), scoring pairs one by one
  (``score`` on 1 × 1 blocks, timed on ``--pair-baseline`` pairs); for SEAM, VSE++'s dot products.

Sizes are the papers' (SMAN: 49 × 2048 grid, d = 512; SEAM: 10 × 4096 crops, d = 1024); ``--small`` shrinks
every dimension to check the script quickly. One JSON line per result.

    python bench/models.py                      # every case
    python bench/models.py --models sman --steps 3
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import numpy as np
import torch

from retr.trainers.evaluation.similarity import score_blocks
from retr.trainers.models import create_model

VOCAB = 5000
CASES: dict[str, Callable[[argparse.Namespace], list[dict]]] = {}


def bench_case(name: str):
    """Register ``fn(args) -> [result dict]`` as the bench cases of model ``name``."""
    def wrap(fn):
        CASES[name] = fn
        return fn
    return wrap


# ------------------------------------------------------------------------------------------------ helpers

def random_captions(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 17, (n,), generator=g)
    tokens = torch.randint(4, VOCAB, (n, int(lengths.max())), generator=g)
    return tokens.masked_fill(torch.arange(tokens.shape[1]) >= lengths.view(-1, 1), 0), lengths


def random_features(n: int, k: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, k, d, generator=g), torch.ones(n, k, dtype=torch.bool)


def train_steps_per_s(model, features, mask, tokens, lengths, steps: int, lr: float, grad_clip: float) -> float:
    """Optimisation steps per second (one warm-up step not timed)."""
    model.train()
    optimizer = model.configure_optimizer(lr)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(features, mask, tokens, lengths).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()

    step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return steps / (time.perf_counter() - started)


@torch.no_grad()
def encode(model, features, mask, tokens, lengths, batch: int = 128):
    """Image embeddings (one dict) and length-sorted caption blocks, as the evaluator makes them."""
    from retr.trainers.evaluation.similarity import _concat
    model.eval()
    images = _concat([model.encode_images(features[s:s + batch], mask[s:s + batch])
                      for s in range(0, features.shape[0], batch)])
    order = torch.argsort(lengths, stable=True).numpy()
    blocks = []
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        length = int(lengths[idx].max())
        blocks.append((idx, model.encode_captions(tokens[idx, :length], lengths[idx])))
    return images, blocks


@torch.no_grad()
def eval_pairs_per_s(model, features, mask, tokens, lengths) -> tuple[float, np.ndarray]:
    """(pairs/s of encoding + blockwise scoring of the full matrix, the matrix)."""
    started = time.perf_counter()
    images, blocks = encode(model, features, mask, tokens, lengths)
    sims = score_blocks(model.score, images, blocks, features.shape[0], tokens.shape[0])
    return sims.size / (time.perf_counter() - started), sims


@torch.no_grad()
def one_by_one_pairs_per_s(model, features, mask, tokens, lengths, pairs: int, sims: np.ndarray) -> tuple[float, float]:
    """(pairs/s scoring ``pairs`` pairs one at a time, max |difference| from the blockwise matrix ``sims``)."""
    images, blocks = encode(model, features, mask, tokens, lengths)
    captions = {int(i): {k: v[j:j + 1] for k, v in caps.items()} for idx, caps in blocks for j, i in enumerate(idx)}
    rng = np.random.default_rng(0)
    chosen = [(int(rng.integers(features.shape[0])), int(rng.integers(tokens.shape[0]))) for _ in range(pairs)]
    diff, started = 0.0, time.perf_counter()
    for i, c in chosen:
        score = model.score({k: v[i:i + 1] for k, v in images.items()}, captions[c])   # padding is masked
        diff = max(diff, abs(float(score[0, 0]) - sims[i, c]))
    return pairs / (time.perf_counter() - started), diff


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def vsepp_baseline(args, img_dim: int, embed_size: int, train_inputs, eval_inputs) -> dict:
    """VSE++'s training steps/s and evaluation pairs/s on the same inputs."""
    torch.manual_seed(0)
    model = create_model("vsepp", vocab_size=VOCAB, img_dim=img_dim, embed_size=embed_size)
    return {"train": train_steps_per_s(model, *train_inputs[0], *train_inputs[1], args.steps, 2e-4, 2.0),
            "eval": eval_pairs_per_s(model, *eval_inputs)[0]}


def sizes(args, full: dict, small: dict) -> dict:
    return small if args.small else full


# ----------------------------------------------------------------------------------------------- cases

@bench_case("sman")
def bench_sman(args) -> list[dict]:
    s = sizes(args, dict(k=49, img_dim=2048, d=512), dict(k=49, img_dim=64, d=32))
    train_inputs = (random_features(args.batch, s["k"], s["img_dim"]), random_captions(args.batch))
    eval_inputs = (*random_features(args.images, s["k"], s["img_dim"], 1), *random_captions(5 * args.images, 1))
    torch.manual_seed(0)
    model = create_model("sman", vocab_size=VOCAB, img_dim=s["img_dim"], embed_size=s["d"], word_dim=s["d"])
    train_rate = train_steps_per_s(model, *train_inputs[0], *train_inputs[1], args.steps, 0.05, 0.1)
    eval_rate, sims = eval_pairs_per_s(model, *eval_inputs)
    one_rate, diff = one_by_one_pairs_per_s(model, *eval_inputs, args.pair_baseline, sims)
    base = vsepp_baseline(args, s["img_dim"], s["d"], train_inputs, eval_inputs)
    common = {"model": "sman", "device": "cpu", "threads": torch.get_num_threads(), "embed_size": s["d"],
              "input": f"{s['k']}x{s['img_dim']}"}
    return [
        {**common, "metric": "train_steps_per_s", "batch": args.batch, "value": round(train_rate, 3),
         "baseline": "vsepp", "baseline_value": round(base["train"], 3)},
        {**common, "metric": "eval_pairs_per_s", "images": args.images, "captions": 5 * args.images,
         "value": round(eval_rate, 1), "baseline": "sman pairs one by one", "baseline_value": round(one_rate, 1),
         "speedup": round(eval_rate / one_rate, 1), "max_abs_diff": diff,
         "vsepp_pairs_per_s": round(base["eval"], 1)},
    ]


@bench_case("seam")
def bench_seam(args) -> list[dict]:
    s = sizes(args, dict(k=10, img_dim=4096, d=1024), dict(k=10, img_dim=64, d=32))
    train_inputs = (random_features(args.batch, s["k"], s["img_dim"]), random_captions(args.batch))
    eval_inputs = (*random_features(args.images, s["k"], s["img_dim"], 1), *random_captions(5 * args.images, 1))
    base = vsepp_baseline(args, s["img_dim"], s["d"], train_inputs, eval_inputs)
    out = []
    for kind in ("e", "c", "g"):
        torch.manual_seed(0)
        extra = (dict(gru_size=512) if not args.small else
                 dict(word_dim=32, attention_hidden=32, conv_filters=16, gru_size=32))
        model = create_model("seam", vocab_size=VOCAB, img_dim=s["img_dim"], embed_size=s["d"], text_encoder=kind,
                             **extra)
        train_rate = train_steps_per_s(model, *train_inputs[0], *train_inputs[1], args.steps, 1e-3, 1.0)
        eval_rate, _ = eval_pairs_per_s(model, *eval_inputs)
        common = {"model": f"seam-{kind}", "device": "cpu", "threads": torch.get_num_threads(), "embed_size": s["d"],
                  "input": f"{s['k']}x{s['img_dim']}"}
        out += [{**common, "metric": "train_steps_per_s", "batch": args.batch, "value": round(train_rate, 3),
                 "baseline": "vsepp", "baseline_value": round(base["train"], 3)},
                {**common, "metric": "eval_pairs_per_s", "images": args.images, "captions": 5 * args.images,
                 "value": round(eval_rate, 1), "baseline": "vsepp", "baseline_value": round(base["eval"], 1)}]
    return out


@bench_case("jgcar")
def bench_jgcar(args) -> list[dict]:
    """JGCAR on 196 × 512 maps with d = l = 64 (the paper's d = 256, l = 512 is a GPU job: ~51 M MACs a pair).

    Two-step: the shortlist is the same fraction of the candidates as the paper's 100 of a 1K test (10 %);
    its time (global scores + re-ranking the shortlists) is compared with scoring every pair, same embeddings.
    """
    from retr.trainers.evaluation.similarity import _concat
    from retr.trainers.evaluation.two_step import full_scores, rerank_matrices
    s = sizes(args, dict(k=196, img_dim=512, d=64, l=64), dict(k=196, img_dim=64, d=16, l=16))
    batch = min(args.batch, 32)
    train_inputs = (random_features(batch, s["k"], s["img_dim"]), random_captions(batch))
    eval_inputs = (*random_features(args.images, s["k"], s["img_dim"], 1), *random_captions(5 * args.images, 1))
    torch.manual_seed(0)
    model = create_model("jgcar", vocab_size=VOCAB, img_dim=s["img_dim"], embed_size=s["d"], word_dim=s["d"],
                         hidden_size=s["l"], num_regions=s["k"], dropout=0.5, num_negatives=min(30, batch - 1))
    train_rate = train_steps_per_s(model, *train_inputs[0], *train_inputs[1], args.steps, 4e-4, 2.0)
    eval_rate, sims = eval_pairs_per_s(model, *eval_inputs)
    base = vsepp_baseline(args, s["img_dim"], s["d"], (train_inputs[0], train_inputs[1]), eval_inputs)
    # two-step against scoring every pair, on the same embeddings (manifest order), float32
    images, blocks = encode(model, *eval_inputs)
    captions = _concat([caps for _, caps in blocks])
    order = torch.from_numpy(np.concatenate([idx for idx, _ in blocks]))
    captions = {k: v[torch.argsort(order)] for k, v in captions.items()}
    shortlist = max(1, args.images // 10)
    with torch.no_grad():
        started = time.perf_counter()
        full = full_scores(model, images, captions)
        full_s = time.perf_counter() - started
        started = time.perf_counter()
        g = model.global_score(images, captions)
        i2t, t2i = rerank_matrices(g, lambda ii, cc: model.pair_score(images, captions, ii, cc), shortlist)
        two_s = time.perf_counter() - started
        covered = rerank_matrices(g, lambda ii, cc: model.pair_score(images, captions, ii, cc), 10 ** 9)[0]
    n_cap = 5 * args.images
    common = {"model": "jgcar", "device": "cpu", "threads": torch.get_num_threads(), "embed_size": s["d"],
              "hidden_size": s["l"], "input": f"{s['k']}x{s['img_dim']}"}
    return [
        {**common, "metric": "train_steps_per_s", "batch": batch, "value": round(train_rate, 3),
         "baseline": "vsepp", "baseline_value": round(base["train"], 3)},
        {**common, "metric": "eval_pairs_per_s", "images": args.images, "captions": n_cap,
         "value": round(eval_rate, 1), "baseline": "vsepp", "baseline_value": round(base["eval"], 1)},
        {**common, "metric": "two_step_eval_seconds", "images": args.images, "captions": n_cap,
         "shortlist": shortlist, "value": round(two_s, 3), "baseline": "co-attention on every pair",
         "baseline_value": round(full_s, 3), "speedup": round(full_s / two_s, 2),
         "pairs_scored": args.images * shortlist + n_cap * shortlist, "pairs_all": args.images * n_cap,
         "max_abs_diff_full_shortlist_vs_every_pair": float((covered - full).abs().max())},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=None, help=f"cases to run (default all: {', '.join(CASES)})")
    parser.add_argument("--batch", type=int, default=128, help="training batch")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps")
    parser.add_argument("--images", type=int, default=200, help="evaluation images (captions: 5 per image)")
    parser.add_argument("--pair-baseline", type=int, default=300, help="pairs scored one by one (baseline)")
    parser.add_argument("--small", action="store_true", help="tiny dimensions (a quick check of the script)")
    args = parser.parse_args()
    for name in args.models or list(CASES):
        if name not in CASES:
            parser.error(f"no bench case {name!r} (known: {', '.join(CASES)})")
        for record in CASES[name](args):
            emit(record)


if __name__ == "__main__":
    main()
