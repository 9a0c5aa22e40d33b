"""Throughput of the referral-tree stage on the synthetic dataset's CoNLL-U (captions per second).

Generates a synthetic dataset (``--images`` × 5 captions) into a temporary folder, then measures in one run:

* ``baseline-conll2doc`` — stanza's CoNLL-U reader on the whole file at once (the floor: reading the parses,
  no matching, no trees; skipped without stanza);
* ``conllu-reader``      — retr's reader (:func:`retr.store.conllu.parse_conllu`) on the whole file at once;
* ``conllu-backend``     — :class:`ConlluBackend` in batches of ``--batch`` (indexed seek reads, key
  matching, caption-text check with NLTK's tokenizer, retr's reader per batch);
* ``conllu-backend-no-text-check`` — the same without the text check;
* ``tree-rules``         — :class:`TreeBuilder` alone over already-read sentences;
* ``parse-trees-stage``  — :func:`run_parse_trees` end to end (shards, dictionaries, ``trees.h5``).

Label schemes, each line with its own baseline from the same run. The synthetic UD v2 file is
rewritten into UD v1 and into Stanford basic dependencies (:func:`to_ud1`, :func:`to_sd`: the inverse of
:mod:`retr.parsers.schemes` for the constructions the synthetic captions use: obl, nsubj:pass, aux:pass,
case, a copula with a prepositional predicate, relative clauses):

* ``conllu-index`` vs ``conllu-index-no-detection`` — indexing the file while counting labels, or not;
* ``convert-ud2`` / ``convert-ud1`` / ``convert-sd`` vs ``tree-rules`` — :func:`to_ud2` alone over read
  sentences (ud2: the label check only);
* ``parse-trees-stage`` (the UD v2 file, its scheme detected) / ``-ud1`` / ``-sd`` vs
  ``parse-trees-stage-without-schemes`` (the UD v2 file read as before label schemes: no label counting, no check,
  no conversion) — the stage end to end; ``trees_equal`` says whether the trees equal the baseline's.

Each timing is the best of ``--repeat`` runs (the stage variants in turns). Prints one JSON line per result.

    .venv/bin/python bench/parse_trees.py [--images 2000] [--batch 64] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from retr.manifests.synthetic import generate_synthetic
from retr.parsers.backends import ConlluBackend
from retr.parsers.referral_tree import TreeBuilder
from retr.parsers.schemes import SchemeConverter
from retr.pipeline.parse_trees import caption_items, run_parse_trees
from retr.manifests.schema import read_manifest
from retr.store.conllu import parse_conllu
from retr.store.trees import read_trees

REPEAT = 1


def timed(fn):
    """``(result, best seconds of REPEAT runs)``."""
    best, result = None, None
    for _ in range(REPEAT):
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
        best = seconds if best is None else min(best, seconds)
    return result, best


# ---------------------------------------------------------------------------------------------------------
# UD v2 → UD v1 / Stanford basic dependencies, for the constructions of the synthetic captions

_V1 = {"obj": "dobj", "nsubj:pass": "nsubjpass", "aux:pass": "auxpass", "fixed": "mwe", "flat": "name"}
_SD = {**_V1, "nummod": "num", "compound": "nn", "acl:relcl": "rcmod", "acl": "vmod", "nmod:poss": "poss",
       "compound:prt": "prt", "det:predet": "predet", "obl:tmod": "tmod", "obl:npmod": "npadvmod"}
_CLAUSE = ("nsubj", "nsubj:pass", "aux", "aux:pass", "mark", "advmod", "punct", "expl", "obl", "cc", "conj")


def _blocks(text: str):
    for block in text.strip().split("\n\n"):
        lines = block.splitlines()
        yield [l for l in lines if l.startswith("#")], [l.split("\t") for l in lines if not l.startswith("#")]


def _join(comments, rows) -> str:
    return "\n".join(comments + ["\t".join(r) for r in rows]) + "\n\n"


def to_ud1(text: str) -> str:
    """UD v2 CoNLL-U → UD v1: v1 labels, ``obl`` → ``nmod``."""
    out = []
    for comments, rows in _blocks(text):
        for r in rows:
            base, _, sub = r[7].partition(":")
            r[7] = _V1.get(r[7], ("nmod" + (f":{sub}" if sub else "")) if base == "obl" else r[7])
        out.append(_join(comments, rows))
    return "".join(out)


def to_sd(text: str) -> str:
    """UD v2 CoNLL-U → Stanford basic: prepositions head their objects (``prep``/``pobj``), "be" heads a
    clause with a prepositional predicate, SD labels."""
    out = []
    for comments, rows in _blocks(text):
        by_id = {r[0]: r for r in rows}
        for noun in rows:  # copula with a prepositional predicate: "be" heads the clause
            kids = [r for r in rows if r[6] == noun[0]]
            cop = next((r for r in kids if r[7] == "cop"), None)
            if cop is not None and any(r[7] == "case" and r[4] != "POS" for r in kids):
                cop[6], cop[7] = noun[6], noun[7]
                for r in kids:
                    if r[7] in _CLAUSE:
                        r[6] = cop[0]
                noun[6], noun[7] = cop[0], "obl"
        for case in rows:  # the preposition heads its object
            if case[7] == "case" and case[4] != "POS":
                noun = by_id[case[6]]
                case[6], case[7] = noun[6], "prep"
                noun[6], noun[7] = case[0], "pobj"
        for r in rows:
            if r[7] == "case":
                r[7] = "possessive"
            elif r[7] == "mark" and r[4] == "TO":
                r[7] = "aux"
            else:
                r[7] = _SD.get(r[7], r[7])
        out.append(_join(comments, rows))
    return "".join(out)


class _AsBefore(ConlluBackend):
    """The CoNLL-U backend as it was before label schemes: no label counting while indexing, and no scheme to
    detect (read as UD v2 and trusted, like stanza's output), so nothing is checked or converted."""

    def __init__(self, path):
        super().__init__(path, detect=False)

    def detect_scheme(self):
        return None


def main() -> None:
    global REPEAT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs per timing")
    args = parser.parse_args()
    REPEAT = max(1, args.repeat)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "synth"
        generate_synthetic(folder, num_images=args.images, seed=0)
        conllu, manifest = folder / "captions.conllu", folder / "manifest.jsonl"
        files = {"ud2": conllu, "ud1": folder / "captions.ud1.conllu", "sd": folder / "captions.sd.conllu"}
        files["ud1"].write_text(to_ud1(conllu.read_text()))
        files["sd"].write_text(to_sd(conllu.read_text()))
        items, _ = caption_items(read_manifest(manifest))
        n = len(items)

        sentences, read_s = timed(lambda: parse_conllu(conllu.read_text()))
        try:
            from stanza.utils.conll import CoNLL
        except ImportError:               # the reader is the baseline where stanza is not installed
            base_name, base_s = "conllu-reader", read_s
        else:
            base_name = "baseline-conll2doc"
            _, base_s = timed(lambda: CoNLL.conll2doc(input_str=conllu.read_text()).sentences)
        baseline = n / base_s
        rates: dict[str, float] = {}

        def report(what: str, seconds: float, against: str = base_name, **extra) -> None:
            rate = n / seconds
            rates[what] = rate
            base = rates.get(against, baseline)
            print(json.dumps({"bench": "parse-trees", "what": what, "captions": n, "seconds": round(seconds, 3),
                              "captions_per_s": round(rate, 1), "baseline": against,
                              "baseline_captions_per_s": round(base, 1), "vs_baseline": round(rate / base, 3),
                              "repeat": REPEAT, **extra}, ensure_ascii=False), flush=True)

        report(base_name, base_s)
        if base_name != "conllu-reader":
            report("conllu-reader", read_s)
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
        reference, seconds = timed(lambda: [str(builder.build(s)) for s in sentences])
        report("tree-rules", seconds)

        # label schemes: indexing with detection, conversion alone, the stage on each file
        _, seconds = timed(lambda: ConlluBackend(conllu, detect=False))
        report("conllu-index-no-detection", seconds)
        backend, seconds = timed(lambda: ConlluBackend(conllu))
        report("conllu-index", seconds, "conllu-index-no-detection", detected=backend.detect_scheme().scheme)
        for scheme, path in files.items():
            read = parse_conllu(path.read_text())
            converter = SchemeConverter(scheme)
            converted, seconds = timed(lambda: [converter.convert(s)[0] for s in read])
            trees = [str(builder.build(s)) for s in converted]
            report(f"convert-{scheme}", seconds, "tree-rules", trees_equal=trees == reference,
                   detected=ConlluBackend(path).detect_scheme().scheme)

        def stage(path, name, **kw):
            out = Path(tmp) / f"{name}.h5"
            backend = (_AsBefore if kw.pop("as_before", False) else ConlluBackend)(path)
            return run_parse_trees(manifest, out, backend, batch_size=args.batch, restart=True, **kw), out

        # the stage variants run in turns (round-robin), so that a slower spell of a shared machine does not
        # fall on one variant; each keeps its best time
        variants = {"parse-trees-stage-without-schemes": (conllu, {"as_before": True}),
                    "parse-trees-stage": (conllu, {}),
                    "parse-trees-stage-ud1": (files["ud1"], {}),
                    "parse-trees-stage-sd": (files["sd"], {})}
        best: dict[str, float] = {}
        results = {}
        for _ in range(REPEAT):
            for name, (path, kw) in variants.items():
                start = time.perf_counter()
                results[name] = stage(path, name, **dict(kw))
                seconds = time.perf_counter() - start
                best[name] = min(best.get(name, seconds), seconds)
        ud2_nodes = read_trees(results["parse-trees-stage-without-schemes"][1])[1]
        for name in variants:
            summary, out = results[name]
            assert summary.trees == n, (name, summary.failures[:3])
            first = name == "parse-trees-stage-without-schemes"
            report(name, best[name], base_name if first else "parse-trees-stage-without-schemes",
                   batch=args.batch, scheme="ud2 (not detected, as before)" if first
                   else f"{summary.scheme.scheme} ({summary.scheme.how})",
                   failures=len(summary.failures), trees_equal=bool(np.array_equal(read_trees(out)[1], ud2_nodes)),
                   conversions=dict(sorted(summary.conversions.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
