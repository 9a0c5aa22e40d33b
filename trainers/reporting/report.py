"""``retr-train show``: a self-contained static HTML report of one run or an ensemble.

``write_report(runs, protocol, out)`` writes ``out/index.html`` and its images under ``out/assets/`` (JPEG and
PNG, relative links only: no server, no external URL; the folder can be copied or zipped as is). Sections:

1. **summary** — each member's model, preset, seed, features, checkpoint and best validation epoch; the
   numbers of ``protocol`` on ``split`` computed for the report through ``eval_commands.evaluate_runs`` (the
   same code as ``retr-train eval``), or read from a matrix ``eval --save-sims`` wrote (``sims=``); the results
   already stored in the runs' ``eval.json``.
2. **curves** — the training loss at every logged step and validation R@1 / rSum after every epoch, from each
   member's ``metrics.jsonl`` (:func:`retr.trainers.reporting.draw.curves_png`).
3. **queries** — text→image and image→text: ``samples`` queries drawn with ``seed`` and the ``samples`` worst
   (the largest 0-based rank of the ground truth, ties by query order), each with its ``top`` retrieved items,
   their scores, the ground truth framed/marked and its rank. Ranks are eval's (:mod:`retr.trainers.evaluation.metrics`:
   ties against the query, i2t the best true caption) on the matrix eval ranks: the averaged matrix of an
   ensemble; for a two-step run (JGCAR) each direction's re-ranked matrix (:func:`retr.trainers.evaluation.two_step.
   rerank_matrices`); within each 1K fold for ``coco-1k`` and in the first fold only for ``coco-1k-first``.
4. **attention** — per member, the maps ``model.explain(image, caption)`` returns for the first ``attention``
   sampled text→image queries, with their true image and, when the model ranked another image first, that one
   too. Each map is drawn by its layout (:func:`~retr.trainers.reporting.explain.map_layout`): over region boxes
   (SCAN, SMFEA), as a heatmap over the grid cells (SMAN, JGCAR), as a word strip (SEAM's hops), as referral trees
   (SMFEA's node ids beside the parsed tree); anything else as a labelled matrix. A model that implements no
   ``explain`` gets one line.

Images are read from the manifest's paths under ``image_root`` (default: the manifest's folder); a path that
leaves the root is not opened. Without image files the report still renders: thumbnails and region boxes are
drawn on blank canvases of the stored ``image_hw`` (grids: square), with a one-line note.

The functions here gather each piece's data; the attention is drawn by :mod:`~retr.trainers.reporting.explain`,
the HTML comes from the templates of :mod:`~retr.trainers.reporting.html` (both shared with the search page).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from retr.common.atomic import atomic_text
from retr.common.devices import resolve_device
from retr.common.errors import ParameterError
from retr.common.optional import require
from retr.common.version import __version__
from retr.manifests.schema import read_manifest, resolve_image_root
from retr.trainers.data.splits import ImageFeatures
from retr.trainers.evaluation.metrics import PROTOCOLS, coco_folds, i2t_ranks, protocol_metrics, t2i_ranks
from retr.trainers.evaluation.runs import add_extended, evaluate_runs, extended_inputs
from retr.trainers.evaluation.two_step import encode_all, rerank_matrices
from retr.trainers.reporting import draw
from retr.trainers.reporting.explain import ASSETS, Assets, Explainer, ImageSource, Pair
from retr.trainers.reporting.html import (CSS, Member, environment, member_rows, metrics_table, render, run_metrics,
                                          stored_results)
from retr.trainers.runs import checkpoint as ckpt
from retr.trainers.runs.split import open_run_split

logger = logging.getLogger(__name__)

QUERY_SIDE = 180                      # longest side (pixels) of a query's image


# ------------------------------------------------------------------------------------------ ranks and queries

def galleries(protocol: str, num_images: int, caption_image: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """The candidate sets ``protocol`` ranks within: ``[(image start, image stop, caption columns [m])]`` —
    the whole split, the five 1K folds (``coco-1k``) or the first fold (``coco-1k-first``)."""
    if protocol == "coco-1k":
        parts = coco_folds(num_images)
    elif protocol == "coco-1k-first":
        parts = coco_folds(num_images)[:1]
    else:
        parts = [(0, num_images)]
    return [(a, b, np.flatnonzero((caption_image >= a) & (caption_image < b))) for a, b in parts]


@dataclass
class Ranking:
    """Ranks of every query the protocol evaluates: ``i2t`` ``[N_img]``, ``t2i`` ``[M]`` (0-based, eval's
    definition; -1 for a query outside the protocol, e.g. folds 2–5 under ``coco-1k-first``)."""

    i2t: np.ndarray
    t2i: np.ndarray
    gallery_of_image: np.ndarray      # [N_img] index into the galleries, -1 outside
    gallery_of_caption: np.ndarray    # [M]


def rank_all(i2t_sims: np.ndarray, t2i_sims: np.ndarray, caption_image: np.ndarray,
             parts: list[tuple[int, int, np.ndarray]]) -> Ranking:
    """Eval's ranks (:func:`~retr.trainers.evaluation.metrics.i2t_ranks` / ``t2i_ranks``) of every query, each within
    its gallery: images ranked by ``t2i_sims``' columns, captions by ``i2t_sims``' rows (the same array for a
    one-step model)."""
    n_img, n_cap = i2t_sims.shape
    ranking = Ranking(np.full(n_img, -1, np.int64), np.full(n_cap, -1, np.int64),
                      np.full(n_img, -1, np.int64), np.full(n_cap, -1, np.int64))
    for g, (a, b, cols) in enumerate(parts):
        owners = caption_image[cols] - a
        ranking.i2t[a:b] = i2t_ranks(i2t_sims[a:b][:, cols], owners)
        ranking.t2i[cols] = t2i_ranks(t2i_sims[a:b][:, cols], owners)
        ranking.gallery_of_image[a:b] = g
        ranking.gallery_of_caption[cols] = g
    return ranking


def pick_queries(ranks: np.ndarray, samples: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(``samples`` queries drawn without replacement from ``rng``, the ``samples`` worst: largest rank first,
    ties in query order) among the queries with a rank (≥ 0)."""
    valid = np.flatnonzero(ranks >= 0)
    count = min(samples, valid.size)
    sampled = rng.choice(valid, size=count, replace=False) if count else valid[:0]
    worst = valid[np.argsort(-ranks[valid], kind="stable")[:count]]
    return np.asarray(sampled, dtype=np.int64), worst


@dataclass
class Query:
    """One query of the report: ``index`` (a caption for t2i, an image for i2t), its 0-based ``rank``, the
    ``top`` retrieved items ``[(item, score, is_true)]`` by decreasing score (stable), and the best-scored true
    item with its score (``truth``, ``truth_score``: the true image, or the image's best true caption)."""

    direction: str
    index: int
    rank: int
    top: list[tuple[int, float, bool]]
    truth: int
    truth_score: float


def build_query(direction: str, index: int, i2t_sims: np.ndarray, t2i_sims: np.ndarray,
                caption_image: np.ndarray, ranking: Ranking, parts, top: int) -> Query:
    """The :class:`Query` of caption ``index`` (t2i) or image ``index`` (i2t) within its gallery."""
    if direction == "t2i":
        a, b, _ = parts[ranking.gallery_of_caption[index]]
        items = np.arange(a, b)
        scores = t2i_sims[a:b, index]
        true = items == caption_image[index]
        rank = int(ranking.t2i[index])
    else:
        _, _, cols = parts[ranking.gallery_of_image[index]]
        items = cols
        scores = i2t_sims[index, cols]
        true = caption_image[cols] == index
        rank = int(ranking.i2t[index])
    order = np.argsort(-scores, kind="stable")
    best_true = int(np.flatnonzero(true)[np.argmax(scores[true])])
    return Query(direction, int(index), rank,
                 [(int(items[o]), float(scores[o]), bool(true[o])) for o in order[:top]],
                 int(items[best_true]), float(scores[best_true]))


def _load_members(runs: Sequence[str], split: str, which: str, device: torch.device, trust: bool,
                  features: str | None, manifest: str | None) -> list[Member]:
    """Each run opened on ``split`` as eval opens it (:func:`retr.trainers.runs.split.open_run_split`)."""
    members = []
    for run in runs:
        opened = open_run_split(run, split, features, manifest, which, device, trust)
        members.append(Member(str(run), opened.config, opened.model, opened.vocab,
                              ckpt.resolve_checkpoint(run, which), opened.features, run_metrics(str(run)),
                              opened.data, opened.manifest_path))
    return members


def _t2i_html(q: Query, ids, captions, keys, images: ImageSource, assets: Assets):
    """One text→image query (Markup): the caption, its top images (thumbnails written to ``assets``) with their
    scores, the true image framed, and shown after them when it ranked lower."""
    results = [{"src": assets.thumb(images, item), "id": ids[item], "score": score, "true": true}
               for item, score, true in q.top]
    truth = None
    if not any(true for _, _, true in q.top):
        truth = {"src": assets.thumb(images, q.truth), "id": ids[q.truth], "score": q.truth_score}
    return render("t2i_query.html.j2", caption=captions[q.index], key=keys[q.index], rank=q.rank + 1,
                  results=results, truth=truth)


def _i2t_html(q: Query, ids, captions, keys, images: ImageSource, assets: Assets):
    """One image→text query (Markup): the image, its top captions with their scores, true ones marked, the best
    true caption shown after them when it ranked lower."""
    results = [{"caption": captions[item], "key": keys[item], "score": score, "true": true}
               for item, score, true in q.top]
    truth = None
    if not any(true for _, _, true in q.top):
        truth = {"caption": captions[q.truth], "key": keys[q.truth], "score": q.truth_score}
    return render("i2t_query.html.j2", src=assets.thumb(images, q.index, QUERY_SIDE), id=ids[q.index],
                  rank=q.rank + 1, results=results, truth=truth)


def _two_step_matrices(member: Member, data, parts, device: torch.device, precision: str):
    """(i2t matrix, t2i matrix) ``[N_img, M]`` of a two-step run, as eval builds them, per gallery."""
    model = member.model
    dtype = torch.float32 if precision == "float32" else torch.float64
    features = ImageFeatures(member.feature_set, data.image_ids)
    images, captions = encode_all(model, data, features, device, dtype=dtype)
    n_img, n_cap = data.num_images, data.num_captions
    i2t, t2i = np.full((n_img, n_cap), np.nan), np.full((n_img, n_cap), np.nan)
    with torch.no_grad():
        for a, b, cols in parts:
            idx = torch.from_numpy(cols).to(device)
            im = {k: v[a:b] for k, v in images.items()}
            cap = {k: v[idx] for k, v in captions.items()}
            g = model.global_score(im, cap, dtype=dtype)
            i, t = rerank_matrices(g, lambda ii, cc: model.pair_score(im, cap, ii, cc, dtype=dtype), model.shortlist)
            i2t[a:b, cols] = i.double().cpu().numpy()
            t2i[a:b, cols] = t.double().cpu().numpy()
    return i2t, t2i


def _load_sims(path: str, runs: Sequence[str], split: str, image_ids: list[str], caption_keys: list[str]):
    path = path if str(path).endswith(".npy") else f"{path}.npy"
    ids_path = Path(f"{path}.ids.json")
    if not Path(path).is_file() or not ids_path.is_file():
        raise ParameterError(f"sims {path} (with {ids_path.name} beside it, from `retr-train eval --save-sims`) "
                             "does not exist", "sims")
    try:
        ids = json.loads(ids_path.read_text(encoding="utf-8"))
        matrix = np.load(path, allow_pickle=False)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ParameterError(f"sims {path} is not a matrix from `retr-train eval --save-sims` ({exc})",
                             "sims") from None
    if not isinstance(ids, dict):
        raise ParameterError(f"sims {ids_path} is not the ids file `retr-train eval --save-sims` writes", "sims")
    same_runs = sorted(str(Path(r).resolve()) for r in ids.get("runs", [])) == sorted(str(Path(r).resolve())
                                                                                      for r in runs)
    if not same_runs or ids.get("split") != split:
        raise ParameterError(f"sims {path} holds the {ids.get('split')} split of {', '.join(ids.get('runs', []))}, "
                             f"not the {split} split of {', '.join(runs)}", "sims")
    if ids.get("image_ids") != image_ids or ids.get("caption_keys") != caption_keys:
        raise ParameterError(f"sims {path}: its rows/columns are not the manifest's {split} split any more", "sims")
    if matrix.shape != (len(image_ids), len(caption_keys)) or not np.issubdtype(matrix.dtype, np.floating):
        raise ParameterError(f"sims {path} holds a {matrix.dtype} array of shape {matrix.shape}, not the "
                             f"{len(image_ids)} × {len(caption_keys)} similarities", "sims")
    return matrix.astype(np.float64, copy=False)


def write_report(runs: Sequence[str], protocol: str, out: str | Path, split: str = "test", samples: int = 5,
                 top: int = 5, seed: int = 0, attention: int = 2, image_root: str | None = None,
                 features: str | None = None, manifest: str | None = None, which: str = "best",
                 device: str = "auto", precision: str = "refined", sims: str | None = None,
                 allow_size_mismatch: bool = False, trust_checkpoint: bool = False, quiet: bool = False,
                 extended: bool = False) -> Path:
    """Write the report of ``runs`` (one run, or an ensemble) into the folder ``out``; returns ``out/index.html``.
    Sections and options: module docstring; ``extended``: ECCV Caption and CxC numbers beside the protocol's
    (:mod:`~retr.trainers.evaluation.coco_extended`)."""
    for name, value, least in (("samples", samples, 0), ("top", top, 1), ("attention", attention, 0)):
        if value < least:
            raise ParameterError(f"{name} must be ≥ {least}, not {value}", name)
    if protocol not in PROTOCOLS:
        raise ParameterError(f"protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}", "protocol")
    draw.pyplot()   # the report extra (drawings and templates), before the evaluation
    environment()
    runs = [str(r) for r in runs]
    coco = extended_inputs(runs, protocol, split, manifest) if extended else None
    t0 = time.perf_counter()
    dev = resolve_device(device)
    members = _load_members(runs, split, which, dev, trust_checkpoint, features, manifest)
    data, manifest_path = members[0].data, members[0].manifest
    by_id = {r.id: r for r in read_manifest(manifest_path, splits=[split])}
    records = [by_id[i] for i in data.image_ids]                      # the split's rows, as eval sees them
    caption_keys = [f"{r.id}#{n}" for r in records for n in range(len(r.captions))]
    parts = galleries(protocol, data.num_images, data.caption_image)

    # the matrix eval ranks, and eval's numbers
    two_step = len(members) == 1 and members[0].model.shortlist > 0
    if sims is not None:
        if two_step:
            raise ParameterError("sims: a two-step run has no single similarity matrix (one per direction)", "sims")
        matrix = _load_sims(sims, runs, split, data.image_ids, caption_keys)
        result = protocol_metrics(matrix, data, protocol, allow_size_mismatch)
        result.update(protocol=protocol, split=split, source=str(sims))
        if coco is not None:
            add_extended(result, matrix, *coco, result["ties"])
        i2t_sims = t2i_sims = matrix
    else:
        result, matrix = evaluate_runs(runs, protocol, split, features, manifest, device, precision, which,
                                       quiet=quiet, trust_checkpoint=trust_checkpoint,
                                       allow_size_mismatch=allow_size_mismatch, extended=extended)
        if two_step:
            i2t_sims, t2i_sims = _two_step_matrices(members[0], data, parts, dev, precision)
        else:
            i2t_sims = t2i_sims = matrix
    t_eval = time.perf_counter()
    ranking = rank_all(i2t_sims, t2i_sims, data.caption_image, parts)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    assets = Assets(out)
    region_set = next((m.feature_set for m in members if "image_hw" in m.feature_set.datasets), None)
    image_hw = region_set.read_rows(region_set.rows_of(data.image_ids), "image_hw") if region_set is not None else None
    exif = bool(members[0].feature_set.attrs.get("exif_orientation", False))
    root = resolve_image_root(manifest_path, image_root)
    images = ImageSource(records, root, image_hw, exif)

    # queries
    sections: dict[str, list] = {}
    chosen: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for d, (direction, ranks) in enumerate((("t2i", ranking.t2i), ("i2t", ranking.i2t))):
        chosen[direction] = pick_queries(ranks, samples, np.random.default_rng([seed, d]))
    for direction, query_html in (("t2i", _t2i_html), ("i2t", _i2t_html)):
        for kind, picked in zip(("sampled", "worst"), chosen[direction]):
            blocks = [query_html(build_query(direction, int(q), i2t_sims, t2i_sims, data.caption_image, ranking, parts,
                                         top), data.image_ids, data.captions, caption_keys, images, assets)
                      for q in picked]
            sections[f"{direction}-{kind}"] = blocks

    # attention
    pairs: list[Pair] = []
    for m in chosen["t2i"][0][:attention]:
        q = build_query("t2i", int(m), i2t_sims, t2i_sims, data.caption_image, ranking, parts, 1)
        pairs.append(Pair(q.truth, q.index, "true image", f"ranked {q.rank + 1}"))
        if not q.top[0][2]:
            pairs.append(Pair(q.top[0][0], q.index, "the model's top-1, not the true image",
                              f"score {q.top[0][1]:.4f} vs the true image's {q.truth_score:.4f}"))
    attention_sections = [Explainer(m, data.image_ids, data.captions, images, assets, dev, caption_keys)
                          .section(pairs, f"m{n}") for n, m in enumerate(members)]

    # curves
    series = [(m.name, m.records) for m in members if m.records]
    if series:
        draw.curves_png(out / ASSETS / "curves.png", series)
    curves = f"{ASSETS}/curves.png" if series else None

    t_done = time.perf_counter()
    page = _page(runs, members, result, protocol, split, sections, attention_sections, curves, images, root,
                 two_step, samples, top, seed, sims)
    index = out / "index.html"
    with atomic_text(index) as handle:
        handle.write(page)
    logger.debug(f"report: evaluation {t_eval - t0:.1f} s, queries/attention/curves {t_done - t_eval:.1f} s")
    return index


def _page(runs, members, result, protocol, split, sections, attention, curves, images: ImageSource, root,
          two_step, samples, top, seed, sims) -> str:
    """The report's page (``page.html.j2``): ``sections`` maps ``t2i-sampled`` … ``i2t-worst`` to their queries'
    HTML, ``attention`` holds each member's section, ``curves`` is the curves' asset (None: no metrics.jsonl)."""
    notes = []
    if result.get("size_mismatch"):
        mm = result["size_mismatch"]
        notes.append(f"{protocol} expects {mm['expected']} images, this split has {mm['images']}: not the "
                     "protocol's numbers")
    if images.missing:
        notes.append(f"{len(images.missing)} image file(s) not found under {root} (features only): images and "
                     "region boxes are drawn on blank canvases of the stored image size")
    if two_step:
        notes.append(f"two-step run (shortlist {members[0].model.shortlist}): each direction ranks its own "
                     "re-ranked matrix; scores outside a query's shortlist are global scores shifted below every "
                     "re-ranked one")
    if protocol == "coco-1k":
        notes.append("coco-1k: numbers are the mean over the five 1K folds; every query ranks within its fold")
    source = (f"matrix {sims} (retr-train eval --save-sims)" if sims else
              "evaluated for this report (retr-train eval's code)")
    markup = require("markupsafe", "report", "the report's pages").Markup
    return str(render(
        "page.html.j2", title=" + ".join(m.name for m in members),
        kind=f"ensemble of {len(members)} runs (averaged similarities)" if len(members) > 1 else "single run",
        protocol=protocol, split=split, generated=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        version=__version__, notes=notes, members=[m.run for m in members], member_rows=member_rows(members),
        images=result.get("images", "?"), captions=result.get("captions", "?"), source=source,
        metrics=metrics_table(result), stored=stored_results(runs), curves=curves, top=top, samples=samples,
        seed=seed, sections=sections, attention=attention, css=markup(CSS)))

