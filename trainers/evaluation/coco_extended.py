"""Evaluation that counts every true match of the COCO 5K test set: ECCV Caption (Chun et al., ECCV 2022: mAP@R,
R-Precision, R@1), CxC (Parekh et al., EACL 2021: R@1/5/10), and COCO's own 5K and 5-fold 1K recalls, all from one
``[5000, 25000]`` similarity matrix, as ``eccv_caption.Metrics.compute_all_metrics`` computes them
(docs/evaluation.md).

The annotations are the ones the ``eccv-caption`` package ships (the ``eccv`` extra), read from its installed folder
(never imported, never copied): ``coco_test_ids.npy`` (the 25,000 test caption ids in Karpathy's order) and, per
family, ``<family>_image_to_caption.json`` / ``<family>_caption_to_image.json`` (queries → positives, keyed by COCO
image ids and COCO caption ids). A matrix's rows and columns are matched to them by COCO ids (:class:`MatrixIds`:
``coco_<n>`` image ids, the manifest's caption ids), in any order.

Values are percent: 100 × the package's fraction. The places of positives and the metrics: :mod:`.ranked_positives`.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence
from importlib import metadata

import numpy as np

from retr.common.errors import UserError
from retr.trainers.evaluation.ranked_positives import (QueryRows, TopOfLists, eccv_metrics, positive_positions,
                                                       recall_at)
from retr.common.optional import locate

#: the pip package that ships the annotations, its import name, and the extra of pyproject.toml that installs it
PACKAGE, MODULE, EXTRA = "eccv-caption", "eccv_caption", "eccv"
#: the families of positives, by the names eccv_caption gives their files (``original`` is COCO's own pairs)
FILES = {"coco": "original", "cxc": "cxc", "eccv": "eccv"}
TEST_IDS_FILE = "coco_test_ids.npy"
TEST_IMAGES, TEST_CAPTIONS, COCO_1K_FOLDS = 5000, 25000, 5
#: queries each annotation file holds (the published sets; fewer means a partial file)
EXPECTED_QUERIES = {("coco", "i2t"): 5000, ("coco", "t2i"): 25000, ("cxc", "i2t"): 5000, ("cxc", "t2i"): 24972,
                    ("eccv", "i2t"): 1261, ("eccv", "t2i"): 1332}
RECALL_KS = (1, 5, 10)
#: every number of the result, named as ``compute_all_metrics`` names them, in the order they are printed
METRIC_NAMES = ("eccv_map_at_r", "eccv_rprecision", "eccv_r1", "cxc_r1", "cxc_r5", "cxc_r10",
                "coco_1k_r1", "coco_1k_r5", "coco_1k_r10", "coco_5k_r1", "coco_5k_r5", "coco_5k_r10")
#: how tables head each number
METRIC_LABELS = {"eccv_map_at_r": "ECCV mAP@R", "eccv_rprecision": "ECCV R-P", "eccv_r1": "ECCV R@1",
                 "cxc_r1": "CxC R@1", "cxc_r5": "CxC R@5", "cxc_r10": "CxC R@10",
                 **{f"coco_{n}_r{k}": f"{n.upper()} R@{k}" for n in ("1k", "5k") for k in RECALL_KS}}
#: the numbers ``retr-train table --extended`` (and the report's and a model card's table) shows, each both ways
TABLE_METRICS = METRIC_NAMES[:6]
#: the protocols whose split is the COCO 5K test set (the extended metrics always score all of it)
EXTENDED_PROTOCOLS = ("coco-5k", "coco-1k", "coco-1k-first")
#: the command that gives an existing manifest its COCO caption ids
ADD_IDS_COMMAND = "retr-pipeline manifest coco-caption-ids"
WHAT = "--extended: the ECCV Caption and CxC annotations"

_COCO_ID = re.compile(r"(?:coco_|COCO_(?:train|val|test)\d{4}_)?0*(\d+)")


# ------------------------------------------------------------------------------------------------ annotations

@dataclass(frozen=True)
class QuerySet:
    """One annotation file: its queries (COCO ids, in the file's order), each one's positives and their number."""

    queries: np.ndarray      #: [Q] int64
    positives: np.ndarray    #: [Q, P] int64 COCO ids, −1 padding
    counts: np.ndarray       #: [Q] int64: distinct positives (R)


@dataclass(frozen=True)
class Annotations:
    """The eccv-caption package's annotations: the test set and every family's queries, both directions."""

    folder: Path
    version: str
    caption_ids: np.ndarray      #: [25000] int64: the test captions, Karpathy's order (the 1K folds)
    caption_image: np.ndarray    #: [25000] int64: the COCO image of each
    sets: dict                   #: (family, "i2t" | "t2i") → :class:`QuerySet`

    @property
    def image_ids(self) -> np.ndarray:
        """[5000] int64: the test images, in Karpathy's order."""
        _, first = np.unique(self.caption_image, return_index=True)
        return self.caption_image[np.sort(first)]


def load_annotations() -> Annotations:
    """The annotations of the installed eccv-caption package; one line when it is missing (naming the extra) or a
    file of it is missing or partial."""
    folder = locate(MODULE, EXTRA, WHAT)
    return _read_annotations(str(folder / "data"))


def _reinstall(path: Path, problem: str) -> UserError:
    return UserError(f"{path} {problem}: the {PACKAGE} package is incomplete; reinstall it (pip install "
                     f"--force-reinstall {PACKAGE})")


@functools.cache
def _read_annotations(folder: str) -> Annotations:
    data = Path(folder)
    path = data / TEST_IDS_FILE
    if not path.is_file():
        raise _reinstall(path, "is missing")
    try:
        caption_ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise _reinstall(path, f"cannot be read ({exc})") from None
    if caption_ids.shape != (TEST_CAPTIONS,) or not np.issubdtype(caption_ids.dtype, np.integer) \
            or len(np.unique(caption_ids)) != TEST_CAPTIONS:
        raise _reinstall(path, f"holds {caption_ids.shape} {caption_ids.dtype} ids, not the {TEST_CAPTIONS:,} "
                               "distinct COCO 5K test caption ids")
    caption_ids = caption_ids.astype(np.int64)
    sets = {}
    for family, stem in FILES.items():
        for direction, name in (("i2t", f"{stem}_image_to_caption.json"), ("t2i", f"{stem}_caption_to_image.json")):
            sets[family, direction] = _read_query_set(data / name, EXPECTED_QUERIES[family, direction])
    coco_t2i = sets["coco", "t2i"]
    image_of = dict(zip(coco_t2i.queries.tolist(), coco_t2i.positives[:, 0].tolist()))
    if set(image_of) != set(caption_ids.tolist()) or coco_t2i.positives.shape[1] != 1:
        raise _reinstall(data / "original_caption_to_image.json", f"does not pair each of the {TEST_CAPTIONS:,} "
                                                                  f"test captions of {TEST_IDS_FILE} with its image")
    caption_image = np.array([image_of[c] for c in caption_ids.tolist()], dtype=np.int64)
    images, test_captions = set(caption_image.tolist()), set(image_of)
    for (family, direction), query_set in sets.items():
        keys = images if direction == "i2t" else test_captions
        if not set(query_set.queries.tolist()) <= keys:
            name = f"{FILES[family]}_{'image_to_caption' if direction == 'i2t' else 'caption_to_image'}.json"
            raise _reinstall(data / name, "has queries outside the COCO 5K test set")
    try:
        version = metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        version = "unknown"
    return Annotations(data.parent, version, caption_ids, caption_image, sets)


def _read_query_set(path: Path, expected: int) -> QuerySet:
    if not path.is_file():
        raise _reinstall(path, "is missing")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise _reinstall(path, f"cannot be read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise _reinstall(path, f"is not complete JSON ({exc.msg} at line {exc.lineno})") from None
    try:
        pairs = [(int(key), [int(v) for v in values]) for key, values in raw.items()]
    except (AttributeError, TypeError, ValueError):
        raise _reinstall(path, "is not a JSON object of id lists") from None
    if len(pairs) != expected or any(not values for _, values in pairs):
        raise _reinstall(path, f"holds {len(pairs):,} queries, not the {expected:,} it is published with "
                               f"(a partial file)")
    longest = max(len(values) for _, values in pairs)
    positives = np.full((len(pairs), longest), -1, dtype=np.int64)
    for row, (_, values) in enumerate(pairs):
        positives[row, :len(values)] = values
    return QuerySet(np.array([key for key, _ in pairs], dtype=np.int64), positives,
                    np.array([len(set(values)) for _, values in pairs], dtype=np.int64))


# ------------------------------------------------------------------------------------------------ matrix ids

@dataclass(frozen=True)
class MatrixIds:
    """The COCO ids of a matrix's rows (images) and columns (captions), and where they were read (``source``)."""

    image_ids: np.ndarray        #: [N] int64 COCO image id of each row
    caption_ids: np.ndarray      #: [M] int64 COCO caption id of each column, −1 where none is known
    caption_image: np.ndarray    #: [M] int64 the row of each column's image
    caption_keys: list           #: [M] ``<image id>#<n>`` of each column (messages)
    image_keys: list             #: [N] each row's id as given (messages)
    source: str


def coco_image_id(key) -> int | None:
    """The COCO image id a row id names: ``coco_391895``, ``391895``, a COCO file name
    (``COCO_val2014_000000391895.jpg``); None for anything else."""
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return int(key)
    if not isinstance(key, str):
        return None
    match = _COCO_ID.fullmatch(Path(key).stem if key.lower().endswith(".jpg") else key)
    return int(match.group(1)) if match else None


def matrix_ids(image_keys: Sequence[str], caption_keys: Sequence[str], caption_ids: Sequence, source: str,
               add_ids_hint: str | None = None) -> MatrixIds:
    """The ids of a matrix whose rows are ``image_keys`` and columns ``caption_keys`` (``<image id>#<n>``), with
    ``caption_ids`` [M] (None where unknown). Refused (one line): a row id that names no COCO image, a column
    whose image is no row. ``add_ids_hint``: how to add the caption ids (said when some are missing)."""
    images = []
    for key in image_keys:
        image = coco_image_id(key)
        if image is None:
            raise UserError(f"{source}: image {key!r} names no COCO image (expected coco_<id>, as COCO manifests "
                            "name them); --extended scores the COCO 5K test set")
        images.append(image)
    row_of = {str(key): row for row, key in enumerate(image_keys)}
    owners = []
    for key in caption_keys:
        row = row_of.get(str(key).rsplit("#", 1)[0])
        if row is None:
            raise UserError(f"{source}: caption {key} belongs to no image of its rows")
        owners.append(row)
    ids = np.array([-1 if c is None else int(c) for c in caption_ids], dtype=np.int64)
    if len(ids) != len(caption_keys):
        raise UserError(f"{source}: {len(ids)} caption ids for {len(caption_keys)} captions")
    missing = np.flatnonzero(ids < 0)
    if len(missing):
        how = add_ids_hint or f"give the manifest its ids with `{ADD_IDS_COMMAND} MANIFEST --annotations DIR`"
        raise UserError(f"{source}: {len(missing):,} of its {len(ids):,} captions have no COCO caption id (first: "
                        f"{caption_keys[missing[0]]}); --extended needs them: {how}")
    return MatrixIds(np.array(images, dtype=np.int64), ids, np.array(owners, dtype=np.int64), list(caption_keys),
                     [str(k) for k in image_keys], source)


def ids_from_records(records, manifest: str, split: str) -> MatrixIds:
    """The ids of the matrix ``eval`` ranks for ``split`` of ``manifest`` (its records, in file order)."""
    keys = [r.caption_key(n) for r in records for n in range(len(r.captions))]
    caption_ids = [None if r.caption_ids is None else r.caption_ids[n]
                   for r in records for n in range(len(r.captions))]
    return matrix_ids([r.id for r in records], keys, caption_ids, f"split {split} of {manifest}",
                      f"`{ADD_IDS_COMMAND} {manifest} --annotations DIR` adds them (nothing else changes)")


def check_protocol(protocol: str) -> None:
    """Refuse ``--extended`` with a protocol whose split is not the COCO 5K test set (one line)."""
    if protocol not in EXTENDED_PROTOCOLS:
        raise UserError(f"--extended scores the COCO 5K test set (ECCV Caption, CxC); --protocol {protocol} is not a "
                        f"COCO protocol (use {', '.join(EXTENDED_PROTOCOLS)})")


def check_test_set(annotations: Annotations, ids: MatrixIds) -> None:
    """Refuse (one line) ids that are not the COCO 5K test set: another number of rows or columns, an image or a
    caption outside it or twice, a caption id that belongs to another image than its column's."""
    n, m = len(ids.image_ids), len(ids.caption_ids)
    if (n, m) != (TEST_IMAGES, TEST_CAPTIONS):
        raise UserError(f"{ids.source}: {n:,} images and {m:,} captions; --extended scores the COCO 5K test set "
                        f"({TEST_IMAGES:,} images, {TEST_CAPTIONS:,} captions)")
    test_images = set(annotations.caption_image.tolist())
    outside = [k for k, image in zip(ids.image_keys, ids.image_ids.tolist()) if image not in test_images]
    if outside:
        raise UserError(f"{ids.source}: {len(outside):,} images are not in the COCO 5K test set (first: {outside[0]}); "
                        "--extended scores Karpathy's COCO test split")
    if len(set(ids.image_ids.tolist())) != n:
        raise UserError(f"{ids.source}: an image appears twice among its rows")
    image_of = dict(zip(annotations.caption_ids.tolist(), annotations.caption_image.tolist()))
    for m_, (key, caption, row) in enumerate(zip(ids.caption_keys, ids.caption_ids.tolist(),
                                                   ids.caption_image.tolist())):
        owner = image_of.get(caption)
        if owner is None:
            raise UserError(f"{ids.source}: caption {key} has COCO caption id {caption}, which is not one of the COCO "
                            "5K test captions")
        if owner != ids.image_ids[row]:
            raise UserError(f"{ids.source}: caption {key} has COCO caption id {caption}, a caption of COCO image "
                            f"{owner}, not of {ids.image_keys[row]}")
    if len(set(ids.caption_ids.tolist())) != m:
        raise UserError(f"{ids.source}: a COCO caption id appears twice among its captions")


# ------------------------------------------------------------------------------------------------ metrics

def _lookup(ids: np.ndarray):
    """``find(values)`` → the index of each value in ``ids`` (−1: absent or padding)."""
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]

    def find(values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.int64)
        at = np.minimum(np.searchsorted(ordered, values), len(ordered) - 1)
        return np.where((ordered[at] == values) & (values >= 0), order[at], -1)
    return find


def extended_metrics(sims: np.ndarray, ids: MatrixIds, annotations: Annotations,
                     ties: str = "pessimistic") -> dict[str, dict[str, float]]:
    """Every number of :data:`METRIC_NAMES` (percent), ``{"i2t": …, "t2i": …}`` each, for ``sims`` [N_img, M]
    whose rows and columns ``ids`` names (checked with :func:`check_test_set` first). Each query's ranked list is
    its row (i2t) or column (t2i) sorted by score, ties ordered by ``ties`` (:mod:`.ranked_positives`)."""
    sims = np.asarray(sims)
    if sims.shape != (len(ids.image_ids), len(ids.caption_ids)):
        raise UserError(f"a {sims.shape[0]} × {sims.shape[1]} matrix does not fit the {len(ids.image_ids):,} "
                        f"images × {len(ids.caption_ids):,} captions of {ids.source}")
    if not np.isfinite(sims).all():
        raise UserError("the similarity matrix contains NaN/inf (a diverged model?); cannot rank")
    row_of, col_of = _lookup(ids.image_ids), _lookup(ids.caption_ids)
    n, m = sims.shape
    views = {"i2t": _View(QueryRows(sims), n, m, lambda r: np.argsort(sims[r])[::-1], row_of, col_of),
             "t2i": _View(QueryRows(sims, columns=True), m, n,
                          lambda c: np.argsort(np.ascontiguousarray(sims[:, c]))[::-1], col_of, row_of)}
    out: dict[str, dict[str, float]] = {name: {} for name in METRIC_NAMES}
    for direction, view in views.items():
        depth = max(max(RECALL_KS), int(annotations.sets["eccv", direction].counts.max()))
        top = TopOfLists.of(view.read_rows, view.queries, view.gallery, depth)
        for family in ("coco", "cxc", "eccv"):
            query_set = annotations.sets[family, direction]
            places = view.places(top, query_set, sims, direction, ties)
            if family == "eccv":
                for key, value in eccv_metrics(places, query_set.counts).items():
                    out[f"eccv_{key}"][direction] = 100 * value
            else:
                for k in RECALL_KS:
                    out[f"{'coco_5k' if family == 'coco' else family}_r{k}"][direction] = 100 * recall_at(places, k)
    for direction, values in _coco_1k(sims, annotations, row_of, col_of, ties).items():
        for k, value in values.items():
            out[f"coco_1k_r{k}"][direction] = value
    return out


def positive_pairs(ids: MatrixIds, annotations: Annotations) -> tuple[np.ndarray, np.ndarray]:
    """``(rows [P], columns [P])``: every pair of the matrix ``ids`` names that one of the annotations' families
    counts as a positive, in either direction (a query's positives: an image's captions, a caption's images).
    ``refined`` precision rescores them, and every pair whose score is near one of theirs, in float64."""
    row_of, col_of = _lookup(ids.image_ids), _lookup(ids.caption_ids)
    rows, cols = [], []
    for (_, direction), query_set in annotations.sets.items():
        query_index, item_index = (row_of, col_of) if direction == "i2t" else (col_of, row_of)
        queries = np.repeat(query_index(query_set.queries)[:, None], query_set.positives.shape[1], axis=1)
        items = item_index(query_set.positives)
        keep = (items >= 0) & (queries >= 0)
        query, item = queries[keep], items[keep]
        rows.append(query if direction == "i2t" else item)
        cols.append(item if direction == "i2t" else query)
    keys = np.unique(np.concatenate(rows) * len(ids.caption_ids) + np.concatenate(cols))
    return keys // len(ids.caption_ids), keys % len(ids.caption_ids)


@dataclass(frozen=True)
class _View:
    """One direction of the matrix: queries as rows (``read_rows``), ``order_of`` a query's official order, and
    the maps from COCO ids to query and gallery indices."""

    read_rows: object
    queries: int
    gallery: int
    order_of: object
    query_index: object
    item_index: object

    def places(self, top: TopOfLists, query_set: QuerySet, sims: np.ndarray, direction: str,
               ties: str) -> np.ndarray:
        queries = self.query_index(query_set.queries)
        items = self.item_index(query_set.positives)
        safe = np.maximum(items, 0)
        scores = sims[queries[:, None], safe] if direction == "i2t" else sims[safe, queries[:, None]]
        return positive_positions(top, queries, items, scores, ties, self.order_of)


def _coco_1k(sims: np.ndarray, annotations: Annotations, row_of, col_of, ties: str) -> dict[str, dict[int, float]]:
    """COCO 1K as ``Metrics.coco_1k_recalls``: five folds of 5,000 test captions (Karpathy's order) and their
    images; each query ranks its fold alone (its full list with other folds' items left out); the mean of the
    folds' R@K, percent."""
    per_fold: dict[str, dict[int, list[float]]] = {"i2t": {k: [] for k in RECALL_KS}, "t2i": {k: [] for k in RECALL_KS}}
    size = TEST_CAPTIONS // COCO_1K_FOLDS
    n, m = sims.shape
    for fold in range(COCO_1K_FOLDS):
        captions = annotations.caption_ids[fold * size:(fold + 1) * size]
        images = np.unique(annotations.caption_image[fold * size:(fold + 1) * size])
        rows, cols = row_of(images), col_of(captions)
        sub = sims[np.ix_(rows, cols)]
        local_col = np.full(m, -1, dtype=np.int64)
        local_col[cols] = np.arange(len(cols))
        local_row = np.full(n, -1, dtype=np.int64)
        local_row[rows] = np.arange(len(rows))

        def i2t_order(q: int) -> np.ndarray:
            local = local_col[np.argsort(sims[rows[q]])[::-1]]
            return local[local >= 0]

        def t2i_order(q: int) -> np.ndarray:
            local = local_row[np.argsort(np.ascontiguousarray(sims[:, cols[q]]))[::-1]]
            return local[local >= 0]

        views = {"i2t": (_View(QueryRows(sub), len(rows), len(cols), i2t_order,
                               _lookup(images), _lookup(captions)), set(images.tolist())),
                 "t2i": (_View(QueryRows(sub, columns=True), len(cols), len(rows), t2i_order,
                               _lookup(captions), _lookup(images)), set(captions.tolist()))}
        for direction, (view, members) in views.items():
            query_set = annotations.sets["coco", direction]
            keep = np.array([q in members for q in query_set.queries.tolist()])
            fold_set = QuerySet(query_set.queries[keep], query_set.positives[keep], query_set.counts[keep])
            top = TopOfLists.of(view.read_rows, view.queries, view.gallery, max(RECALL_KS))
            places = view.places(top, fold_set, sub, direction, ties)
            for k in RECALL_KS:
                per_fold[direction][k].append(recall_at(places, k))
    return {direction: {k: 100 * float(np.mean(values)) for k, values in by_k.items()}
            for direction, by_k in per_fold.items()}
