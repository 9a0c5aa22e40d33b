"""Benchmark: query latency and memory of search at 10k, 100k and 1M gallery items, each index kind against
brute force timed in the same run.

**Inner-product models** (VSE++, SMFEA, JGCAR's global stage): synthetic unit embeddings, ``--dim`` 1024
float32, clustered as real embeddings are (``--per-cluster`` items around each random centre, noise of norm
``--spread``), queries near gallery items (a caption near its image). Per size, one query at a time, each mode
against the baseline ``brute`` (``torch`` matrix–vector product over the gallery and ``topk``), the two run in
turn on every query so that both see the same load (the machine may be shared):

* ``exact`` — :class:`~retr.trainers.search.vector_index.InnerProductIndex` (faiss ``IndexFlatIP``), and
  ``exact-matmul``, its fallback without faiss: top k checked identical to brute force (ids in order);
* ``ivf`` (each ``--nprobe``) and ``hnsw`` (each ``--ef-search``): recall@1/5/10 against brute force's top k.

Latency p50/p95 over ``--queries`` queries (after one warm-up query), build seconds, the index's memory (resident
set growth while it is built, MiB) and the process's peak.

**Cross attention** (``--scan-sizes``): SCAN t-i (random weights, d 1024, 36 regions, captions of 3–12 words,
synthetic region/word vectors around per-image topics) — the exhaustive pass (``score`` over the whole gallery,
blocks of 256 images) against two-stage search (``--shortlist`` by mean-pooled vectors, then ``score``):
latency, the gallery's memory, and two-stage recall@k against the exhaustive top k.

One JSON line per result.

    python bench/search.py --sizes 10000,100000 --threads 1      # every mode; SCAN at 1k and 10k
    python bench/search.py --sizes 1000000 --modes exact,ivf --nprobe 16,64,256 --scan-sizes "" --threads 1
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import time

import numpy as np
import torch

from retr.trainers.models import create_model
from retr.trainers.search.two_stage import TwoStageSearch
from retr.trainers.search.vector_index import InnerProductIndex, recall_at_k


def rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def peak_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)   # Linux reports KiB


def around(centres, rows: int, spread: float, g: torch.Generator, block: int = 1 << 16) -> torch.Tensor:
    """``[rows, d]`` unit vectors, row r near ``centres(r0, r1)[r - r0]`` (noise of norm ≈ ``spread``), filled in
    place block by block (no second copy of a large gallery)."""
    probe = centres(0, 1)
    out = torch.empty(rows, probe.shape[1])
    for s in range(0, rows, block):
        part = out[s:s + block]
        torch.randn(part.shape, generator=g, out=part).mul_(spread / probe.shape[1] ** 0.5)
        part.add_(centres(s, s + len(part)))
        part.div_(part.norm(dim=1, keepdim=True))
    return out


def clustered(n: int, dim: int, per_cluster: int, spread: float, g: torch.Generator) -> torch.Tensor:
    """``[n, dim]`` unit vectors around ``n / per_cluster`` random centres."""
    centres = torch.nn.functional.normalize(torch.randn(max(1, n // per_cluster), dim, generator=g), dim=1)
    return around(lambda a, b: centres[torch.arange(a, b) % len(centres)], n, spread, g)


def timed(fns: dict, queries) -> tuple[dict, dict]:
    """Results of each ``fn(query [1, d])`` per query, and each one's p50/p95 latency in ms. The functions run
    in turn on each query (one warm-up call each first), so a mode and its baseline see the same load."""
    out, ms = {n: [] for n in fns}, {n: [] for n in fns}
    for fn in fns.values():
        fn(queries[:1])
    for q in range(len(queries)):
        for name, fn in fns.items():
            t = time.perf_counter()
            out[name].append(fn(queries[q:q + 1]))
            ms[name].append(1e3 * (time.perf_counter() - t))
    return out, {n: {"p50_ms": round(float(np.percentile(v, 50)), 3), "p95_ms": round(float(np.percentile(v, 95)), 3)}
                 for n, v in ms.items()}


def vector_rows(args, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    gallery = clustered(n, args.dim, args.per_cluster, args.spread, g)
    picked = gallery[torch.randint(0, n, (args.queries,), generator=g)]
    queries = around(lambda a, b: picked[a:b], args.queries, args.spread, g)
    common = {"bench": "search", "items": n, "dim": args.dim, "queries": args.queries, "k": args.k,
              "threads": args.threads}

    def brute(q):
        return torch.topk(gallery @ q[0], args.k)
    first = [brute(queries[q:q + 1]) for q in range(len(queries))]
    truth, truth_scores = (np.stack([getattr(b, a).numpy() for b in first]) for a in ("indices", "values"))
    settings = [("exact", {}), ("exact-matmul", {"use_faiss": False})]
    settings += [("ivf", {"kind": "ivf", "nprobe": p}) for p in args.nprobe]
    settings += [("hnsw", {"kind": "hnsw", "ef_search": e, "m": args.m}) for e in args.ef_search]
    index, built = None, None
    for mode, options in settings:
        if mode not in args.modes:
            continue
        if built != mode:                              # one index per kind; search settings change in place
            index = None
            gc.collect()
            before, t = rss_mb(), time.perf_counter()
            index = InnerProductIndex(gallery, **options)
            build = {"build_s": round(time.perf_counter() - t, 2), "index_mb": round(rss_mb() - before)}
            built = mode
        else:
            index.tune(options.get("nprobe"), options.get("ef_search"))
        found, lat = timed({"mode": lambda q: index.search(q.numpy(), args.k), "brute": brute}, queries)
        ids = np.stack([f[1][0] for f in found["mode"]])
        scores = np.stack([f[0][0] for f in found["mode"]])
        row = {**common, "mode": mode, **index.settings, **lat["mode"], **build,
               "speedup_p50": round(lat["brute"]["p50_ms"] / lat["mode"]["p50_ms"], 2),
               "baseline": "torch matmul + topk", **{f"baseline_{k}": v for k, v in lat["brute"].items()},
               "gallery_mb": round(gallery.numel() * 4 / 2 ** 20)}
        if mode.startswith("exact"):
            same = (ids == truth).all(1)
            row["identical_topk"] = float(same.mean())
            row["max_score_diff"] = float(np.abs(scores - truth_scores).max())
        else:
            row.update({f"recall@{k}": round(recall_at_k(ids, truth, k), 4) for k in (1, 5, 10) if k <= args.k})
        row["peak_mb"] = peak_mb()
        print(json.dumps(row), flush=True)


def scan_rows(args, n: int) -> None:
    """SCAN's exhaustive pass against two-stage search over ``n`` synthetic images."""
    g = torch.Generator().manual_seed(n)
    model = create_model("scan", vocab_size=8, img_dim=8, embed_size=args.dim, word_dim=8, direction="t2i",
                         agg="lse").eval()
    before = rss_mb()
    topics = clustered(n, args.dim, args.per_cluster, args.spread, g)
    regions = around(lambda a, b: topics[torch.arange(a, b) // args.regions], n * args.regions, args.spread, g)
    regions = regions.view(n, args.regions, args.dim)         # each image's regions around its topic
    images = {"regions": regions, "mask": torch.ones(n, args.regions, dtype=torch.bool)}
    gallery_mb = round(rss_mb() - before)
    owners = torch.randint(0, n, (args.scan_queries,), generator=g)
    length = 12
    words = around(lambda a, b: topics[owners[torch.arange(a, b) // length]], len(owners) * length, args.spread, g)
    lengths = torch.randint(3, length + 1, (args.scan_queries,), generator=g)
    mask = torch.arange(length) < lengths[:, None]
    captions = {"words": words.view(len(owners), length, args.dim) * mask[..., None], "mask": mask}
    common = {"bench": "search_scan", "images": n, "regions": args.regions, "dim": args.dim,
              "queries": args.scan_queries, "k": args.k, "threads": args.threads, "gallery_mb": gallery_mb}
    t = time.perf_counter()
    search = TwoStageSearch(model, images, "image", shortlist=args.shortlist)
    build = {"build_s": round(time.perf_counter() - t, 2)}

    def query(q):
        return {k: v[q] for k, v in captions.items()}
    found, lat = timed({"two-stage": lambda q: search.search(query(q), args.k)[1],
                        "exhaustive": lambda q: search.exhaustive(query(q), args.k)[1]}, torch.arange(args.scan_queries))
    exhaustive, found, base = found["exhaustive"], found["two-stage"], lat["exhaustive"]
    row = {**common, "mode": "exhaustive", **base, "baseline": "SCAN score over the whole gallery"}
    print(json.dumps(row), flush=True)
    truth, ids = np.concatenate(exhaustive), np.concatenate(found)
    two = {**common, "mode": "two-stage", "shortlist": args.shortlist, **lat["two-stage"], **build,
           "shortlist_index_mb": round(n * args.dim * 4 / 2 ** 20, 1),
           **{f"recall@{k}": round(recall_at_k(ids, truth, k), 4) for k in (1, 5, 10) if k <= args.k},
           "speedup_p50": round(base["p50_ms"] / lat["two-stage"]["p50_ms"], 1), "baseline_p50_ms": base["p50_ms"],
           "baseline_p95_ms": base["p95_ms"], "peak_mb": peak_mb()}
    print(json.dumps(two), flush=True)


def main() -> None:
    ints = lambda text: [int(x) for x in text.split(",") if x]    # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=ints, default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--per-cluster", type=int, default=10, help="gallery items per synthetic cluster")
    parser.add_argument("--spread", type=float, default=1.0, help="noise norm around a centre / item (unit: 1)")
    parser.add_argument("--modes", default="exact,exact-matmul,ivf,hnsw")
    parser.add_argument("--nprobe", type=ints, default=[16, 64], help="ivf lists probed (one row each)")
    parser.add_argument("--ef-search", type=ints, default=[64, 256], help="hnsw search breadth (one row each)")
    parser.add_argument("--m", type=int, default=32, help="hnsw links per node")
    parser.add_argument("--scan-sizes", type=ints, default=[1000, 10_000])
    parser.add_argument("--scan-queries", type=int, default=10)
    parser.add_argument("--regions", type=int, default=36)
    parser.add_argument("--shortlist", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        import faiss
        faiss.omp_set_num_threads(args.threads)
    except ImportError:
        args.modes = "exact-matmul"
    args.modes = args.modes.split(",")
    for n in args.sizes:
        vector_rows(args, n)
        gc.collect()
    for n in args.scan_sizes:
        scan_rows(args, n)
        gc.collect()


if __name__ == "__main__":
    main()
