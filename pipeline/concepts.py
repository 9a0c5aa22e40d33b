"""Consensus-aware concepts (CVSE, used by SMFEA): concept vocabulary, multi-hot labels, co-occurrence graph.

The stage of ``retr-pipeline build-concepts``; the file is :mod:`retr.store.concepts`. Vocabulary, labels and graph
as computed: docs/models-smfea.md ("Data flow", C5)."""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from retr.common.errors import UserError
from retr.manifests.schema import ManifestRecord, manifest_sha256, read_manifest
from retr.store.concepts import ConceptData, write_concepts
from retr.store.conllu import ConlluError, read_conllu
from retr.store.vocab import FUNCTION_WORDS, tokenize

TRAIN_SPLITS = ("train", "restval")
DEFAULT_NOUNS, DEFAULT_ADJECTIVES, DEFAULT_VERBS = 210, 60, 30
#: graph parameters of CVSE (models.md): rescale base, offset, edge threshold, neighbour weight
GRAPH_DEFAULTS = {"scale_base": 5.0, "offset": 0.02, "threshold": 0.3, "neighbour_weight": 0.25}
POS_GROUPS = {"NOUN": "NOUN", "PROPN": "NOUN", "ADJ": "ADJ", "VERB": "VERB"}


# ---------------------------------------------------------------------------------------- Words of each caption

CaptionWords = list[tuple[str, str]]   # (word, POS group or "ANY")


def read_conllu_words(path: str | os.PathLike, forms: Counter | None = None) -> dict[str, CaptionWords]:
    """``{caption key: [(lemma, POS group), …]}`` from a CoNLL-U file with ``# sent_id = <caption key>`` (read by
    :mod:`retr.store.conllu`: no extra needed).

    POS group: NOUN (NOUN, PROPN), ADJ, VERB or ``"OTHER"``; a word without a lemma counts as its form; ``forms``
    counts ``(lower-cased form, lemma)`` pairs.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"CoNLL-U file {path} does not exist")
    words: dict[str, CaptionWords] = {}
    try:
        for number, sentence in enumerate(read_conllu(path), start=1):
            key = sentence.sent_id
            if not key:
                raise UserError(f"{path}: sentence {number} has no '# sent_id = <image id>#<caption index>' "
                                "comment")
            row = []
            for word in sentence.words:
                lemma = word.lemma if word.lemma != "_" else word.form
                row.append((lemma.lower(), POS_GROUPS.get(word.upos, "OTHER")))
                if forms is not None:
                    forms[(word.form.lower(), lemma.lower())] += 1
            words[key] = row
    except ConlluError as exc:
        raise UserError(f"{path} is not readable CoNLL-U ({exc})") from None
    return words


def fallback_words(caption: str) -> CaptionWords:
    """The frequency fallback's words of a caption: tokens minus :data:`FUNCTION_WORDS` and non-words."""
    return [(t, "ANY") for t in tokenize(caption) if t not in FUNCTION_WORDS and any(c.isalpha() for c in t)]


# ------------------------------------------------------------------------------------ Vocabulary, labels, graph

def select_concepts(train_words: Iterable[CaptionWords], num_nouns: int = DEFAULT_NOUNS,
                    num_adjectives: int = DEFAULT_ADJECTIVES, num_verbs: int = DEFAULT_VERBS,
                    pos_source: str = "conllu") -> list[tuple[str, str]]:
    """The concept vocabulary ``[(word, POS)]``: most frequent nouns, then adjectives, then verbs (any POS with
    ``pos_source="frequency"``)."""
    counts: dict[str, Counter] = {"NOUN": Counter(), "ADJ": Counter(), "VERB": Counter(), "ANY": Counter()}
    for caption in train_words:
        for word, pos in caption:
            if pos in counts:
                counts[pos][word] += 1

    def top(counter: Counter, n: int, taken: set[str]) -> list[str]:
        ranked = sorted((w for w in counter if w not in taken), key=lambda w: (-counter[w], w))
        return ranked[:max(n, 0)]

    chosen: list[tuple[str, str]] = []
    taken: set[str] = set()
    plan = ([("ANY", num_nouns + num_adjectives + num_verbs)] if pos_source == "frequency"
            else [("NOUN", num_nouns), ("ADJ", num_adjectives), ("VERB", num_verbs)])
    for pos, n in plan:
        for word in top(counts[pos], n, taken):
            chosen.append((word, pos))
            taken.add(word)
    return chosen


def multi_hot(captions: Sequence[CaptionWords], concepts: Sequence[str]) -> np.ndarray:
    """``[len(captions), C]`` uint8: 1 where a caption's words contain concept c (matched by word, any POS)."""
    index = {word: c for c, word in enumerate(concepts)}
    labels = np.zeros((len(captions), len(concepts)), dtype=np.uint8)
    for m, caption in enumerate(captions):
        for word, _ in caption:
            c = index.get(word)
            if c is not None:
                labels[m, c] = 1
    return labels


def cooccurrence_counts(labels: np.ndarray) -> np.ndarray:
    """``[C, C]`` int64 number of captions containing both concepts (diagonal: containing the concept)."""
    y = np.asarray(labels, dtype=np.int64)
    return y.T @ y


def concept_graph(cooccurrence: np.ndarray, scale_base: float = 5.0, offset: float = 0.02,
                  threshold: float = 0.3, neighbour_weight: float = 0.25) -> np.ndarray:
    """The fixed GCN matrix ``[C, C]`` float32 from co-occurrence counts (diagonal = per-concept counts)."""
    counts = np.asarray(cooccurrence, dtype=np.float64)
    if counts.ndim != 2 or counts.shape[0] != counts.shape[1]:
        raise ValueError(f"co-occurrence must be square, got {counts.shape}")
    n = np.diag(counts).copy()
    pairs = counts.copy()
    np.fill_diagonal(pairs, 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n[:, None] > 0, pairs / n[:, None], 0.0)
    rescaled = np.power(scale_base, p - offset) - np.power(scale_base, -offset)
    binary = (rescaled >= threshold).astype(np.float64)
    a = binary * neighbour_weight / (binary.sum(axis=0, keepdims=True) + 1e-6) + np.eye(len(n))
    d = np.power(a.sum(axis=1), -0.5)
    return (d[:, None] * a.T * d[None, :]).astype(np.float32)


# ------------------------------------------------- Concept data (written by retr.store.concepts.write_concepts)

def concept_forms(concepts: Sequence[str], forms: Counter | None) -> dict[str, str]:
    """``{form: concept}``: each concept is its own form; with CoNLL-U counts, every form whose most frequent
    lemma is a concept (``dogs`` → ``dog``, ``sits`` → ``sit``)."""
    known = set(concepts)
    out = {c: c for c in concepts}
    best: dict[str, tuple[int, str]] = {}
    for (form, lemma), n in sorted((forms or {}).items()):
        if n > best.get(form, (0, ""))[0]:
            best[form] = (n, lemma)
    for form, (_, lemma) in best.items():
        if lemma in known and form not in out:
            out[form] = lemma
    return out


def build_concepts(records: Sequence[ManifestRecord], words: Mapping[str, CaptionWords] | None = None,
                   num_nouns: int = DEFAULT_NOUNS, num_adjectives: int = DEFAULT_ADJECTIVES,
                   num_verbs: int = DEFAULT_VERBS, train_splits: Sequence[str] = TRAIN_SPLITS,
                   graph: Mapping[str, float] | None = None, forms: Counter | None = None) -> ConceptData:
    """Concept data of a manifest. ``words`` (from :func:`read_conllu_words`) must cover every caption;
    ``None`` uses the frequency fallback. ``forms``: the (form, lemma) counts of :func:`read_conllu_words`."""
    pos_source = "conllu" if words is not None else "frequency"
    keys, caption_words, owner = [], [], []
    missing = []
    for i, record in enumerate(records):
        for k, caption in enumerate(record.captions):
            key = record.caption_key(k)
            if words is None:
                row = fallback_words(caption)
            else:
                row = words.get(key)
                if row is None:
                    missing.append(key)
                    continue
            keys.append(key)
            caption_words.append(row)
            owner.append(i)
    if missing:
        raise UserError(f"the CoNLL-U file has no sentence for {len(missing)} caption(s) of the manifest "
                        f"(first: {missing[0]}); parse every caption or leave out --conllu")
    owner_arr = np.asarray(owner, dtype=np.int64)
    is_train = np.array([records[i].split in train_splits for i in owner], dtype=bool)
    if not is_train.any():
        raise UserError(f"the manifest has no caption in split(s) {', '.join(train_splits)} to learn concepts from")
    chosen = select_concepts([caption_words[m] for m in np.flatnonzero(is_train)], num_nouns, num_adjectives,
                             num_verbs, pos_source)
    if not chosen:
        raise UserError("no concept word found in the training captions")
    concepts = [w for w, _ in chosen]
    labels = multi_hot(caption_words, concepts)
    image_labels = np.zeros((len(records), len(concepts)), dtype=np.uint8)
    np.maximum.at(image_labels, owner_arr, labels)
    cooc = cooccurrence_counts(labels[is_train])
    params = {**GRAPH_DEFAULTS, **(graph or {})}
    adjacency = concept_graph(cooc, **params)
    actual = Counter(p for _, p in chosen)
    attrs = {"pos_source": pos_source, "train_splits": ",".join(train_splits),
             "requested": json.dumps({"NOUN": num_nouns, "ADJ": num_adjectives, "VERB": num_verbs}),
             "actual": json.dumps(dict(actual)), "graph": json.dumps(params)}
    return ConceptData(concepts, [p for _, p in chosen], np.diag(cooc).copy(), cooc, adjacency, keys, labels,
                       [r.id for r in records], image_labels, attrs, concept_forms(concepts, forms))


def build_concepts_file(manifest: str | os.PathLike, out: str | os.PathLike, conllu: str | os.PathLike | None = None,
                        num_nouns: int = DEFAULT_NOUNS, num_adjectives: int = DEFAULT_ADJECTIVES,
                        num_verbs: int = DEFAULT_VERBS, train_splits: Sequence[str] = TRAIN_SPLITS) -> ConceptData:
    """Read the manifest (and CoNLL-U), build the concept data, write ``out``; returns the data."""
    records = read_manifest(manifest)
    if not records:
        raise UserError(f"{manifest} has no images")
    forms: Counter = Counter()
    words = read_conllu_words(conllu, forms) if conllu is not None else None
    data = build_concepts(records, words, num_nouns, num_adjectives, num_verbs, train_splits, forms=forms)
    write_concepts(out, data, {"manifest_sha256": manifest_sha256(manifest), "manifest": str(manifest),
                               "conllu": str(conllu) if conllu else ""})
    return data
