"""Entity and relation dictionaries: the class sets SMFEA classifies tree nodes into (ids 0 ``null``, 1 ``unknown``).

Sizes, counting, ties and reuse across datasets: docs/referral-trees.md ("Dictionaries and ids").
"""
from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import h5py

from retr.common.errors import ParameterError, UserError
from retr.parsers.referral_tree import ENTITY_SLOTS, RELATION_SLOTS, ReferralTree
from retr.store.trees import NULL_ID, UNKNOWN_ID  # the fixed ids are part of the trees.h5 contract

NULL, UNKNOWN = "null", "unknown"
FIXED = (NULL, UNKNOWN)
DEFAULT_NUM_ENTITIES = 1440
DEFAULT_NUM_RELATIONS = 247


@dataclass
class Dictionaries:
    """The entity and relation dictionaries; ``entities[i]`` is the label of entity id ``i``."""

    entities: list[str]
    relations: list[str]
    _entity_ids: dict[str, int] = field(init=False, repr=False)
    _relation_ids: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name, labels in (("entities", self.entities), ("relations", self.relations)):
            if list(labels[:2]) != list(FIXED):
                raise UserError(f"{name} dictionary must start with {list(FIXED)} (ids 0 and 1), "
                                f"got {list(labels[:2])}")
            if len(set(labels)) != len(labels):
                raise UserError(f"{name} dictionary has duplicate labels")
        self._entity_ids = {label: i for i, label in enumerate(self.entities)}
        self._relation_ids = {label: i for i, label in enumerate(self.relations)}

    def entity_id(self, candidates: Sequence[str]) -> int:
        """Id of the first known candidate; ``null`` for none, ``unknown`` if none is known."""
        return _lookup(self._entity_ids, candidates)

    def relation_id(self, candidates: Sequence[str]) -> int:
        return _lookup(self._relation_ids, candidates)

    def encode(self, tree: ReferralTree) -> np.ndarray:
        """``[7]`` int32 ids in slot order (entity ids at 0, 2, 4, 6; relation ids at 1, 3, 5)."""
        ids = np.empty(7, dtype=np.int32)
        for i in ENTITY_SLOTS:
            ids[i] = self.entity_id(tree.slots[i])
        for i in RELATION_SLOTS:
            ids[i] = self.relation_id(tree.slots[i])
        return ids

    def display_labels(self, tree: ReferralTree, ids: Sequence[int] | None = None) -> list[str]:
        """What each slot's id stands for; an unknown slot is shown as ``unknown:<its label>``."""
        ids = self.encode(tree) if ids is None else ids
        labels = []
        for i, node_id in enumerate(ids):
            names = self.entities if i in ENTITY_SLOTS else self.relations
            if node_id == UNKNOWN_ID and tree.slots[i]:
                labels.append(f"{UNKNOWN}:{tree.slots[i][-1] if i in ENTITY_SLOTS else tree.slots[i][0]}")
            else:
                labels.append(names[int(node_id)])
        return labels

    def to_json(self) -> str:
        return json.dumps({"entities": self.entities, "relations": self.relations}, ensure_ascii=False)


def _lookup(ids: dict[str, int], candidates: Sequence[str]) -> int:
    if not candidates:
        return NULL_ID
    for label in candidates:
        found = ids.get(label)
        if found is not None and found > UNKNOWN_ID:
            return found
    return UNKNOWN_ID


def _top(counts: Counter, size: int, min_count: int) -> list[str]:
    ranked = sorted((item for item in counts.items() if item[1] >= min_count and item[0] not in FIXED),
                    key=lambda item: (-item[1], item[0]))
    return list(FIXED) + [label for label, _ in ranked[:max(0, size - len(FIXED))]]


def count_labels(trees: Iterable[ReferralTree]) -> tuple[Counter, Counter]:
    """Entity-candidate and relation-label counts over ``trees``."""
    entities, relations = Counter(), Counter()
    for tree in trees:
        for i in ENTITY_SLOTS:
            entities.update(set(tree.slots[i]))
        for i in RELATION_SLOTS:
            relations.update(set(tree.slots[i]))
    return entities, relations


def build_dictionaries(trees: Iterable[ReferralTree], num_entities: int = DEFAULT_NUM_ENTITIES,
                       num_relations: int = DEFAULT_NUM_RELATIONS, min_count: int = 1) -> Dictionaries:
    """The ``num_entities`` / ``num_relations`` most frequent labels (sizes include ``null`` and ``unknown``)."""
    if num_entities < 3 or num_relations < 3:
        raise ParameterError(f"num_entities and num_relations must be at least 3 (null, unknown and one label), "
                             f"not {num_entities} and {num_relations}", "num_entities", "num_relations")
    entities, relations = count_labels(trees)
    return Dictionaries(_top(entities, num_entities, min_count), _top(relations, num_relations, min_count))


def load_dictionaries(path: str | os.PathLike) -> Dictionaries:
    """Dictionaries from a ``trees.h5`` (attributes ``entities``/``relations``) or a JSON file with both keys."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"dictionaries file {path} does not exist")
    if path.suffix in (".h5", ".hdf5"):
        try:
            with h5py.File(path, "r") as f:
                if "entities" not in f.attrs or "relations" not in f.attrs:
                    raise UserError(f"{path} has no 'entities'/'relations' attributes (not a trees file?)")
                entities = json.loads(f.attrs["entities"])
                relations = json.loads(f.attrs["relations"])
        except OSError as exc:
            raise UserError(f"{path} is not a readable HDF5 file ({exc})") from None
    else:
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
            entities, relations = body["entities"], body["relations"]
        except UnicodeDecodeError:
            raise UserError(f"{path} is not UTF-8 text (a dictionaries file is a trees.h5 or a JSON file with "
                            f"'entities' and 'relations')") from None
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UserError(f"{path} is not a dictionaries JSON file with 'entities' and 'relations' "
                            f"({exc.__class__.__name__}: {exc})") from None
    return Dictionaries([str(x) for x in entities], [str(x) for x in relations])
