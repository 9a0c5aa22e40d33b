"""Benchmark: SCAN similarity matrix, retr's blockwise evaluator vs the authors' way of computing it.

Data: 1,000 images × 5,000 captions (default), 36 regions, d = 1024, captions of 3–12 words; random unit
vectors (the cost does not depend on the values). Both sides score the same embeddings with t-i LSE
(λ_softmax 9, λ_lse 6, clipped_l2norm).

* ``retr``: :func:`retr.trainers.evaluation.score_blocks` — length-sorted caption blocks × image blocks, one
  matrix product for all region–word dot products, attended vectors never formed (Gram matrices).
* ``baseline``: the authors' public evaluation (``shard_xattn_t2i`` + ``xattn_score_t2i``): blocks of 128
  images, one caption at a time, attended vectors formed, float64.

The baseline takes ~20 min on a 2-core CPU for the full matrix; ``--baseline-captions N`` times it on the first
N captions (all images) instead, and the rankings (images per caption, captions per image within those columns)
are compared on those columns. One JSON line per result, each with the baseline of the same run.
Peak memory (ru_maxrss) is reported at the end.

    python bench/eval.py --baseline-captions 200
"""
from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np
import torch

from retr.trainers.evaluation import score_blocks
from retr.trainers.models.xattn import xattn_scores


def baseline_t2i(images: torch.Tensor, captions: list[torch.Tensor], lsm: float, lse: float,
                 shard: int = 128) -> np.ndarray:
    """The authors' arithmetic: per caption, per block of 128 images, attended vectors formed (float64)."""
    n_img = images.shape[0]
    sims = np.zeros((n_img, len(captions)))
    for c, cap in enumerate(captions):
        for start in range(0, n_img, shard):
            img = images[start:start + shard]                       # [b, K, d]
            q = cap.unsqueeze(0).expand(img.shape[0], -1, -1)       # [b, L, d]
            attn = torch.bmm(img, q.transpose(1, 2))                # [b, K, L]
            attn = torch.nn.functional.leaky_relu(attn, 0.1)
            attn = attn / (attn.pow(2).sum(2, keepdim=True).sqrt() + 1e-8)
            attn = torch.softmax(attn.transpose(1, 2) * lsm, dim=2)  # [b, L, K]
            attended = torch.bmm(attn, img)                         # [b, L, d]
            w12 = (q * attended).sum(2)
            w1, w2 = q.norm(dim=2), attended.norm(dim=2)
            row = w12 / (w1 * w2).clamp(min=1e-8)
            row = torch.log(torch.exp(row * lse).sum(1)) / lse
            sims[start:start + img.shape[0], c] = row.numpy()
    return sims


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--captions", type=int, default=5000)
    parser.add_argument("--regions", type=int, default=36)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--baseline-captions", type=int, default=None, help="time the baseline on N captions")
    parser.add_argument("--precision", default="mixed,float64")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    norm = torch.nn.functional.normalize
    images = norm(torch.randn(args.images, args.regions, args.dim, generator=g), dim=-1)
    lengths = torch.randint(3, 13, (args.captions,), generator=g)
    words = [norm(torch.randn(int(n), args.dim, generator=g), dim=-1) for n in lengths]
    pairs = args.images * args.captions
    nb = args.baseline_captions or args.captions
    t = time.perf_counter()
    base = baseline_t2i(images.double(), [w.double() for w in words[:nb]], 9.0, 6.0)
    base_s = time.perf_counter() - t
    base_rate = args.images * nb / base_s

    def score(imgs, caps, dtype):
        return xattn_scores(imgs["regions"], imgs["mask"], caps["words"], caps["mask"], "t2i", dtype=dtype)

    for precision in args.precision.split(","):
        emb = torch.float64 if precision == "float64" else torch.float32
        img = {"regions": images.to(emb), "mask": torch.ones(args.images, args.regions, dtype=torch.bool)}
        order = np.argsort(lengths.numpy(), kind="stable")
        blocks = []
        for s in range(0, args.captions, 128):
            idx = order[s:s + 128]
            length = int(lengths[idx].max())
            w = torch.zeros(len(idx), length, args.dim, dtype=emb)
            for row, m in enumerate(idx):
                w[row, :lengths[m]] = words[m].to(emb)
            blocks.append((idx, {"words": w, "mask": torch.arange(length) < lengths[idx].view(-1, 1)}))
        t = time.perf_counter()
        sims = score_blocks(lambda a, b: score(a, b, torch.float64), img, blocks, args.images, args.captions)
        fast_s = time.perf_counter() - t
        fast_rate = pairs / fast_s
        sub = sims[:, :nb]
        same_t2i = float(np.mean([(np.argsort(-sub[:, c], kind="stable") == np.argsort(-base[:, c], kind="stable")).all()
                                  for c in range(nb)]))
        same_i2t = float(np.mean([(np.argsort(-sub[i], kind="stable") == np.argsort(-base[i], kind="stable")).all()
                                  for i in range(args.images)]))
        print(json.dumps({"bench": "eval_scan_t2i", "precision": precision, "images": args.images,
                          "captions": args.captions, "regions": args.regions, "dim": args.dim,
                          "retr_seconds": round(fast_s, 2), "retr_pairs_per_s": round(fast_rate),
                          "baseline": "authors' shard_xattn_t2i (128-image blocks, one caption at a time, float64)",
                          "baseline_captions": nb, "baseline_seconds": round(base_s, 2),
                          "baseline_pairs_per_s": round(base_rate), "speedup": round(fast_rate / base_rate, 2),
                          "max_abs_diff": float(np.abs(sub - base).max()),
                          "identical_image_rankings": same_t2i, "identical_caption_rankings": same_i2t}))
    print(json.dumps({"bench": "eval_peak_memory", "max_rss_mb": round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))


if __name__ == "__main__":
    main()
