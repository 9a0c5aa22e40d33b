"""The data side of models that need more than features and captions: side files read into tensors.

Each :class:`~retr.trainers.models.registry.ModelSpec`'s ``load_inputs`` points here; the models read no file.
JGCAR's labels: docs/models-jgcar.md; SMFEA's ``nodes`` [M, 7], ``image_labels`` [M, C], ``adjacency`` [C, C],
``vectors`` [C, D], ``token_concepts`` [V]: docs/models-smfea.md ("Data flow"); VSE∞'s pretrained BERT (its
configuration, weights and WordPiece vocabulary): docs/models-vse-infinity.md."""
from __future__ import annotations

import zipfile
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from retr.common.errors import UserError
from retr.store.concepts import ConceptSet
from retr.store.labels import read_label_file
from retr.store.trees import TreeSet
from retr.store.vocab import FUNCTION_WORDS, SPECIALS, UNK_ID, tokenize
from retr.store.word_vectors import GLOVE_FORMAT, RANDOM, resolve_vectors, vocabulary_vectors
from retr.store.wordpiece import WordPieceVocabulary
from retr.trainers.models.pretrained_bert import check_weights, pretrained_bert, pretrained_state
from retr.trainers.models.registry import ModelInputs

# ------------------------------------------------------------------------------------------------- JGCAR

#: words never used as caption concepts: the shared closed-class list, plus what JGCAR's labels must also skip —
#: position words (two images "left of" something share nothing), the vocabulary's special tokens and
#: punctuation tokens. The extras stay here, not in FUNCTION_WORDS: build-concepts' frequency fallback keeps
#: left/right/top/… as concepts (the synthetic captions' relations) and drops tokens without a letter itself.
CONCEPT_STOP_WORDS = FUNCTION_WORDS | frozenset(SPECIALS) | frozenset("left right top bottom front . , ' ''".split())


def caption_concepts(captions_per_image: Sequence[Sequence[Sequence[str]]], min_captions: int = 2) -> list[set[str]]:
    """The fallback image labels: words (not :data:`CONCEPT_STOP_WORDS`) found in at least ``min_captions`` of an
    image's tokenised captions (a consensus of its captions, so one caption's detail does not make a label)."""
    concepts = []
    for captions in captions_per_image:
        counts = Counter(w for caption in captions for w in set(caption) if w not in CONCEPT_STOP_WORDS)
        concepts.append({w for w, n in counts.items() if n >= min(min_captions, len(captions))})
    return concepts


def labels_to_multihot(label_sets: Sequence[Sequence[str]]) -> torch.Tensor:
    """``[N, L]`` bool multi-hot matrix of N label sets over their L distinct labels (sorted)."""
    names = sorted({x for s in label_sets for x in s})
    index = {x: k for k, x in enumerate(names)}
    out = torch.zeros(len(label_sets), max(1, len(names)), dtype=torch.bool)
    for row, s in enumerate(label_sets):
        for x in s:
            out[row, index[x]] = True
    return out

#: the batch the JGCAR presets train with (§3.1), for the no-label-file note
JGCAR_BATCH = 200


def same_image_pairs_per_batch(caption_image: np.ndarray, batch: int = JGCAR_BATCH) -> float:
    """Expected number of caption pairs from the same image in a batch of ``batch`` captions drawn without
    replacement from the split (``caption_image`` [M]: each caption's image): ``Σ_i C(n_i, 2) · B(B−1) / (M(M−1))``.
    COCO's training split (≈567k captions, 5 per image): about 0.14."""
    counts = np.bincount(np.asarray(caption_image, dtype=np.int64)).astype(np.float64)
    m = float(counts.sum())
    if m < 2:
        return 0.0
    b = float(min(batch, m))
    return float((counts * (counts - 1) / 2).sum() * b * (b - 1) / (m * (m - 1)))


def no_labels_note(data) -> str:
    """The one-line note the loop prints when JGCAR trains without ``--labels``."""
    pairs = same_image_pairs_per_batch(data.caption_image)
    return (f"no --labels: J3 has positives only between captions of one image (about {pairs:.2g} such pairs per "
            f"batch of {JGCAR_BATCH} here, so it is nearly inert) and J2 uses shared caption words; the paper used "
            "COCO's 80 categories / Flickr30K Entities' boxed objects — make a label file with `retr-pipeline labels "
            "coco` or `retr-pipeline labels f30k-entities` and pass it with --labels")


def load_jgcar_inputs(data, labels_path: str | None, concept_min_captions: int = 2) -> ModelInputs:
    """JGCAR's intra-modal label table of the training images of ``data`` (a ``SplitData``).

    With ``labels_path`` every training image needs an entry; without, the caption-concept fallback and a note
    (:func:`no_labels_note`) that J3 is then nearly inert."""
    if labels_path:
        table = read_label_file(labels_path)
        missing = [i for i in data.image_ids if i not in table]
        if missing:
            raise UserError(f"{len(missing)} training image(s) have no entry in {labels_path} "
                            f"(first: {missing[0]}); give every image a (possibly empty) label list")
        sets = [table[i] for i in data.image_ids]
    else:
        per_image: list[list[list[str]]] = [[] for _ in data.image_ids]
        for caption, owner in zip(data.captions, data.caption_image):
            per_image[int(owner)].append(tokenize(caption))
        sets = [sorted(c) for c in caption_concepts(per_image, concept_min_captions)]
    return ModelInputs(tensors={"image_labels": labels_to_multihot(sets),
                                "labels_are_captions": torch.tensor(bool(labels_path))},
                       notes=[] if labels_path else [no_labels_note(data)])


# ------------------------------------------------------------------------------------------------- SMFEA

@dataclass
class TrainingInputs:
    nodes: torch.Tensor | None
    image_labels: torch.Tensor
    adjacency: torch.Tensor
    vectors: torch.Tensor | None
    token_concepts: torch.Tensor
    missing_vectors: list[str]
    vectors_file: str = ""          #: the concept vectors' file (name sha256:…)


def caption_keys(data) -> list[str]:
    """``<image id>#<k>`` of every caption of a ``SplitData`` (captions are flattened in manifest order)."""
    keys, previous, k = [], -1, 0
    for owner in data.caption_image.tolist():
        k = k + 1 if owner == previous else 0
        previous = owner
        keys.append(f"{data.image_ids[owner]}#{k}")
    return keys


def token_concept_map(data, forms: dict[str, int], vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` long: concept id of each vocabulary id seen in ``data``'s captions (−1: none)."""
    table = torch.full((vocab_size,), -1, dtype=torch.long)
    for caption, ids in zip(data.captions, data.tokens):
        for word, token in zip(tokenize(caption), ids[1:-1]):
            if token != UNK_ID and word in forms:
                table[token] = forms[word]
    return table


def read_tree_nodes(trees_path: str, keys: list[str]) -> tuple[np.ndarray, int, int]:
    """``[len(keys), 7]`` node ids (−100 rows for captions without a tree) and the dictionary sizes."""
    trees = TreeSet(trees_path)
    has = np.array([k in trees for k in keys], dtype=bool)
    if not has.any():
        raise UserError(f"{trees_path} has no tree for any training caption (first key: {keys[0]}); "
                        "was it parsed from this manifest?")
    nodes = trees.nodes_for(keys, missing="null").astype(np.int64)
    nodes[~has] = -100
    return nodes, len(trees.entities), len(trees.relations)


def read_training_inputs(data, trees_path: str | None, concepts_path: str | None,
                         concept_vectors: str = "learned", vocab_size: int | None = None) -> TrainingInputs:
    """Everything :class:`~retr.trainers.models.smfea.SMFEA` needs for the training captions of ``data``
    (``concept_vectors``: a GloVe-format file of fixed concept vectors, or ``learned``)."""
    if not concepts_path:
        raise UserError("SMFEA needs --concepts (build it with retr-pipeline build-concepts)")
    concepts = ConceptSet(concepts_path)
    keys = caption_keys(data)
    image_labels = concepts.labels_for_images([data.image_ids[i] for i in data.caption_image.tolist()])
    vectors, missing, label = None, [], ""
    if concept_vectors != "learned":
        source = resolve_vectors(concept_vectors)
        found, present = vocabulary_vectors(source, concepts.concepts)
        vectors, label = torch.from_numpy(found.copy()), source.label
        missing = [w for w, ok in zip(concepts.concepts, present) if not ok]
        absent = torch.from_numpy(~present)                     # absent words keep a random start vector
        vectors[absent] = torch.empty(len(missing), found.shape[1]).uniform_(-0.1, 0.1)
    size = vocab_size or (max(max(t) for t in data.tokens) + 1)
    nodes = torch.from_numpy(read_tree_nodes(trees_path, keys)[0]) if trees_path else None
    return TrainingInputs(nodes, torch.from_numpy(image_labels.astype(np.float32)),
                          torch.from_numpy(concepts.adjacency), vectors,
                          token_concept_map(data, concepts.forms, size), missing, label)


def load_smfea_inputs(data, files: dict, config, vocab_size: int) -> ModelInputs:
    """SMFEA's spec step: sizes for the constructor (dictionary and concept counts, the concept vectors' file), the
    settings fixed vectors fix (``concept_vectors="fixed"``, their size) and the training tensors for
    :meth:`SMFEA.prepare_training`."""
    trees, concepts, vectors = files.get("trees"), files.get("concepts"), files.get("concept_vectors")
    vectors = None if vectors == "learned" else vectors          # the option's old spelling of "no file"
    if config.use_trees and not trees:
        raise UserError("--trees is required (or train the 'w/o trees' ablation with --no-trees)")
    inputs = read_training_inputs(data, trees if config.use_trees else None, concepts, vectors or "learned",
                                  vocab_size=vocab_size)
    sizes = {"num_concepts": int(inputs.adjacency.shape[0]), "num_entities": 1, "num_relations": 1}
    if config.use_trees:
        tree_set = TreeSet(trees)
        sizes.update(num_entities=len(tree_set.entities), num_relations=len(tree_set.relations))
    settings = {}
    if vectors:
        settings = {"concept_vectors": "fixed", "concept_word_dim": int(inputs.vectors.shape[1])}
        sizes["concept_vectors_file"] = inputs.vectors_file
    tensors = {"adjacency": inputs.adjacency, "token_concepts": inputs.token_concepts,
               "image_labels": inputs.image_labels}
    if inputs.nodes is not None:
        tensors["nodes"] = inputs.nodes
    if inputs.vectors is not None:
        tensors["vectors"] = inputs.vectors
    notes = [f"{len(inputs.missing_vectors)} concept(s) have no vector in {vectors} and start random "
             f"(first: {inputs.missing_vectors[0]})"] if inputs.missing_vectors else []
    return ModelInputs(sizes=sizes, settings=settings, tensors=tensors, notes=notes)


# ------------------------------------------------------------------------------------------------- VSE∞'s BERT

def bert_vocabulary(config, given: str | None = None):
    """The caption vocabulary ``config`` fixes: with BERT, ``bert_model``'s WordPiece vocabulary (None with the BiGRU:
    the run builds its own, or reads ``--vocab``). ``given``: the ``--vocab`` the user gave, refused with BERT."""
    if config.text_encoder != "bert":
        return None
    if given:
        raise UserError(f"--vocab {given}: --text-encoder bert tokenises captions with the WordPiece vocabulary of "
                        f"--bert-model {config.bert_model} (a vocabulary file is for the BiGRU); leave --vocab out")
    return pretrained_bert(config.bert_model).vocabulary


def load_bert_inputs(data, files, config, vocab) -> ModelInputs:
    """With BERT: its configuration (a size the run stores), its pretrained weights and the vocabulary's word pieces
    and ``[MASK]`` (for :meth:`VSEInfinity.prepare_training`). Nothing with the BiGRU."""
    if config.text_encoder != "bert":
        return ModelInputs()
    if not isinstance(vocab, WordPieceVocabulary):
        raise UserError(f"--text-encoder bert reads WordPiece captions, and this run's vocabulary is a word "
                        f"vocabulary for the BiGRU ({len(vocab)} words)")
    bert = pretrained_bert(config.bert_model)
    if len(vocab) != bert.config["vocab_size"]:
        raise UserError(f"--bert-model {config.bert_model} has {bert.config['vocab_size']} embedding rows, the run's "
                        f"WordPiece vocabulary {len(vocab)} tokens")
    tensors = {f"bert.{k}": v for k, v in pretrained_state(config.bert_model).items()}
    tensors.update(word_continues=torch.from_numpy(vocab.continuation()), mask_token=torch.tensor(vocab.mask_id))
    return ModelInputs(sizes={"bert_config": dict(bert.config)}, tensors=tensors)


# ------------------------------------------------------------------------------------------------- word vectors

def add_word_vectors(inputs: ModelInputs, config, vocab, recorded: str = "") -> ModelInputs:
    """``--word-vectors glove|glove-6b|FILE``: the vocabulary's rows ``word_vectors`` [V, D] and
    ``word_vectors_found`` [V] bool added to ``inputs`` (for ``prepare_training``), the file's ``name sha256:…``
    to the run's ``word_vectors_file``, a note of the words it lacks. ``random``: ``inputs`` unchanged. A resumed
    run must find the vectors it ``recorded``."""
    spec = getattr(config, "word_vectors", RANDOM)
    if spec == RANDOM:
        return inputs
    source = resolve_vectors(spec)
    if recorded and recorded != source.label:
        raise UserError(f"this run's word vectors were {recorded}; --word-vectors {spec} is {source.label}")
    matrix, found = vocabulary_vectors(source, vocab.idx2word)
    if matrix.shape[1] != config.word_dim:
        raise UserError(f"--word-vectors {spec} holds {matrix.shape[1]}-d vectors: give --word-dim {matrix.shape[1]} "
                        f"(not {config.word_dim})")
    inputs.tensors.update(word_vectors=torch.from_numpy(matrix.copy()), word_vectors_found=torch.from_numpy(found))
    inputs.sizes["word_vectors_file"] = source.label
    absent = [w for w, ok in zip(vocab.idx2word, found) if not ok and w not in SPECIALS]
    inputs.notes.append(f"word vectors {source.label[:40]}…: {len(vocab) - len(SPECIALS) - len(absent)} of "
                        f"{len(vocab) - len(SPECIALS)} vocabulary words found; {len(absent)} keep the model's random "
                        f"init{f' (first: {absent[0]})' if absent else ''}")
    return inputs


# ------------------------------------------------------------------------------------------------- audit

def check_side_inputs(spec, files: dict, config, image_ids: Sequence[str], caption_keys: Sequence[str]) -> None:
    """Refuse (one line), before anything is trained, the side files and word vectors a run of ``spec`` could
    not read: a required file left out (SMFEA's ``trees`` unless ``use_trees`` is off), a file that is not what
    its option takes, labels without an entry for a training image (``image_ids``), trees with no tree for any
    training caption (``caption_keys``: ``<id>#<k>``), word or concept vectors that are neither a file nor a
    named set on disk or downloadable (``RETR_OFFLINE``: the one-line missing-resource error), and VSE∞'s pretrained
    BERT: transformers installed, its configuration, vocabulary and weights found (offline: in the cache). ``files``:
    ``{input name: path}``; ``config``: the run's model settings (its config dataclass)."""
    names = {i.name for i in spec.inputs}
    for item in spec.inputs:
        if item.required and not files.get(item.name):
            raise UserError(f"{spec.name} needs --{item.name.replace('_', '-')}")
    use_trees = getattr(config, "use_trees", True)
    if "trees" in names and use_trees and not files.get("trees"):
        raise UserError("--trees is required (or train the 'w/o trees' ablation with --no-trees)")
    for name, path in files.items():
        if not path or name not in names:
            continue
        if name == "labels":
            table = read_label_file(path)
            missing = [i for i in image_ids if i not in table]
            if missing:
                raise UserError(f"{len(missing)} training image(s) have no entry in {path} (first: {missing[0]}); "
                                "give every image a (possibly empty) label list")
        elif name == "trees" and use_trees:
            trees = TreeSet(path)
            if caption_keys and not any(k in trees for k in caption_keys):
                raise UserError(f"{path} has no tree for any training caption (first key: {caption_keys[0]}); "
                                "was it parsed from this manifest?")
        elif name == "concepts":
            ConceptSet(path)
        elif name == "concept_vectors" and path != "learned":
            check_vectors_file(resolve_vectors(path))
    if getattr(config, "text_encoder", None) == "bert":      # VSE∞'s BERT: its files, offline ones in the cache
        pretrained_bert(config.bert_model)
        check_weights(config.bert_model)
    vectors = getattr(config, "word_vectors", RANDOM)
    if vectors and vectors != RANDOM:
        dim = check_vectors_file(resolve_vectors(vectors))
        if getattr(config, "word_dim", None) is not None and dim != config.word_dim:
            raise UserError(f"--word-vectors {vectors} holds {dim}-d vectors: give --word-dim {dim} "
                            f"(not {config.word_dim})")


def check_vectors_file(source) -> int:
    """The vector size ``D`` of a located vectors file (:class:`~retr.store.word_vectors.VectorsFile`), read from
    its first line, which must be a word and ``D`` numbers (GloVe's text format); one line refuses anything else
    (an empty file, a manifest, HDF5 …) before training. Only the first line is read."""
    try:
        if source.member is not None:
            with zipfile.ZipFile(source.path) as archive, archive.open(source.member) as handle:
                first = handle.readline(1 << 20)
        else:
            with open(source.path, "rb") as handle:
                first = handle.readline(1 << 20)
    except (OSError, zipfile.BadZipFile, KeyError) as exc:
        raise UserError(f"{source.path} cannot be read as word vectors ({exc})") from None
    parts = first.split()
    try:
        values = [float(p) for p in parts[1:]]
    except ValueError:
        values = []
    if len(parts) < 2 or not values:
        raise UserError(f"{source.path} is not a word-vector file: its first line is not a word and numbers "
                        f"({GLOVE_FORMAT})")
    return len(values)
