"""Drawing for ``retr-train show``: pixels only, no HTML, each by one stated rule a test reads back.

:func:`shade_boxes` (region attention), :func:`grid_heatmap` (grid attention), :func:`curves_png`,
:func:`matrix_png`; the rules: docs/trainer.md ("Reports")."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw

from retr.common.optional import require

HIGHLIGHT = (0, 200, 255)      # region tint and word-strip colour (cyan: no synthetic colour)
BOX_ALPHA = 0.6               # tint opacity of a region of weight 1
OUTLINED = 1                  # the most attended boxes outlined per panel
HEAT_ALPHA = 0.5              # heatmap opacity over the image
HEAT_CMAP = "jet"             # the colour map of the grid attention figures in SMAN's and JGCAR's papers
BLANK = (236, 236, 236)       # the canvas drawn when the image file is not available


def _matplotlib():
    """matplotlib (the ``report`` extra), imported on first use."""
    return require("matplotlib", "report", "the report's drawings")


def pyplot():
    """matplotlib's ``pyplot`` on the Agg backend (the ``report`` extra); the report and ``plot`` call it first,
    so a missing matplotlib stops them before any work."""
    _matplotlib().use("Agg")
    return require("matplotlib.pyplot", "report", "the report's drawings")


def scale_unit(weights: np.ndarray) -> np.ndarray:
    """``weights`` (any shape) divided by their largest value, clipped to [0, 1] (all zeros stay zeros)."""
    weights = np.nan_to_num(np.asarray(weights, dtype=np.float64), nan=0.0)
    top = float(weights.max()) if weights.size else 0.0
    return np.clip(weights / top, 0.0, 1.0) if top > 0 else np.zeros_like(weights)


def fit_size(hw: tuple[int, int], max_side: int) -> tuple[int, int]:
    """``(height, width)`` of ``hw`` scaled so its longer side is ``max_side`` (at least 1 pixel each)."""
    h, w = max(1, int(hw[0])), max(1, int(hw[1]))
    s = max_side / max(h, w)
    return max(1, round(h * s)), max(1, round(w * s))


def blank_canvas(hw: tuple[int, int], max_side: int) -> Image.Image:
    """A flat :data:`BLANK` canvas of the aspect of ``hw`` (height, width), longer side ``max_side``."""
    h, w = fit_size(hw, max_side)
    return Image.new("RGB", (w, h), BLANK)


def fit_image(image: Image.Image, max_side: int) -> Image.Image:
    """``image`` as RGB, resized (aspect kept) so its longer side is ``max_side``."""
    image = image.convert("RGB")
    h, w = fit_size((image.height, image.width), max_side)
    return image.resize((w, h), Image.Resampling.BILINEAR) if (w, h) != image.size else image.copy()


def box_pixels(box: Sequence[float], width: int, height: int) -> tuple[int, int, int, int]:
    """Column/row range ``(c0, r0, c1, r1)`` (end exclusive) of the pixels whose centre lies in ``box``
    (``x1, y1, x2, y2`` in canvas pixels), clipped to the canvas."""
    x1, y1, x2, y2 = (float(v) for v in box)
    c0, c1 = math.ceil(x1 - 0.5), math.ceil(x2 - 0.5)
    r0, r1 = math.ceil(y1 - 0.5), math.ceil(y2 - 0.5)
    return max(0, c0), max(0, r0), min(width, c1), min(height, r1)


def box_alpha(boxes: np.ndarray, weights: np.ndarray, width: int, height: int,
              strength: float = BOX_ALPHA) -> np.ndarray:
    """The tint opacity ``[height, width]`` of :func:`shade_boxes`: per pixel the largest ``strength · w`` of
    the boxes that hold it, 0 outside every box."""
    alpha = np.zeros((height, width), dtype=np.float64)
    for box, w in zip(np.asarray(boxes, dtype=np.float64), np.asarray(weights, dtype=np.float64)):
        c0, r0, c1, r1 = box_pixels(box, width, height)
        if c1 > c0 and r1 > r0:
            np.maximum(alpha[r0:r1, c0:c1], strength * float(np.clip(w, 0.0, 1.0)), out=alpha[r0:r1, c0:c1])
    return alpha


def shade_boxes(canvas: Image.Image, boxes: np.ndarray, weights: np.ndarray, colour=HIGHLIGHT,
                strength: float = BOX_ALPHA, outlined: int = OUTLINED) -> Image.Image:
    """``canvas`` with ``boxes`` ``[K, 4]`` (canvas pixels) tinted by ``weights`` ``[K]`` in [0, 1] (module
    docstring); the ``outlined`` heaviest boxes (weight > 0) get a 2-px outline drawn on their border."""
    base = np.asarray(canvas.convert("RGB"), dtype=np.float64)
    height, width = base.shape[:2]
    alpha = box_alpha(boxes, weights, width, height, strength)[..., None]
    out = Image.fromarray(np.round(base * (1 - alpha) + np.asarray(colour, dtype=np.float64) * alpha)
                          .clip(0, 255).astype(np.uint8))
    weights = np.asarray(weights, dtype=np.float64)
    if outlined and len(weights):
        draw = ImageDraw.Draw(out)
        for k in np.argsort(-weights, kind="stable")[:outlined]:
            if weights[k] > 0:
                c0, r0, c1, r1 = box_pixels(boxes[k], width, height)
                if c1 > c0 and r1 > r0:
                    draw.rectangle([c0, r0, c1 - 1, r1 - 1], outline=colour, width=2)
    return out


def scale_boxes(boxes: np.ndarray, image_hw: Sequence[float], canvas_size: tuple[int, int]) -> np.ndarray:
    """Boxes in original pixels (``image_hw`` = height, width) → the pixels of a canvas ``(width, height)``."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    sx = canvas_size[0] / max(1.0, float(image_hw[1]))
    sy = canvas_size[1] / max(1.0, float(image_hw[0]))
    return boxes * np.array([sx, sy, sx, sy])


def cell_bounds(index: int, side: int, size: int) -> tuple[int, int]:
    """Pixel range ``[start, stop)`` of cell ``index`` of ``side`` cells over ``size`` pixels."""
    return (index * size) // side, ((index + 1) * size) // side


def heat_colours(weights: np.ndarray, cmap: str = HEAT_CMAP) -> np.ndarray:
    """RGB ``[…, 3]`` float (0–255) of ``weights`` in [0, 1] through matplotlib's colour map ``cmap``."""
    return np.asarray(_matplotlib().colormaps[cmap](np.clip(weights, 0.0, 1.0)))[..., :3] * 255.0


def grid_heatmap(canvas: Image.Image, weights: np.ndarray, alpha: float = HEAT_ALPHA,
                 cmap: str = HEAT_CMAP) -> Image.Image:
    """``canvas`` under the ``g × g`` cell weights ``weights`` ``[g·g]`` (raster order, in [0, 1]) coloured by
    ``cmap`` at opacity ``alpha`` (docs/trainer.md, "Reports")."""
    weights = np.asarray(weights, dtype=np.float64).reshape(-1)
    side = math.isqrt(weights.size)
    if side * side != weights.size:
        raise ValueError(f"{weights.size} weights are no square grid")
    base = np.asarray(canvas.convert("RGB"), dtype=np.float64)
    height, width = base.shape[:2]
    rows = np.array([(y * side) // height for y in range(height)])     # the cell of each pixel row / column,
    cols = np.array([(x * side) // width for x in range(width)])       # the inverse of cell_bounds
    colours = heat_colours(weights.reshape(side, side), cmap)[rows][:, cols]
    return Image.fromarray(np.round(base * (1 - alpha) + colours * alpha).clip(0, 255).astype(np.uint8))


def save_image(image: Image.Image, path: Path, quality: int = 88) -> Path:
    """Save as JPEG (``.jpg``) or PNG (any other suffix); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() in (".jpg", ".jpeg"):
        image.convert("RGB").save(path, format="JPEG", quality=quality)
    else:
        image.save(path, format="PNG", optimize=True)
    return path


def curves_png(path: Path, series: list[tuple[str, list[dict]]]) -> Path:
    """Training curves of ``series`` (name, typed ``metrics.jsonl`` records) into a PNG of three panels: the
    training loss at every logged step (per pair where the run logged ``loss_mean``, else the batch's sum:
    the axis says which), validation R@1 both ways after each epoch, validation rSum after each epoch.
    Collapse events are dotted vertical lines on the loss panel. ``epoch`` is 1-based, as
    :func:`retr.trainers.runs.run_log.read_metrics` gives it."""
    plt = pyplot()
    fig, (loss_ax, r1_ax, rsum_ax) = plt.subplots(1, 3, figsize=(12, 3.4), dpi=90)
    per_pair = all("loss_mean" in r for _, records in series for r in records if r["type"] == "step")
    for n, (name, records) in enumerate(series):
        colour = f"C{n}"
        steps = [r for r in records if r["type"] == "step" and "loss" in r]
        epochs = [r for r in records if r["type"] == "epoch" and isinstance(r.get("val"), dict)]
        key = "loss_mean" if per_pair else "loss"
        loss_ax.plot([r["step"] for r in steps], [r[key] for r in steps], color=colour, linewidth=1, label=name)
        for event in (r for r in records if r["type"] == "event" and r.get("event") == "collapse" and "step" in r):
            loss_ax.axvline(event["step"], color=colour, linestyle=":", linewidth=1)
        xs = [int(r["epoch"]) for r in epochs]
        r1_ax.plot(xs, [r["val"]["i2t"]["r1"] for r in epochs], color=colour, marker="o", markersize=3,
                   label=f"{name} i2t")
        r1_ax.plot(xs, [r["val"]["t2i"]["r1"] for r in epochs], color=colour, marker="s", markersize=3,
                   linestyle="--", label=f"{name} t2i")
        rsum_ax.plot(xs, [r["val"]["rsum"] for r in epochs], color=colour, marker="o", markersize=3, label=name)
    loss_ax.set(xlabel="step", ylabel="loss per pair" if per_pair else "loss (sum over the batch)",
                title="training loss")
    r1_ax.set(xlabel="epoch", ylabel="R@1 (%)", title="validation R@1 (solid i2t, dashed t2i)")
    rsum_ax.set(xlabel="epoch", ylabel="rSum", title="validation rSum")
    for ax in (loss_ax, r1_ax, rsum_ax):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in (r1_ax, rsum_ax):
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def matrix_png(path: Path, matrix: np.ndarray, row_labels: Sequence[str], col_labels: Sequence[str],
               title: str) -> Path:
    """A labelled heat matrix of ``matrix`` ``[R, C]`` (a map with no place on the image) into a PNG; the
    colour scale is the matrix's own (colour bar beside it)."""
    plt = pyplot()
    matrix = np.asarray(matrix, dtype=np.float64)
    rows, cols = matrix.shape
    fig, ax = plt.subplots(figsize=(min(14, 1.5 + 0.28 * cols), min(10, 1.2 + 0.28 * rows)), dpi=80)
    im = ax.imshow(matrix, cmap="viridis", aspect="auto")
    ax.set_yticks(range(rows), labels=list(row_labels), fontsize=7)
    ax.set_xticks(range(cols), labels=list(col_labels), fontsize=7, rotation=90)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path

