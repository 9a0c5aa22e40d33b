"""Throughput of the referral-tree stage on the synthetic dataset's CoNLL-U (captions per second).

Generates a synthetic dataset (``--images`` × 5 captions) into a temporary folder, then measures in one run:

* ``baseline-conll2doc`` — stanza's CoNLL-U reader on the whole file at once (the floor: reading the parses,
  no matching, no trees);
* ``conllu-backend``     — :class:`ConlluBackend` in batches of ``--batch`` (indexed seek reads, key
  matching, caption-text check with NLTK's tokenizer, stanza's reader per batch);
* ``conllu-backend-no-text-check`` — the same without the text check;
* ``tree-rules``         — :class:`TreeBuilder` alone over already-read sentences;
* ``parse-trees-stage``  — :func:`run_parse_trees` end to end (shards, dictionaries, ``trees.h5``).

Prints one JSON line per result, each with the baseline's rate from the same run.

    .venv/bin/python bench/parse_trees.py [--images 2000] [--batch 64]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from stanza.utils.conll import CoNLL

from retr.manifests.synthetic import generate_synthetic
from retr.parsers.backends import ConlluBackend
from retr.parsers.referral_tree import TreeBuilder
from retr.pipeline.parse_trees import caption_items, run_parse_trees
from retr.manifests.schema import read_manifest


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "synth"
        generate_synthetic(folder, num_images=args.images, seed=0)
        conllu, manifest = folder / "captions.conllu", folder / "manifest.jsonl"
        items, _ = caption_items(read_manifest(manifest))
        n = len(items)

        sentences, base_s = timed(lambda: CoNLL.conll2doc(input_str=conllu.read_text()).sentences)
        baseline = n / base_s

        def report(what: str, seconds: float, **extra) -> None:
            print(json.dumps({"bench": "parse-trees", "what": what, "captions": n, "seconds": round(seconds, 3),
                              "captions_per_s": round(n / seconds, 1), "baseline": "baseline-conll2doc",
                              "baseline_captions_per_s": round(baseline, 1),
                              "vs_baseline": round((n / seconds) / baseline, 3), **extra}), flush=True)

        report("baseline-conll2doc", base_s)
        for check in (True, False):
            backend = ConlluBackend(conllu, check_text=check)

            def parse_all(backend=backend):
                out = []
                for i in range(0, n, args.batch):
                    out.extend(backend.parse(items[i:i + args.batch]))
                return out

            outcomes, seconds = timed(parse_all)
            assert all(o.sentence is not None for o in outcomes)
            report("conllu-backend" if check else "conllu-backend-no-text-check", seconds, batch=args.batch)
        builder = TreeBuilder()
        _, seconds = timed(lambda: [builder.build(s) for s in sentences])
        report("tree-rules", seconds)
        summary, seconds = timed(lambda: run_parse_trees(manifest, Path(tmp) / "trees.h5", ConlluBackend(conllu),
                                                         batch_size=args.batch))
        assert summary.trees == n
        report("parse-trees-stage", seconds, batch=args.batch)


if __name__ == "__main__":
    main()
