"""How many intra-modal negatives each Flickr30K label reading leaves JGCAR's J2/J3.

JGCAR's intra-modal triplets (Eq. 7–8) take as negatives the batch items that share *no* label with the anchor
(§3.1: "instances with no identical label"). A label that nearly every image has leaves almost no negative.
This measures, for each reading of "object labels from the bounding box annotation" of Flickr30K Entities:

* ``types``        — the 8 coarse entity types (people, clothing, bodyparts, …; the old default);
* ``heads``        — the lower-case, singular head noun of every phrase (``retr-pipeline labels f30k-entities``'s
  default; ``[/EN#18/people A man]`` → man, "a group of young men" → man);
* ``heads-raw``    — the same heads lower-cased only (men ≠ man);
* ``chain-heads``  — one label per coreference chain (= per annotated entity): the most frequent head of its
  phrases (ties: the first mentioned);
* ``heads-2sent``  — heads found in at least 2 of the image's 5 sentences (a consensus);

each over all phrases (``notvisual`` left out) and, ``/boxed``, over the phrases of chains that have a bounding box
in ``Annotations/<id>.xml`` (``--annotations``).

Images: the real release when given (``--sentences Flickr30kEntities/Sentences --annotations
Flickr30kEntities/Annotations``), else ``--images`` images of Entities-format files written by
``tests/f30k_entities_synth.py`` (a stand-in with the release's rough shape; see that module) in a
temporary folder.

Per reading, one JSON line: mean labels per image, vocabulary size, images without a label, the fraction of all
pairs of distinct images that share no label (``pairs_no_shared_label``), and over ``--batches`` random training
batches of ``--batch`` caption rows (JGCAR's batch of 200; captions carry their image's labels, rows of one image
are positives): the fraction of row pairs of different images that are negatives (``batch_negative_fraction``),
negatives per anchor, and the share of anchors with at least one negative / one positive / both (an anchor
without both has no triplet). A first line (``"reading": "dataset"``) describes the images.

    .venv/bin/python bench/f30k_labels.py [--images 3000] [--batch 200] [--batches 200] [--seed 0] [--extra-chains 1]
    .venv/bin/python bench/f30k_labels.py --sentences Flickr30kEntities/Sentences \\
        --annotations Flickr30kEntities/Annotations [--limit 29783]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from retr.manifests.dataset_labels import (F30K_NOT_LABELS, EntityPhrase, boxed_chains, entity_labels, entity_phrases,
                                           phrase_head)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from f30k_entities_synth import write_entities_files  # noqa: E402  (the tests' stand-in files, not in the wheel)

READINGS = ("types", "heads", "heads-raw", "chain-heads", "heads-2sent")


def read_images(sentences: Path, annotations: Path | None, stems: list[str]) \
        -> list[tuple[list[list[EntityPhrase]], set[int] | None]]:
    """Per image: its phrases per sentence, and its boxed chains (None without ``annotations``)."""
    out = []
    for stem in stems:
        path = sentences / f"{stem}.txt"
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        per_sentence = [entity_phrases(line, f"{path}:{n}") for n, line in enumerate(lines, 1)]
        boxed = boxed_chains(annotations / f"{stem}.xml") if annotations is not None else None
        out.append((per_sentence, boxed))
    return out


def labels_of(per_sentence: list[list[EntityPhrase]], boxed: set[int] | None, reading: str) -> list[str]:
    keep = [[p for p in s if (boxed is None or p.chain in boxed)
             and not any(t in F30K_NOT_LABELS for t in p.types)] for s in per_sentence]
    flat = [p for s in keep for p in s]
    if reading in ("types", "heads"):
        return entity_labels(flat, reading)
    if reading == "heads-raw":
        return sorted({h for p in flat if (h := phrase_head(p.words, lemma=False))})
    if reading == "chain-heads":
        chains: dict[int, Counter] = {}
        for p in flat:
            if (h := phrase_head(p.words)) is not None:
                chains.setdefault(p.chain, Counter())[h] += 1
        return sorted({c.most_common(1)[0][0] for c in chains.values()})
    if reading == "heads-2sent":
        counts = Counter(h for s in keep for h in {phrase_head(p.words) for p in s} if h)
        return sorted(h for h, n in counts.items() if n >= 2)
    raise ValueError(reading)


def multihot(label_sets: list[list[str]]) -> np.ndarray:
    names = {x: i for i, x in enumerate(sorted({x for s in label_sets for x in s}))}
    m = np.zeros((len(label_sets), max(1, len(names))), dtype=np.float32)
    for row, s in enumerate(label_sets):
        m[row, [names[x] for x in s]] = 1.0
    return m


def measure(label_sets: list[list[str]], captions_per_image: list[int], batch: int, batches: int,
            rng: np.random.Generator) -> dict:
    m = multihot(label_sets)
    shared = (m @ m.T) > 0                                   # [N, N] images share a label
    n = len(label_sets)
    off = ~np.eye(n, dtype=bool)
    pairs_no_shared = float((~shared & off).sum() / off.sum())
    owner = np.repeat(np.arange(n), captions_per_image)     # caption row → image
    neg_frac, negs, with_neg, with_pos, with_both = [], [], [], [], []
    for _ in range(batches):
        rows = owner[rng.choice(len(owner), size=min(batch, len(owner)), replace=False)]
        same = rows[:, None] == rows[None, :]
        eye = np.eye(len(rows), dtype=bool)
        share = shared[np.ix_(rows, rows)]
        positive = (same | share) & ~eye
        negative = ~same & ~share
        other_image = ~same
        neg_frac.append(negative.sum() / max(1, other_image.sum()))
        per_anchor = negative.sum(1)
        negs.append(per_anchor.mean())
        with_neg.append((per_anchor > 0).mean())
        with_pos.append((positive.sum(1) > 0).mean())
        with_both.append(((per_anchor > 0) & (positive.sum(1) > 0)).mean())
    sizes = [len(s) for s in label_sets]
    return {"labels_per_image": round(float(np.mean(sizes)), 2), "vocabulary": int(m.shape[1]) if any(sizes) else 0,
            "images_without_labels": int(sum(1 for s in sizes if s == 0)),
            "pairs_no_shared_label": round(pairs_no_shared, 4),
            "batch_negative_fraction": round(float(np.mean(neg_frac)), 4),
            "negatives_per_anchor": round(float(np.mean(negs)), 1),
            "anchors_with_negative": round(float(np.mean(with_neg)), 4),
            "anchors_with_positive": round(float(np.mean(with_pos)), 4),
            "anchors_with_triplets": round(float(np.mean(with_both)), 4)}


def describe(images, stems: list[str], source: str) -> dict:
    n = len(images)
    chains, phrases, types, heads = [], [], Counter(), Counter()
    for per_sentence, _ in images:
        flat = [p for s in per_sentence for p in s]
        chains.append(len({p.chain for p in flat if p.chain}))
        phrases.append(len(flat))
        types.update({t for p in flat for t in p.types})
        heads.update(entity_labels(flat, "heads"))
    return {"reading": "dataset", "source": source, "images": n, "chains_per_image": round(float(np.mean(chains)), 2),
            "phrases_per_image": round(float(np.mean(phrases)), 2),
            "images_with_type": {t: round(c / n, 3) for t, c in types.most_common()},
            "images_with_head": {h: round(c / n, 3) for h, c in heads.most_common(12)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=3000, help="images to generate (no --sentences)")
    parser.add_argument("--extra-chains", type=float, default=1.0,
                        help="generated images: scale the chains beyond the first of each type (busier pictures)")
    parser.add_argument("--sentences", type=Path, help="a Flickr30K Entities Sentences folder (the real release)")
    parser.add_argument("--annotations", type=Path, help="its Annotations folder (for the /boxed readings)")
    parser.add_argument("--limit", type=int, default=0, help="read at most this many images (sorted by name)")
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.sentences is None:
            stems = write_entities_files(tmp, args.images, seed=args.seed, extra_chains=args.extra_chains)
            sentences, annotations = Path(tmp) / "Sentences", Path(tmp) / "Annotations"
            source = f"tests/f30k_entities_synth.py seed {args.seed}, extra_chains {args.extra_chains}"
        else:
            sentences, annotations = args.sentences, args.annotations
            stems = sorted(p.stem for p in sentences.glob("*.txt"))
            stems = stems[:args.limit] if args.limit else stems
            source = str(sentences)
        images = read_images(sentences, annotations, stems)
    print(json.dumps(describe(images, stems, source)), flush=True)
    captions = [len(s) for s, _ in images]
    for boxed_only in ((False, True) if annotations is not None else (False,)):
        for reading in READINGS:
            sets = [labels_of(s, boxed if boxed_only else None, reading) for s, boxed in images]
            rng = np.random.default_rng(args.seed)
            row = {"reading": reading + ("/boxed" if boxed_only else ""), "images": len(images),
                   "batch": args.batch, "batches": args.batches}
            row.update(measure(sets, captions, args.batch, args.batches, rng))
            print(json.dumps(row), flush=True)
    print(json.dumps({"reading": "done", "seconds": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
