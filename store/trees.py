"""``trees.h5`` and the parse shards it is merged from (both written ``.partial`` then renamed).

Datasets: ``caption_keys`` [M], ``nodes`` [M, 7] int32 (slots E1 R2 E3 R4 E5 R6 E7), ``text`` [M], ``candidates``
[M], ``failures`` [F, 2]; attributes and shards: docs/referral-trees.md ("Files, sharding and resume")."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping, Protocol, Sequence

import h5py
import numpy as np

from retr.common.atomic import atomic_hdf5
from retr.common.errors import UserError
from retr.common.version import __version__

FORMAT_VERSION = 1
_STR = h5py.string_dtype("utf-8")
#: the two fixed ids of both dictionaries (``entities[0] == relations[0] == "null"``, ``[1] == "unknown"``);
#: :mod:`retr.parsers.dictionaries` builds dictionaries around them
NULL_ID = 0
UNKNOWN_ID = 1


class Labels(Protocol):
    """What :func:`write_trees` needs of the dictionaries (:class:`retr.parsers.dictionaries.Dictionaries`)."""

    entities: list[str]
    relations: list[str]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _strings(values: Sequence[str]) -> np.ndarray:
    return np.array(list(values), dtype=object)


def _pairs(rows: Sequence[tuple[str, str]]) -> np.ndarray:
    return np.array([list(r) for r in rows], dtype=object).reshape(len(rows), 2)


def _decode(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _write_atomically(path: Path, fill) -> Path:
    with atomic_hdf5(path) as f:
        fill(f)
    return path


# ------------------------------------------------------------------------------------------------- Parse shards

def parse_shard_name(index: int, count: int) -> str:
    return f"shard-{index:05d}-of-{count:05d}.h5"


@dataclass
class ParseShard:
    """One shard's parse results: ``candidates[i]`` is the JSON tree of ``keys[i]``."""

    keys: list[str]
    candidates: list[str]
    failures: list[tuple[str, str]]
    attrs: dict


def write_parse_shard(path: str | os.PathLike, keys: Sequence[str], candidates: Sequence[str],
                      failures: Sequence[tuple[str, str]], attrs: Mapping[str, object]) -> Path:
    """Write one shard atomically (``attrs`` must identify the run: manifest hash, backend, rules, range)."""
    if len(keys) != len(candidates):
        raise ValueError("keys and candidates differ in length")

    def fill(f: h5py.File) -> None:
        for key, value in attrs.items():
            f.attrs[key] = value
        f.attrs.update({"format_version": FORMAT_VERSION, "kind": "tree-parse-shard", "created": _now(),
                        "retr_version": __version__, "num_rows": len(keys)})
        f.create_dataset("caption_keys", data=_strings(keys), dtype=_STR)
        f.create_dataset("candidates", data=_strings(candidates), dtype=_STR)
        f.create_dataset("failures", data=_pairs(failures), dtype=_STR, maxshape=(None, 2))

    return _write_atomically(Path(path), fill)


def read_parse_shard(path: str | os.PathLike) -> ParseShard | None:
    """A complete shard, or ``None`` if the file is absent, unreadable or unfinished."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        with h5py.File(path, "r") as f:
            if not f.attrs.get("complete", False):
                return None
            return ParseShard([_decode(v) for v in f["caption_keys"][:]],
                              [_decode(v) for v in f["candidates"][:]],
                              [(_decode(a), _decode(b)) for a, b in f["failures"][:]],
                              {k: (_decode(v) if isinstance(v, bytes) else v) for k, v in f.attrs.items()})
    except (OSError, KeyError):
        return None


# ----------------------------------------------------------------------------------------------------- trees.h5

def write_trees(path: str | os.PathLike, keys: Sequence[str], nodes: np.ndarray, text: Sequence[str],
                candidates: Sequence[str], failures: Sequence[tuple[str, str]], dictionaries: Labels,
                attrs: Mapping[str, object]) -> Path:
    """Write ``trees.h5`` atomically. ``nodes`` is ``[M, 7]`` int; ``attrs`` adds provenance
    (``manifest_sha256``, ``backend``, ``rules``, ``dictionaries_source``)."""
    nodes = np.asarray(nodes, dtype=np.int32).reshape(len(keys), 7)
    if not (len(keys) == len(text) == len(candidates)):
        raise ValueError("keys, text and candidates differ in length")
    if len(set(keys)) != len(keys):
        raise UserError(f"duplicate caption keys while writing {path}")

    def fill(f: h5py.File) -> None:
        for key, value in attrs.items():
            f.attrs[key] = value
        f.attrs.update({"format_version": FORMAT_VERSION, "kind": "trees", "created": _now(),
                        "retr_version": __version__, "num_rows": len(keys),
                        "entities": json.dumps(dictionaries.entities, ensure_ascii=False),
                        "relations": json.dumps(dictionaries.relations, ensure_ascii=False),
                        "null_id": NULL_ID, "unknown_id": UNKNOWN_ID,
                        "slot_order": "E1 R2 E3 R4 E5 R6 E7"})
        f.create_dataset("caption_keys", data=_strings(keys), dtype=_STR)
        f.create_dataset("nodes", data=nodes, dtype=np.int32)
        f.create_dataset("text", data=_strings(text), dtype=_STR)
        f.create_dataset("candidates", data=_strings(candidates), dtype=_STR)
        f.create_dataset("failures", data=_pairs(failures), dtype=_STR, maxshape=(None, 2))

    return _write_atomically(Path(path), fill)


class TreeSet:
    """A ``trees.h5`` read into memory: ``keys`` [M], ``nodes`` [M, 7] int32, ``text`` [M], ``entities``,
    ``relations`` (position = id), ``failures`` ``[(key, reason)]``, ``attrs``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"trees file {self.path} does not exist")
        try:
            f = h5py.File(self.path, "r")
        except OSError as exc:
            raise UserError(f"{self.path} is not a readable HDF5 file ({exc})") from None
        with f:
            if f.attrs.get("kind") != "trees" or "nodes" not in f:
                raise UserError(f"{self.path} is not a trees file (kind {f.attrs.get('kind')!r})")
            if not f.attrs.get("complete", False):
                raise UserError(f"{self.path} is incomplete (its writer did not finish); re-run parse-trees")
            self.attrs = {k: (_decode(v) if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
            self.keys = [_decode(v) for v in f["caption_keys"][:]]
            self.nodes = f["nodes"][:].astype(np.int32)
            self.text = [_decode(v) for v in f["text"][:]]
            self.failures = [(_decode(a), _decode(b)) for a, b in f["failures"][:]]
        self.entities = json.loads(self.attrs["entities"])
        self.relations = json.loads(self.attrs["relations"])
        self._rows = {key: i for i, key in enumerate(self.keys)}

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: str) -> bool:
        return key in self._rows

    def nodes_for(self, keys: Sequence[str], missing: str = "error") -> np.ndarray:
        """``[len(keys), 7]`` int32 node ids of ``keys``; a key without a tree raises (``missing="error"``)
        or gets an all-``null`` row (``missing="null"``)."""
        if missing not in ("error", "null"):
            raise ValueError("missing must be 'error' or 'null'")
        out = np.full((len(keys), 7), NULL_ID, dtype=np.int32)
        for i, key in enumerate(keys):
            row = self._rows.get(key)
            if row is not None:
                out[i] = self.nodes[row]
            elif missing == "error":
                raise UserError(f"no tree for caption {key!r} in {self.path}")
        return out

    def labels(self, row: int) -> list[str]:
        """The 7 dictionary labels of one row."""
        return [(self.entities if i % 2 == 0 else self.relations)[int(n)] for i, n in enumerate(self.nodes[row])]


def read_trees(path: str | os.PathLike) -> tuple[list[str], np.ndarray, list[str], list[str]]:
    """``(caption_keys [M], nodes [M, 7] int32, entities, relations)`` of a ``trees.h5``."""
    trees = TreeSet(path)
    return trees.keys, trees.nodes, trees.entities, trees.relations
