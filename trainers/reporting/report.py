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
   too. Each map is drawn by its layout (:func:`map_layout`): over region boxes (SCAN, SMFEA), as a heatmap over
   the grid cells (SMAN, JGCAR), as a word strip (SEAM's hops), as referral trees (SMFEA's node ids beside the
   parsed tree); anything else as a labelled matrix. A model that implements no ``explain`` gets one line.

Images are read from the manifest's paths under ``image_root`` (default: the manifest's folder); a path that
leaves the root is not opened. Without image files the report still renders: thumbnails and region boxes are
drawn on blank canvases of the stored ``image_hw`` (grids: square), with a one-line note.

The functions here gather each piece's data; its HTML is a jinja2 template of :data:`TEMPLATES` (the ``report``
extra), rendered by :func:`render` with every value escaped. A piece comes back as :class:`markupsafe.Markup` —
built HTML, which the page's template (and the search page) embeds as is.
"""
from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from retr.common.atomic import atomic_text
from retr.common.errors import ParameterError, UserError
from retr.common.optional import require
from retr.common.version import __version__
from retr.trainers.runs import checkpoint as ckpt
from retr.trainers.reporting import draw as draw
from retr.trainers.evaluation.metrics import PROTOCOLS, coco_folds, i2t_ranks, t2i_ranks
from retr.trainers.runs.layout import EVAL

logger = logging.getLogger(__name__)

ASSETS = "assets"
THUMB, QUERY_SIDE, PANEL_SIDE = 120, 180, 150     # longest side (pixels) of retrieved, query and attention images
MAX_ROWS = 24                                     # rows of one map drawn as images (a caption's words)


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


# -------------------------------------------------------------------------------------------- images

class ImageSource:
    """The split's images read through the manifest paths under ``root`` (PIL), or blank canvases of the stored
    size where a file is missing, unreadable or outside the root."""

    def __init__(self, records, root: Path, image_hw: np.ndarray | None, exif: bool = False):
        from retr.manifests.schema import outside_root_reason

        self.records, self.root, self.image_hw, self.exif = records, Path(root), image_hw, exif
        self._outside = outside_root_reason
        self._cache: dict[int, object] = {}
        self.missing: set[int] = set()

    def image(self, i: int):
        """The PIL image of split image ``i`` (RGB), or None."""
        from PIL import Image, ImageOps

        if i in self._cache:
            return self._cache[i]
        image = None
        path = self.records[i].path
        if self._outside(path) is None:
            try:
                with Image.open(self.root / path) as raw:
                    raw.load()
                    image = (ImageOps.exif_transpose(raw) if self.exif else raw).convert("RGB")
            except (OSError, ValueError):
                image = None
        if image is None:
            self.missing.add(i)
        self._cache[i] = image
        return image

    def hw(self, i: int) -> tuple[int, int]:
        """(height, width) the features' boxes refer to: the stored ``image_hw``, else the file's, else square."""
        if self.image_hw is not None:
            return int(self.image_hw[i][0]), int(self.image_hw[i][1])
        image = self.image(i)
        return (image.height, image.width) if image is not None else (224, 224)

    def canvas(self, i: int, max_side: int):
        """Image ``i`` fitted to ``max_side``, or a blank canvas of its stored size."""
        image = self.image(i)
        if image is not None:
            return draw.fit_image(image, max_side)
        return draw.blank_canvas(self.hw(i), max_side)


class Assets:
    """Files written under ``out/assets``; ``src`` values are relative to ``index.html``."""

    def __init__(self, out: Path):
        self.out = out
        (out / ASSETS).mkdir(parents=True, exist_ok=True)
        self._thumbs: dict[tuple[int, int], str] = {}

    def save(self, image, name: str) -> str:
        draw.save_image(image, self.out / ASSETS / name)
        return f"{ASSETS}/{name}"

    def thumb(self, images: ImageSource, i: int, side: int = THUMB) -> str:
        key = (i, side)
        if key not in self._thumbs:
            canvas = images.canvas(i, side)
            if images.image(i) is None:
                from PIL import ImageDraw

                ImageDraw.Draw(canvas).text((4, canvas.height - 14), "no image file", fill=(110, 110, 110))
            self._thumbs[key] = self.save(canvas, f"img-{i:05d}-{side}.jpg")
        return self._thumbs[key]


# ----------------------------------------------------------------------------------------------- members

@dataclass
class Member:
    """One run of the report (an ensemble has several)."""

    run: str
    config: dict
    model: object
    vocab: object
    checkpoint: Path
    feature_set: object
    records: list = field(default_factory=list)          # metrics.jsonl records (typed)
    data: object = None                                   # the split (SplitData) through the run's vocabulary
    manifest: str = ""

    @property
    def name(self) -> str:
        return Path(self.run).resolve().name

    @property
    def kind(self) -> str:
        return str(self.feature_set.attrs.get("kind", ""))


def _read_metrics(run: str) -> list[dict]:
    from retr.trainers.runs.run_log import read_metrics

    try:
        return read_metrics(run)
    except UserError:
        return []


def _load_members(runs: Sequence[str], split: str, which: str, device: torch.device, trust: bool,
                  features: str | None, manifest: str | None) -> list[Member]:
    """Each run opened on ``split`` as eval opens it (:func:`retr.trainers.runs.split.open_run_split`)."""
    from retr.trainers.runs.split import open_run_split

    members = []
    for run in runs:
        opened = open_run_split(run, split, features, manifest, which, device, trust)
        members.append(Member(str(run), opened.config, opened.model, opened.vocab,
                              ckpt.resolve_checkpoint(run, which), opened.features, _read_metrics(str(run)),
                              opened.data, opened.manifest_path))
    return members


# ------------------------------------------------------------------------------------------------ attention

def map_layout(shape: Sequence[int], is_float: bool, positions: Sequence[int], num_tokens: int, kind: str,
               has_boxes: bool) -> str:
    """How a map of ``shape`` is drawn: ``tree`` (7 integer node ids), ``boxes`` (last dim = the image's
    regions: ``positions`` holds K and the image's real count, since a model may drop the padding; with boxes),
    ``grid`` (last dim = K square grid cells of a ``grid``/``maps`` set), ``words`` (last dim = the caption's
    tokens, ``<start>``/``<end>`` included as every model encodes them, or the first ones for a model that cuts
    captions, as JGCAR's ``max_words``), else ``matrix``."""
    size = int(np.prod(shape)) if len(shape) else 1
    last = int(shape[-1]) if len(shape) else 1
    if not is_float:
        return "tree" if size % 7 == 0 and last == 7 else "matrix"
    if last in positions and kind == "regions" and has_boxes:
        return "boxes"
    if last in positions and kind in ("grid", "maps") and int(np.sqrt(last)) ** 2 == last:
        return "grid"
    if 0 < last <= num_tokens:       # every token, or the first ones (a model that cuts captions)
        return "words"
    return "matrix"


def _rows(array: np.ndarray) -> np.ndarray:
    """A map as rows ``[R, last]``: leading size-1 dims dropped, others flattened."""
    array = np.asarray(array)
    if array.ndim == 0:
        return array.reshape(1, 1)
    return array.reshape(-1, array.shape[-1])


def _row_labels(name: str, count: int, tokens: list[str]) -> list[str]:
    if count == len(tokens):
        return list(tokens)
    return [name] if count == 1 else [f"{name}[{r}]" for r in range(count)]


@dataclass
class Pair:
    """An (image, caption) pair to explain: ``why`` says which (true image, or the model's top-1)."""

    image: int
    caption: int
    why: str
    rank_note: str


class Explainer:
    """Runs each member's ``explain`` on pairs and turns the maps into HTML and images."""

    def __init__(self, member: Member, data_ids: list[str], captions: list[str], images: ImageSource,
                 assets: Assets, device: torch.device, caption_keys: list[str]):
        self.m, self.ids, self.captions, self.images, self.assets = member, data_ids, captions, images, assets
        self.device, self.caption_keys = device, caption_keys
        fs = member.feature_set
        self.positions = int(fs.feature_shape[0])
        self.has_boxes = "boxes" in fs.datasets
        self._trees = None

    @torch.no_grad()
    def maps(self, pair: Pair) -> tuple[dict[str, torch.Tensor], list[str], int]:
        """(explain's maps, the caption's token words, the image's real positions) of ``pair``."""
        from retr.trainers.data.splits import ImageFeatures, pad_tokens

        model, vocab = self.m.model, self.m.vocab
        feats, mask = ImageFeatures(self.m.feature_set, [self.ids[pair.image]], preload=True).get([0])
        ids = vocab.encode(self.captions[pair.caption])
        tokens, lengths = pad_tokens([ids])
        images = model.encode_images(feats.to(self.device), mask.to(self.device))
        captions = model.encode_captions(tokens.to(self.device), lengths.to(self.device))
        return model.explain(images, captions), vocab.decode(ids), int(mask.sum())

    def trees(self):
        if self._trees is None:
            from retr.store.trees import TreeSet

            path = (self.m.config.get("inputs") or {}).get("trees")
            self._trees = TreeSet(path) if path and Path(path).is_file() else False
        return self._trees or None

    def section(self, pairs: list[Pair], tag: str):
        """This member's attention (HTML, :class:`markupsafe.Markup`; its drawings under the assets): a heading
        ``<h3>run — model</h3>`` on the first line, then each pair's maps, or one note saying why there are none."""
        model = self.m.model
        values = dict(run=self.m.name, model=self.m.config.get("model", "?"),
                      explains=list(getattr(model, "explains", ()) or ()), unavailable=None, pairs=[])
        if not values["explains"]:
            return render("attention.html.j2", **values)
        for p, pair in enumerate(pairs):
            try:
                maps, tokens, real = self.maps(pair)
            except NotImplementedError as exc:
                return render("attention.html.j2", **{**values, "unavailable": str(exc), "pairs": []})
            except Exception as exc:     # noqa: BLE001 - one model's failure must not lose the report
                values["pairs"].append({"failed": f"{type(exc).__name__}: {exc}"})
                continue
            trees: list[tuple[str, np.ndarray]] = []          # node-id maps: drawn together, beside the parse
            drawn = [self.draw_map(name, tensor, tokens, real, pair, f"{tag}-{p}-{n}", trees)
                     for n, (name, tensor) in enumerate(maps.items())]
            values["pairs"].append({"caption": self.captions[pair.caption], "image": self.ids[pair.image],
                                    "why": pair.why, "rank_note": pair.rank_note, "maps": [d for d in drawn if d],
                                    "trees": [name for name, _ in trees],
                                    "trees_html": self.draw_trees(trees, pair) if trees else ""})
        return render("attention.html.j2", **values)

    def draw_map(self, name: str, tensor, tokens: list[str], real: int, pair: Pair, stem: str,
                 trees: list[tuple[str, np.ndarray]]):
        """HTML (Markup; and assets) of one map; node-id maps are appended to ``trees`` instead (drawn by the
        caller) and give ``""``."""
        t = torch.as_tensor(tensor).detach().cpu()
        is_float = t.is_floating_point()
        array = t.double().numpy() if is_float else t.long().numpy()
        while array.ndim > 1 and array.shape[0] == 1:
            array = array[0]
        layout = "matrix" if name in getattr(self.m.model, "rank_maps", ()) else map_layout(
            array.shape, is_float, (self.positions, real), len(tokens), self.m.kind, self.has_boxes)
        values = dict(name=name, shape=list(t.shape), layout=layout)
        if layout == "tree":
            rows7 = array.reshape(-1, 7)
            trees.extend((name if len(rows7) == 1 else f"{name}[{r}]", row) for r, row in enumerate(rows7))
            return ""
        rows = _rows(array)
        labels = _row_labels(name, rows.shape[0], tokens)
        if layout == "words":
            width = rows.shape[1]
            return render("map.html.j2", **values, width=width, tokens=len(tokens),
                          strip=word_strip(rows, labels, tokens[:width]))
        if layout in ("boxes", "grid"):
            total = rows.shape[0]
            rows, labels = rows[:MAX_ROWS], labels[:MAX_ROWS]
            draw_row = self.box_panel if layout == "boxes" else self.grid_panel
            plain = self.assets.save(self.images.canvas(pair.image, PANEL_SIDE), f"att-{stem}-image.jpg")
            panels = [{"src": self.assets.save(draw_row(pair.image, row), f"att-{stem}-{r:02d}.jpg"), "label": label,
                       "max": float(row.max())} for r, (row, label) in enumerate(zip(rows, labels))]
            return render("map.html.j2", **values, drawn=len(panels), total=total, image_src=plain,
                          image_id=self.ids[pair.image], panels=panels,
                          alpha=draw.BOX_ALPHA if layout == "boxes" else draw.HEAT_ALPHA, cmap=draw.HEAT_CMAP,
                          uniform=1 / max(1, min(rows.shape[1], real)))      # every real position weighted alike
        cols = [str(c) for c in range(rows.shape[1])]
        draw.matrix_png(self.assets.out / ASSETS / f"att-{stem}.png", rows, labels, cols,
                        f"{name} (no place on the image for this shape)")
        return render("map.html.j2", **values, src=f"{ASSETS}/att-{stem}.png")

    def box_panel(self, image: int, weights: np.ndarray):
        fs = self.m.feature_set
        row = fs.rows_of([self.ids[image]])
        boxes = fs.read_rows(row, "boxes")[0]
        count = int(fs.read_rows(row, "num_boxes").reshape(-1)[0]) if "num_boxes" in fs.datasets else len(boxes)
        canvas = self.images.canvas(image, PANEL_SIDE)
        scaled = draw.scale_boxes(boxes[:count], self.images.hw(image), canvas.size)
        return draw.shade_boxes(canvas, scaled, draw.scale_unit(weights[:count]))

    def grid_panel(self, image: int, weights: np.ndarray):
        return draw.grid_heatmap(self.images.canvas(image, PANEL_SIDE), draw.scale_unit(weights))

    def draw_trees(self, predicted: list[tuple[str, np.ndarray]], pair: Pair):
        """The caption's parsed referral tree (the run's trees.h5) beside each predicted one, named from the
        trees file's dictionaries (Markup)."""
        trees = self.trees()
        if trees is None:
            return render("trees.html.j2", tables=None, predicted=[(name, [int(n) for n in row])
                                                                   for name, row in predicted])
        key = self.caption_keys[pair.caption]
        parsed = trees.nodes_for([key], missing="null")[0]
        tables = [tree_html(f"parsed ({'trees.h5' if key in trees else 'no tree in trees.h5'})", parsed,
                            trees.entities, trees.relations)]
        tables += [tree_html(f"predicted: {name}", row, trees.entities, trees.relations) for name, row in predicted]
        return render("trees.html.j2", tables=tables, predicted=predicted)


def tree_html(title: str, nodes: Sequence[int], entities: list[str], relations: list[str]):
    """A referral tree (slots ``[E1 R2 E3 R4 E5 R6 E7]``, in-order) as a three-level table (Markup): R4 on top, R2
    and R6 below it, the entities at the bottom; a node id outside the dictionaries as ``#id``."""
    def name(slot: int) -> str:
        table = entities if slot % 2 == 0 else relations
        n = int(nodes[slot])
        return table[n] if 0 <= n < len(table) else f"#{n}"

    return render("tree.html.j2", title=title, names=[name(slot) for slot in range(7)])


def word_strip(rows: np.ndarray, labels: Sequence[str], words: Sequence[str]):
    """Weights over words ``[R, L]`` as a table (Markup): one line per row (a hop), each word's background
    :data:`~retr.trainers.reporting.draw.HIGHLIGHT` at opacity w / the row's largest (the raw weight in its tooltip)."""
    lines = [{"label": label, "max": float(row.max()), "uniform": 1 / max(1, row.size),
              "cells": [{"word": word, "weight": float(w), "alpha": float(a)}
                        for word, w, a in zip(words, row, draw.scale_unit(row))]}
             for label, row in zip(labels, rows)]
    return render("word_strip.html.j2", lines=lines, colour=draw.HIGHLIGHT)


# ---------------------------------------------------------------------------------------------- the report

#: the report's jinja2 templates (package data: ``pyproject.toml``'s ``package-data``)
TEMPLATES = Path(__file__).resolve().parent / "templates"


@functools.cache
def _environment():
    """The jinja2 environment of :data:`TEMPLATES` (the ``report`` extra): every value autoescaped unless it is
    built HTML (:class:`markupsafe.Markup`: another template's output, the CSS), a missing value an error."""
    jinja2 = require("jinja2", "report", "the report's pages")
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True, trim_blocks=True,
                              lstrip_blocks=True, undefined=jinja2.StrictUndefined)


def render(template: str, **values):
    """``template`` of :data:`TEMPLATES` rendered with ``values`` (escaped there), as :class:`markupsafe.Markup`:
    built HTML that another template embeds as is."""
    html = _environment().get_template(template).render(**values)
    return require("markupsafe", "report", "the report's pages").Markup(html)


def _metrics_table(result: dict):
    """The protocol's numbers of ``result`` (eval's dict) as a table (Markup), and its ECCV Caption and CxC
    numbers when it has them (``--extended``)."""
    from retr.trainers.evaluation.coco_extended import METRIC_LABELS, METRIC_NAMES

    return render("metrics.html.j2", result=result, extended_names=METRIC_NAMES, extended_labels=METRIC_LABELS)


def _stored_results(runs: Sequence[str]):
    """The results stored in the ``eval.json`` of ``runs`` as a table with its notes (Markup; the search page
    shows it too)."""
    from retr.trainers.evaluation.runs import table_rows

    from retr.trainers.evaluation.runs import has_extended

    with_eval = [r for r in runs if (Path(r) / EVAL).is_file()]
    if not with_eval:
        return render("stored.html.j2", header=None, rows=[], notes=[], title=None)
    header, rows, notes = table_rows(with_eval)
    tables = render("stored.html.j2", header=header, rows=rows, notes=notes, title=None)
    if has_extended(with_eval):
        header, rows, notes = table_rows(with_eval, extended=True)
        tables += render("stored.html.j2", header=header, rows=rows, notes=notes,
                         title="ECCV Caption and CxC (eval --extended): every true match counted")
    return tables


def _best_epoch(records: list[dict]) -> str:
    epochs = [r for r in records if r["type"] == "epoch" and isinstance(r.get("val"), dict)]
    if not epochs:
        return "-"
    best = max(epochs, key=lambda r: r["val"]["rsum"])
    return f"epoch {int(best['epoch'])} of {len(epochs)} (val rSum {best['val']['rsum']:.1f})"


def _member_rows(members: list[Member]):
    """The summary's table of ``members`` (Markup; the search page shows it too): model, preset, seed, features,
    checkpoint, best validation epoch, parameter count."""
    rows = []
    for m in members:
        c, fs = m.config, m.feature_set
        model = c.get("model", "?") + (f" ({c['model_args']['direction']})" if (c.get("model_args") or {})
                                       .get("direction") else "")
        rows.append({"run": m.run, "model": model, "preset": c.get("preset") or "-", "seed": c.get("seed", "-"),
                     "features": fs.path, "kind": fs.attrs.get("kind"), "extractor": fs.attrs.get("extractor"),
                     "positions": fs.feature_shape[0], "dim": fs.feature_shape[1], "checkpoint": m.checkpoint.name,
                     "best": _best_epoch(m.records), "parameters": sum(p.numel() for p in m.model.parameters())})
    return render("members.html.j2", members=rows)


CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1400px; }
h1 { font-size: 22px; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 4px; margin-top: 32px; }
table { border-collapse: collapse; margin: 8px 0; } td, th { border: 1px solid #ddd; padding: 3px 7px; }
th { background: #f4f4f4; text-align: left; } .small { color: #666; font-size: 12px; }
.note { background: #fff6e0; border-left: 4px solid #f0a000; padding: 4px 10px; }
.query { border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; margin: 10px 0; }
.results { display: flex; flex-wrap: wrap; gap: 8px; align-items: flex-start; }
figure { margin: 0; text-align: center; font-size: 12px; } figure img { display: block; margin: auto; }
.truth img { outline: 4px solid #1ea03c; } .truth figcaption, li.truth { color: #13782c; font-weight: 600; }
.ellipsis { align-self: center; color: #888; font-size: 20px; }
.panels { display: flex; flex-wrap: wrap; gap: 6px; } .pair { margin: 10px 0 24px; }
.strip td { font-family: monospace; } .tree td { text-align: center; min-width: 80px; }
.tree td.rel { color: #8a3b00; } .trees { display: flex; gap: 24px; } .tree caption { font-weight: 600; }
ol { margin: 4px 0; } img.matrix { max-width: 100%; }
"""


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
    from retr.trainers.data.splits import ImageFeatures
    from retr.trainers.evaluation.two_step import encode_all, rerank_matrices

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
    from retr.common.devices import resolve_device
    from retr.manifests.schema import read_manifest, resolve_image_root
    from retr.trainers.evaluation.runs import add_extended, evaluate_runs, extended_inputs
    from retr.trainers.evaluation.metrics import protocol_metrics

    for name, value, least in (("samples", samples, 0), ("top", top, 1), ("attention", attention, 0)):
        if value < least:
            raise ParameterError(f"{name} must be ≥ {least}, not {value}", name)
    if protocol not in PROTOCOLS:
        raise ParameterError(f"protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}", "protocol")
    draw.pyplot()   # the report extra (drawings and templates), before the evaluation
    _environment()
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
    for direction, render in (("t2i", _t2i_html), ("i2t", _i2t_html)):
        for kind, picked in zip(("sampled", "worst"), chosen[direction]):
            blocks = [render(build_query(direction, int(q), i2t_sims, t2i_sims, data.caption_image, ranking, parts,
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
        version=__version__, notes=notes, members=[m.run for m in members], member_rows=_member_rows(members),
        images=result.get("images", "?"), captions=result.get("captions", "?"), source=source,
        metrics=_metrics_table(result), stored=_stored_results(runs), curves=curves, top=top, samples=samples,
        seed=seed, sections=sections, attention=attention, css=markup(CSS)))


# ----------------------------------------------------------------------------------------------- command

