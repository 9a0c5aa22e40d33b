"""SMFEA's side inputs and command: ``trees.h5`` and ``concepts.h5`` joined to the training captions,
the tree-node accuracy of a run, and ``retr-train smfea``.

The model module reads no file; :meth:`SMFEA.prepare_training` (the loop's per-run hook) calls
:func:`load_training_inputs`, which returns tensors:

* ``nodes`` [M, 7] int64 — the referral tree of each training caption, looked up by caption key
  ``<image id>#<k>``; a caption the parser could not handle (``trees.h5`` ``failures``) gets −100 in every slot,
  which the cross-entropy ignores (it is not taught that the caption is all ``null``);
* ``image_labels`` [M, C] float — the concept labels of each caption's image (CVSE's training labels);
* ``adjacency`` [C, C], ``vectors`` [C, D] or None (``learned``), ``token_concepts`` [V] — vocabulary id →
  concept id through the word forms recorded in ``concepts.h5`` (``dogs`` → ``dog``). The vocabulary's words are
  recovered from the captions themselves (their tokens line up with their ids), so no vocabulary is needed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import torch

from retr.common.errors import UserError
from retr.pipeline.concepts import ConceptSet, read_word_vectors
from retr.trainers.vocab import UNK_ID, tokenize


@dataclass
class TrainingInputs:
    nodes: torch.Tensor | None
    image_labels: torch.Tensor
    adjacency: torch.Tensor
    vectors: torch.Tensor | None
    token_concepts: torch.Tensor
    missing_vectors: list[str]


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
    from retr.parsers.trees_file import TreeSet

    trees = TreeSet(trees_path)
    has = np.array([k in trees for k in keys], dtype=bool)
    if not has.any():
        raise UserError(f"{trees_path} has no tree for any training caption (first key: {keys[0]}); "
                        "was it parsed from this manifest?")
    nodes = trees.nodes_for(keys, missing="null").astype(np.int64)
    nodes[~has] = -100
    return nodes, len(trees.entities), len(trees.relations)


def load_training_inputs(data, trees_path: str | None, concepts_path: str | None,
                         concept_vectors: str = "learned", vocab_size: int | None = None) -> TrainingInputs:
    """Everything :class:`~retr.trainers.models.smfea.SMFEA` needs for the training captions of ``data``."""
    if not concepts_path:
        raise UserError("SMFEA needs --concepts (build it with retr-pipeline build-concepts)")
    concepts = ConceptSet(concepts_path)
    keys = caption_keys(data)
    image_labels = concepts.labels_for_images([data.image_ids[i] for i in data.caption_image.tolist()])
    vectors, missing = None, []
    if concept_vectors != "learned":
        found, missing = read_word_vectors(concept_vectors, concepts.concepts)
        vectors = torch.from_numpy(found)
        rows = [concepts.concepts.index(w) for w in missing]      # absent words keep a random start vector
        vectors[rows] = torch.empty(len(rows), found.shape[1]).uniform_(-0.1, 0.1)
    size = vocab_size or (max(max(t) for t in data.tokens) + 1)
    nodes = torch.from_numpy(read_tree_nodes(trees_path, keys)[0]) if trees_path else None
    return TrainingInputs(nodes, torch.from_numpy(image_labels.astype(np.float32)),
                          torch.from_numpy(concepts.adjacency), vectors,
                          token_concept_map(data, concepts.forms, size), missing)


def vector_file_dim(path: str) -> int:
    """Dimension of a GloVe-format text file (from its first line)."""
    p = Path(path)
    if not p.is_file():
        read_word_vectors(p, [])            # raises the one-line MissingResourceError
    with open(p, encoding="utf-8", errors="replace") as handle:
        first = handle.readline().rstrip("\n").split(" ")
    if len(first) < 2:
        raise UserError(f"{path} is not GloVe text format ('word v1 … vD' per line)")
    return len(first) - 1


# ------------------------------------------------------------------------------------------ node accuracy

@torch.no_grad()
def tree_node_accuracy(model, data, features, trees_path: str, device: torch.device | str = "cpu",
                       batch_size: int = 128) -> dict:
    """Accuracy (%) of the predicted tree nodes against the captions' referral trees on a split.

    ``text``: the TCS-Tree of each caption against its own tree; ``image``: the VCS-Tree of each image against
    the tree of each of its captions (captions of one image differ, so this is bounded below 100).
    Each side: ``all`` (7 slots), ``entities`` (4 leaves), ``relations`` (3 inner nodes). Captions without a
    tree are left out.
    """
    from retr.trainers.data import pad_tokens

    model.eval()
    targets, _, _ = read_tree_nodes(trees_path, caption_keys(data))
    keep = targets[:, 0] != -100
    text_pred = np.zeros_like(targets)
    for start in range(0, data.num_captions, batch_size):
        idx = np.arange(start, min(start + batch_size, data.num_captions))
        tokens, lengths = pad_tokens([data.tokens[m] for m in idx])
        text_pred[idx] = model.predict_nodes(tokens=tokens.to(device), lengths=lengths.to(device)).cpu().numpy()
    image_pred = np.zeros((data.num_images, 7), dtype=np.int64)
    for start in range(0, data.num_images, batch_size):
        idx = np.arange(start, min(start + batch_size, data.num_images))
        feats, mask = features.get(idx)
        image_pred[idx] = model.predict_nodes(features=feats.to(device), mask=mask.to(device)).cpu().numpy()
    image_pred = image_pred[data.caption_image]

    def summary(pred: np.ndarray) -> dict:
        hit = (pred == targets)[keep]
        return {"all": round(100 * float(hit.mean()), 2), "entities": round(100 * float(hit[:, ::2].mean()), 2),
                "relations": round(100 * float(hit[:, 1::2].mean()), 2)}

    return {"text": summary(text_pred), "image": summary(image_pred), "captions": int(keep.sum())}


def run_tree_accuracy(run: str | Path, split: str = "test", which: str = "best", device: str = "cpu") -> dict:
    """Tree-node accuracy of a finished SMFEA run on ``split``; also written to ``RUN/tree_accuracy.json``."""
    from retr.pipeline.store import FeatureSet
    from retr.trainers import checkpoint as ckpt
    from retr.trainers.data import ImageFeatures, load_split

    model, vocab, config = ckpt.load_run_model(run, which, device)
    trees = config["model_args"].get("trees")
    if not trees:
        raise UserError(f"{run} was trained without trees; there are no tree nodes to score")
    feature_set = FeatureSet(config["features"])
    data, _ = load_split(config["manifest"], [split], vocab, feature_set, missing="error")
    result = {"split": split, **tree_node_accuracy(model, data, ImageFeatures(feature_set, data.image_ids),
                                                   trees, device)}
    (Path(run) / "tree_accuracy.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


# ------------------------------------------------------------------------------------------ retr-train smfea

SMFEA_KEYS = ("embed_size", "word_dim", "margin", "max_violation", "tree_hidden", "forget_gate", "tree_residual",
              "use_trees", "beta_d", "beta_t", "beta_c", "ce_weight", "kl_weight", "label_ratio",
              "concept_vectors", "concept_word_dim", "train_text_labels", "trees", "concepts", "num_entities",
              "num_relations", "num_concepts")


def _options():
    from retr.trainers.commands import common_train_options

    def wrap(f):
        opts = [
            click.option("--trees", type=click.Path(dir_okay=False), default=None,
                         help="trees.h5 from retr-pipeline parse-trees (required unless --no-trees)."),
            click.option("--concepts", type=click.Path(dir_okay=False), required=True,
                         help="concepts.h5 from retr-pipeline build-concepts."),
            click.option("--concept-vectors", default=None,
                         help="GloVe-format text file of concept word vectors (kept fixed, as CVSE), or "
                              "'learned' (default): vectors trained from U(±0.1)."),
            click.option("--no-trees", is_flag=True, help="Ablation 'w/o trees' (Table 5): no VCS/TCS-Tree."),
            click.option("--no-kl", is_flag=True, help="Ablation 'w/o D_KL' (Table 5)."),
            click.option("--no-node-ce", is_flag=True, help="Ablation 'w/o L_CE' (Table 5)."),
            click.option("--beta-d", type=float, default=None, help="Fusion weight of the instance features (0.6)."),
            click.option("--beta-t", type=float, default=None, help="Fusion weight of the tree embedding (0.2)."),
            click.option("--beta-c", type=float, default=None, help="Fusion weight of the concept vector (0.2)."),
            click.option("--label-ratio", type=float, default=None,
                         help="Text label mixing r (0.35 Flickr30K / 0.4 COCO)."),
            click.option("--train-text-labels", type=click.Choice(["image", "caption"]), default=None,
                         help="Labels the text branch mixes in training: its image's (CVSE, default) or its "
                              "own. Evaluation always uses the caption's own."),
            click.option("--tree-hidden", type=int, default=None, help="Tree node hidden size (128)."),
            click.option("--forget-gate", type=click.Choice(["as-printed", "per-child"]), default=None,
                         help="Eq. 10 as printed (default) or Tai et al.'s per-child forget gates."),
            click.option("--tree-residual", is_flag=True, default=None,
                         help="Add the instance feature to the tree embedding (the paper's sentence on S_T)."),
        ]
        for option in reversed(opts):
            f = option(f)
        return common_train_options(f)
    return wrap


@click.command("smfea")
@_options()
def smfea_command(**options) -> None:
    """Train SMFEA (tree encoders with the shared referral tree + consensus concepts) on region features.

    Needs the referral trees (retr-pipeline parse-trees) and the concept data (retr-pipeline build-concepts) of
    the same manifest. After training, the tree-node accuracy of the best checkpoint on the test split is
    written to OUT/tree_accuracy.json.

    \b
    Example:
      retr-train smfea --features data/f30k/features/butd-regions.h5 --manifest data/f30k/manifest.jsonl \\
          --trees data/f30k/trees.h5 --concepts data/f30k/concepts.h5 --preset f30k --out runs/smfea-f30k
      retr-train eval runs/smfea-f30k --protocol f30k-1k
    """
    from retr.parsers.trees_file import TreeSet
    from retr.trainers.commands import run_training

    if not options["no_trees"] and not options["trees"]:
        raise UserError("--trees is required (or train the 'w/o trees' ablation with --no-trees)")
    concepts = ConceptSet(options["concepts"])
    options["num_concepts"] = len(concepts)
    vectors = options["concept_vectors"] or "learned"
    options["concept_vectors"] = vectors
    if vectors != "learned":
        options["concept_word_dim"] = vector_file_dim(vectors)
    if options["no_trees"]:
        options.update(use_trees=False, trees=None, num_entities=1, num_relations=1)
    else:
        trees = TreeSet(options["trees"])
        options.update(num_entities=len(trees.entities), num_relations=len(trees.relations))
    if options["no_kl"]:
        options["kl_weight"] = 0.0
    if options["no_node_ce"]:
        options["ce_weight"] = 0.0
    run_training("smfea", options, SMFEA_KEYS)
    if not options["no_trees"]:
        try:
            from retr.trainers.loop import resolve_device
            result = run_tree_accuracy(options["out"], "test", device=resolve_device(options["device"]))
        except UserError as exc:          # e.g. a manifest without a test split: training itself succeeded
            click.echo(f"note: no tree-node accuracy ({exc})", err=True)
            return
        click.echo(f"tree-node accuracy on test ({result['captions']} captions): text {result['text']['all']:.1f}% "
                   f"(entities {result['text']['entities']:.1f}, relations {result['text']['relations']:.1f}), "
                   f"image {result['image']['all']:.1f}%  → {Path(options['out']) / 'tree_accuracy.json'}")
