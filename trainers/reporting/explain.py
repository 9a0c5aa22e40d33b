"""Attention drawn: what a run's model attends to for one (image, caption) pair, as the report (``retr-train
show``) and the search page (``retr-train serve``) show it.

:class:`Explainer` runs a member's ``explain`` on pairs and draws each map by its layout (:func:`map_layout`): over
region boxes, as a heatmap over grid cells, as a word strip, as referral trees, else as a labelled matrix. The
pictures come from :class:`ImageSource` (the manifest's files under an image root, or blank canvases of the stored
size) and are written by :class:`Assets` (``out/assets``, linked relatively); the pixels are :mod:`draw`'s, the
HTML :mod:`html`'s templates."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageOps

from retr.manifests.schema import outside_root_reason
from retr.store.trees import TreeSet
from retr.trainers.data.splits import ImageFeatures, pad_tokens
from retr.trainers.reporting import draw
from retr.trainers.reporting.html import Member, render

ASSETS = "assets"
THUMB, PANEL_SIDE = 120, 150          # longest side (pixels) of retrieved and attention images
MAX_ROWS = 24                         # rows of one map drawn as images (a caption's words)


class ImageSource:
    """The split's images read through the manifest paths under ``root`` (PIL), or blank canvases of the stored
    size where a file is missing, unreadable or outside the root."""

    def __init__(self, records, root: Path, image_hw: np.ndarray | None, exif: bool = False):
        self.records, self.root, self.image_hw, self.exif = records, Path(root), image_hw, exif
        self._cache: dict[int, object] = {}
        self.missing: set[int] = set()

    def image(self, i: int):
        """The PIL image of split image ``i`` (RGB), or None."""
        if i in self._cache:
            return self._cache[i]
        image = None
        path = self.records[i].path
        if outside_root_reason(path) is None:
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
                ImageDraw.Draw(canvas).text((4, canvas.height - 14), "no image file", fill=(110, 110, 110))
            self._thumbs[key] = self.save(canvas, f"img-{i:05d}-{side}.jpg")
        return self._thumbs[key]


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
        model, vocab = self.m.model, self.m.vocab
        feats, mask = ImageFeatures(self.m.feature_set, [self.ids[pair.image]], preload=True).get([0])
        ids = vocab.encode(self.captions[pair.caption])
        tokens, lengths = pad_tokens([ids])
        images = model.encode_images(feats.to(self.device), mask.to(self.device))
        captions = model.encode_captions(tokens.to(self.device), lengths.to(self.device))
        return model.explain(images, captions), vocab.decode(ids), int(mask.sum())

    def trees(self):
        if self._trees is None:
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
