"""Benchmark: SCAN similarity matrix, retr's evaluator vs the authors' way of computing it.

Data: 1,000 images × 5,000 captions (default), 36 regions, d = 1024, captions of 3–12 words; random unit
vectors (the cost does not depend on the values). Both sides score the same embeddings with t-i LSE
(λ_softmax 9, λ_lse 6, clipped_l2norm), or with ``--direction i2t`` i-t LSE (λ_softmax 4, λ_lse 20).

* ``retr``: the evaluator as ``retr-train eval`` runs it — :func:`retr.trainers.evaluation.similarity.combined_matrix`
  over a real SCAN model's ``score``: length-sorted caption blocks × image blocks, one GEMM per chunk for the
  region–word dot products, attended vectors never formed (Gram matrices), at each ``--precision``
  (``refined``: float32, then float64 for every near-tie; ``float32``; ``float64``).
* ``baseline``: the authors' public evaluation (``shard_xattn_t2i``/``_i2t`` + ``xattn_score_*``): blocks of 128
  images, one caption at a time, attended vectors formed, float64.

The baseline takes ~6 min on a 2-core CPU for the full matrix; ``--baseline-captions N`` times it on the first
N captions (all images) instead, and the comparison uses those columns. With caption ``c`` belonging to image
``c // 5``, it reports the fraction of queries whose rank (what the metrics are made of) is identical — each of
those captions' rank of its image among all images, each of their images' rank of its best caption among those
captions — and, for information, the fraction of full orderings (every image for a caption, every caption for
an image) that are identical. One JSON line per precision, each with the baseline of the same run; then, over
the whole matrix, the ranks of each faster precision against retr's own float64 matrix; peak memory
(ru_maxrss) at the end.

    python bench/eval.py --baseline-captions 200
"""
from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np
import torch

from retr.trainers.evaluation.metrics import i2t_ranks, t2i_ranks
from retr.trainers.models import create_model
from retr.trainers.evaluation.similarity import PRECISIONS, Scorer, SplitEmbeddings, combined_matrix


def baseline(images: torch.Tensor, captions: list[torch.Tensor], direction: str, lsm: float, lse: float,
             shard: int = 128) -> np.ndarray:
    """The authors' arithmetic: per caption, per block of 128 images, attended vectors formed (float64).

    ``func_attention(query, context)`` as in their code: t-i has query = words, context = regions; i-t the
    reverse. LogSumExp without max-subtraction, cosine clamped at 1e-8.
    """
    n_img = images.shape[0]
    sims = np.zeros((n_img, len(captions)))
    for c, cap in enumerate(captions):
        for start in range(0, n_img, shard):
            img = images[start:start + shard]                                  # [b, K, d]
            words = cap.unsqueeze(0).expand(img.shape[0], -1, -1)              # [b, L, d]
            query, context = (words, img) if direction == "t2i" else (img, words)
            attn = torch.bmm(context, query.transpose(1, 2))                   # [b, n_context, n_query]
            attn = torch.nn.functional.leaky_relu(attn, 0.1)
            attn = attn / (attn.pow(2).sum(2, keepdim=True).sqrt() + 1e-8)     # l2 over the query axis
            attn = torch.softmax(attn.transpose(1, 2) * lsm, dim=2)            # [b, n_query, n_context]
            attended = torch.bmm(attn, context)                                # [b, n_query, d]
            w12 = (query * attended).sum(2)
            row = w12 / (query.norm(dim=2) * attended.norm(dim=2)).clamp(min=1e-8)
            row = torch.log(torch.exp(row * lse).sum(1)) / lse
            sims[start:start + img.shape[0], c] = row.cpu().numpy()
    return sims


def embeddings(images: torch.Tensor, words: list[torch.Tensor], block: int = 128) -> SplitEmbeddings:
    """What the SCAN encoders would hand the evaluator: regions, and captions in length-sorted blocks."""
    lengths = np.array([len(w) for w in words])
    order = np.argsort(lengths, kind="stable")
    blocks = []
    for s in range(0, len(words), block):
        idx = order[s:s + block]
        length = int(lengths[idx].max())
        padded = torch.zeros(len(idx), length, images.shape[-1])
        for row, m in enumerate(idx):
            padded[row, :lengths[m]] = words[m]
        blocks.append((idx, {"words": padded, "mask": torch.arange(length) < torch.as_tensor(lengths[idx])[:, None]}))
    return SplitEmbeddings({"regions": images, "mask": torch.ones(images.shape[:2], dtype=torch.bool)}, blocks)


def same_rankings(a: np.ndarray, b: np.ndarray, axis: int) -> float:
    """Fraction of columns (axis 0) or rows (axis 1) whose full descending order is identical in a and b."""
    return float(np.mean((np.argsort(-a, axis=axis, kind="stable") == np.argsort(-b, axis=axis, kind="stable"))
                         .all(axis=axis)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--captions", type=int, default=5000)
    parser.add_argument("--regions", type=int, default=36)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--baseline-captions", type=int, default=None, help="time the baseline on N captions")
    parser.add_argument("--precision", default=",".join(PRECISIONS), help="comma-separated; of " + ", ".join(PRECISIONS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--direction", choices=("t2i", "i2t"), default="t2i",
                        help="t-i (λ_softmax 9, λ_lse 6) or i-t (λ_softmax 4, λ_lse 20: SCAN's COCO i-t LSE)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    norm = torch.nn.functional.normalize
    images = norm(torch.randn(args.images, args.regions, args.dim, generator=g), dim=-1)
    lengths = torch.randint(3, 13, (args.captions,), generator=g)
    words = [norm(torch.randn(int(n), args.dim, generator=g), dim=-1) for n in lengths]
    pairs = args.images * args.captions
    nb = min(args.baseline_captions or args.captions, args.captions)
    t = time.perf_counter()
    lsm, lse = (9.0, 6.0) if args.direction == "t2i" else (4.0, 20.0)
    base = baseline(images.double(), [w.double() for w in words[:nb]], args.direction, lsm, lse)   # [N_img, nb]
    base_s = time.perf_counter() - t
    base_rate = args.images * nb / base_s
    owner = np.arange(args.captions) * args.images // args.captions       # caption → its image (c // 5 here)
    owned = int(owner[nb - 1]) + 1                                         # images owning a baseline caption

    def ranks(sims: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return t2i_ranks(sims[:, :nb], owner[:nb]), i2t_ranks(sims[:owned, :nb], owner[:nb])
    base_t2i, base_i2t = ranks(base)

    model = create_model("scan", vocab_size=8, img_dim=8, embed_size=args.dim, word_dim=8,
                         direction=args.direction, lambda_softmax=lsm, lambda_lse=lse).eval()
    scorer = Scorer(model, embeddings(images, words))
    all_ranks = {}
    for precision in args.precision.split(","):
        stats: dict = {}
        t = time.perf_counter()
        sims = combined_matrix([scorer], precision, owner, stats=stats)
        fast_s = time.perf_counter() - t
        fast_rate = pairs / fast_s
        sub = sims[:, :nb]
        got_t2i, got_i2t = ranks(sims)
        all_ranks[precision] = (t2i_ranks(sims, owner), i2t_ranks(sims, owner))
        print(json.dumps({
            "bench": f"eval_scan_{args.direction}", "precision": precision, "images": args.images, "captions": args.captions,
            "regions": args.regions, "dim": args.dim, "threads": args.threads,
            "retr_seconds": round(fast_s, 2), "retr_pairs_per_s": round(fast_rate),
            "baseline": f"authors' shard_xattn_{args.direction} (128-image blocks, one caption at a time, float64)",
            "baseline_captions": nb, "baseline_seconds": round(base_s, 2),
            "baseline_pairs_per_s": round(base_rate), "speedup": round(fast_rate / base_rate, 2),
            "max_abs_diff": float(np.abs(sub - base).max()),
            "identical_t2i_ranks": float(np.mean(got_t2i == base_t2i)),
            "identical_i2t_ranks": float(np.mean(got_i2t == base_i2t)),
            "identical_full_image_orderings": same_rankings(sub, base, 0),
            "identical_full_caption_orderings": same_rankings(sub, base, 1),
            **({"rescored_fraction": round(stats["rescored_fraction"], 4), "margin": stats["margin"],
                "refine_rounds": stats["rounds"]} if stats else {})}))
    if "float64" in all_ranks:      # the whole matrix against retr's own float64 one (≡ the baseline's above)
        want_t2i, want_i2t = all_ranks["float64"]
        for precision, (t2i, i2t) in all_ranks.items():
            if precision != "float64":
                print(json.dumps({"bench": "eval_ranks_vs_float64", "direction": args.direction, "precision": precision,
                                  "captions": args.captions, "images": args.images,
                                  "identical_t2i_ranks": float(np.mean(t2i == want_t2i)),
                                  "identical_i2t_ranks": float(np.mean(i2t == want_i2t))}))
    print(json.dumps({"bench": "eval_peak_memory", "max_rss_mb": round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))


if __name__ == "__main__":
    main()
