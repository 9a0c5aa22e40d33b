"""``retr-train show`` (trainers/reporting/report.py, trainers/reporting/draw.py): the drawing is faithful to the numbers
(pixels read back), the queries are eval's ranks and the worst really are the largest, and the report folder is
self-contained (every ``<img>`` is a file in it, no external URL)."""
from __future__ import annotations

import html
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from retr.trainers.reporting import explain
from retr.trainers.reporting import html as page_html
from retr.trainers.reporting import report as rp
from retr.trainers.reporting import draw as draw
from retr.trainers.data.splits import SplitData
from retr.trainers.evaluation.metrics import i2t_ranks, protocol_metrics, retrieval_metrics, t2i_ranks

GREY = (100, 120, 140)


def _blend(base, colour, alpha):
    return tuple(round((1 - alpha) * b + alpha * c) for b, c in zip(base, colour))


# ------------------------------------------------------------------------------------------------- drawing

def test_box_shading_alpha_is_the_weight():
    canvas = Image.new("RGB", (100, 80), GREY)
    boxes = np.array([[5, 5, 25, 25], [40, 10, 60, 30], [70, 40, 95, 75], [0, 0, 0, 0]], dtype=float)
    weights = np.array([0.2, 0.7, 1.0, 0.0])
    pixels = np.asarray(draw.shade_boxes(canvas, boxes, weights, outlined=0)).astype(int)
    for (x1, y1, x2, y2), w in zip(boxes[:3], weights[:3]):
        inside = pixels[int(y1):int(y2), int(x1):int(x2)].reshape(-1, 3)
        expected = _blend(GREY, draw.HIGHLIGHT, draw.BOX_ALPHA * w)
        assert (inside == expected).all(), (w, inside[0], expected)
    outside = np.ones((80, 100), bool)
    for x1, y1, x2, y2 in boxes.astype(int):
        outside[y1:y2, x1:x2] = False
    assert (pixels[outside] == GREY).all()
    # the tint opacity read back from one channel of each box centre equals BOX_ALPHA · w
    for (x1, y1, x2, y2), w in zip(boxes[:3], weights[:3]):
        value = pixels[int((y1 + y2) / 2), int((x1 + x2) / 2), 0]
        alpha = (value - GREY[0]) / (draw.HIGHLIGHT[0] - GREY[0])
        assert alpha == pytest.approx(draw.BOX_ALPHA * w, abs=1 / 100)


def test_overlapping_boxes_take_the_larger_weight_and_pixel_centres_decide():
    canvas = Image.new("RGB", (40, 40), GREY)
    boxes = np.array([[0, 0, 30, 30], [10.5, 10.5, 20.5, 20.5]])
    alpha = draw.box_alpha(boxes, np.array([0.5, 0.25]), 40, 40)
    assert alpha[15, 15] == pytest.approx(0.5 * draw.BOX_ALPHA)          # the larger of the two, never the sum
    assert alpha[10, 10] == pytest.approx(0.5 * draw.BOX_ALPHA)
    small = draw.box_alpha(boxes[1:], np.array([1.0]), 40, 40)
    assert (np.argwhere(small > 0).min(0) == [10, 10]).all() and (np.argwhere(small > 0).max(0) == [19, 19]).all()
    shaded = np.asarray(draw.shade_boxes(canvas, boxes, np.array([0.5, 1.0]), outlined=1)).astype(int)
    assert tuple(shaded[10, 10]) == draw.HIGHLIGHT and tuple(shaded[19, 15]) == draw.HIGHLIGHT   # outline
    assert tuple(shaded[15, 15]) == _blend(GREY, draw.HIGHLIGHT, draw.BOX_ALPHA)                 # inside


def test_boxes_scale_from_original_pixels_to_the_canvas():
    canvas = draw.blank_canvas((448, 224), 112)           # height 448, width 224 → 56 × 112 canvas
    assert canvas.size == (56, 112)
    scaled = draw.scale_boxes(np.array([[0, 0, 224, 224], [112, 224, 224, 448]]), (448, 224), canvas.size)
    np.testing.assert_allclose(scaled, [[0, 0, 56, 56], [28, 56, 56, 112]])


def test_grid_heatmap_colours_each_cell_by_its_weight():
    side, size = 3, (90, 60)
    weights = np.linspace(0, 1, side * side)
    canvas = Image.new("RGB", size, GREY)
    pixels = np.asarray(draw.grid_heatmap(canvas, weights)).astype(int)
    colours = draw.heat_colours(weights)
    for cell, w in enumerate(weights):
        r, c = divmod(cell, side)
        x0, x1 = draw.cell_bounds(c, side, size[0])
        y0, y1 = draw.cell_bounds(r, side, size[1])
        block = pixels[y0:y1, x0:x1].reshape(-1, 3)
        expected = [round((1 - draw.HEAT_ALPHA) * g + draw.HEAT_ALPHA * k) for g, k in zip(GREY, colours[cell])]
        assert (block == expected).all(), (cell, block[0], expected)
    with pytest.raises(ValueError):
        draw.grid_heatmap(canvas, np.ones(10))


def test_word_strip_opacity_is_the_weight_over_the_largest():
    weights = np.array([[0.1, 0.4, 0.2], [0.0, 0.0, 0.0]])
    html = explain.word_strip(weights, ["hop 0", "hop 1"], ["a", "red", "cat"])
    alphas = [float(a) for a in re.findall(r"rgba\(\d+, \d+, \d+, ([0-9.]+)\)", html)]
    assert alphas == pytest.approx([0.25, 1.0, 0.5, 0.0, 0.0, 0.0])
    assert "title='0.4'" in html and "<th>hop 0</th>" in html


def test_tree_table_puts_each_slot_in_its_place():
    entities, relations = ["null", "unknown", "man", "horse", "field"], ["null", "unknown", "ride", "in"]
    html = explain.tree_html("parsed", [2, 0, 0, 2, 3, 3, 4], entities, relations)
    cells = re.findall(r"<td colspan='(\d)' class='(ent|rel)'>([^<]*)</td>", html)
    assert cells == [("4", "rel", "ride"), ("2", "rel", "null"), ("2", "rel", "in"), ("1", "ent", "man"),
                     ("1", "ent", "null"), ("1", "ent", "horse"), ("1", "ent", "field")]


@pytest.mark.parametrize("shape, is_float, kind, boxes, layout", [
    ((12, 36), True, "regions", True, "boxes"), ((36,), True, "regions", True, "boxes"),
    ((12, 36), True, "regions", False, "matrix"), ((2, 49), True, "grid", False, "grid"),
    ((196,), True, "maps", False, "grid"), ((2, 12), True, "tencrop", False, "words"),
    ((10,), True, "tencrop", False, "words"), ((7,), False, "regions", True, "tree"),
    ((2, 7), False, "regions", True, "tree"), ((3, 13), True, "grid", False, "matrix"),
    ((1, 9), True, "maps", False, "words"),                        # the first 9 of 12 tokens (JGCAR's max_words)
])
def test_map_layout(shape, is_float, kind, boxes, layout):
    positions = {"regions": 36, "grid": 49, "maps": 196, "tencrop": 10}[kind]
    assert explain.map_layout(shape, is_float, (positions, positions), 12, kind, boxes) == layout


def test_region_maps_without_padding_are_boxes():
    assert explain.map_layout((12, 30), True, (36, 30), 12, "regions", True) == "boxes"    # 30 real of 36 regions
    assert explain.map_layout((30, 12), True, (36, 30), 12, "regions", True) == "words"    # region → word (SCAN i2t)
    assert explain.map_layout((12, 29), True, (36, 30), 12, "regions", True) == "matrix"


# ---------------------------------------------------------------------------------------- ranks and queries

def _split(n_img: int, per: int = 5) -> tuple[np.ndarray, SplitData]:
    caption_image = np.repeat(np.arange(n_img), per)
    data = SplitData([f"i{i}" for i in range(n_img)], [f"c{m}" for m in range(n_img * per)], caption_image,
                     [[1, 2]] * (n_img * per))
    return caption_image, data


@pytest.mark.parametrize("protocol", ["f30k-1k", "coco-1k", "coco-1k-first"])
def test_ranks_are_evals_ranks_and_give_its_numbers(protocol):
    rng = np.random.default_rng(0)
    caption_image, data = _split(20)
    sims = rng.standard_normal((20, 100)).round(1)          # rounded: ties, counted against the query as eval does
    sims[caption_image, np.arange(100)] += 0.8
    parts = rp.galleries(protocol, 20, caption_image)
    ranking = rp.rank_all(sims, sims, caption_image, parts)
    result = protocol_metrics(sims, data, protocol, allow_size_mismatch=True)
    if protocol == "f30k-1k":
        np.testing.assert_array_equal(ranking.i2t, i2t_ranks(sims, caption_image))
        np.testing.assert_array_equal(ranking.t2i, t2i_ranks(sims, caption_image))
    per_part = [retrieval_metrics(sims[a:b][:, cols], caption_image[cols] - a) for a, b, cols in parts]
    for side, ranks, gallery in (("i2t", ranking.i2t, ranking.gallery_of_image),
                                 ("t2i", ranking.t2i, ranking.gallery_of_caption)):
        r1 = [100 * np.mean(ranks[gallery == g] < 1) for g in range(len(parts))]
        assert r1 == pytest.approx([p[side]["r1"] for p in per_part])
        assert np.mean(r1) == pytest.approx(result[side]["r1"])
        assert ((ranks >= 0) == (gallery >= 0)).all()
    if protocol == "coco-1k-first":
        assert (ranking.i2t[4:] == -1).all() and (ranking.t2i[20:] == -1).all()


def test_worst_queries_are_the_largest_ranks_and_samples_follow_the_seed():
    rng = np.random.default_rng(1)
    ranks = rng.integers(0, 50, size=200)
    ranks[::7] = -1                                          # outside the protocol: never picked
    sampled, worst = rp.pick_queries(ranks, 6, np.random.default_rng([3, 0]))
    others = np.setdiff1d(np.flatnonzero(ranks >= 0), worst)
    assert len(worst) == 6 and ranks[worst].min() >= ranks[others].max()
    assert list(ranks[worst]) == sorted(ranks[worst], reverse=True)
    assert (ranks[sampled] >= 0).all() and len(set(sampled)) == 6
    again, _ = rp.pick_queries(ranks, 6, np.random.default_rng([3, 0]))
    other, _ = rp.pick_queries(ranks, 6, np.random.default_rng([4, 0]))
    assert list(again) == list(sampled) and list(other) != list(sampled)
    few, few_worst = rp.pick_queries(np.array([-1, 2, 0]), 5, np.random.default_rng(0))
    assert sorted(few) == [1, 2] and list(few_worst) == [1, 2]


def test_query_lists_the_top_items_and_marks_the_truth():
    caption_image, _ = _split(6, per=2)
    sims = np.random.default_rng(2).standard_normal((6, 12))
    parts = rp.galleries("f30k-1k", 6, caption_image)
    ranking = rp.rank_all(sims, sims, caption_image, parts)
    for m in range(12):
        q = rp.build_query("t2i", m, sims, sims, caption_image, ranking, parts, top=3)
        assert [s for _, s, _ in q.top] == sorted(sims[:, m], reverse=True)[:3]
        assert [t for i, _, t in q.top] == [i == caption_image[m] for i, _, _ in q.top]
        assert q.truth == caption_image[m] and q.rank == ranking.t2i[m]
        assert (q.rank < 3) == any(t for _, _, t in q.top)
    for i in range(6):
        q = rp.build_query("i2t", i, sims, sims, caption_image, ranking, parts, top=4)
        assert [s for _, s, _ in q.top] == sorted(sims[i], reverse=True)[:4]
        assert caption_image[q.truth] == i and q.truth_score == sims[i, caption_image == i].max()
        assert (q.rank < 4) == any(t for _, _, t in q.top)


# --------------------------------------------------------------------------------------------- the report

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A synthetic dataset with images, a region set with boxes, a grid set, and a SCAN and a SMAN run."""
    from report_synthetic import make_images, train_tiny, write_scene_boxes, write_scene_grid

    folder = tmp_path_factory.mktemp("report")
    manifest = make_images(folder / "data", images=100)   # 10 test images: five 2-image folds
    boxes, grid = write_scene_boxes(folder / "data"), write_scene_grid(folder / "data")
    scan = train_tiny("scan", boxes, manifest, folder / "scan", "--epochs", "2")
    sman = train_tiny("sman", grid, manifest, folder / "sman", "--epochs", "2", "--shortlist", "3")
    return folder, manifest, scan, sman


def _imgs(index: Path) -> list[str]:
    return re.findall(r"<img [^>]*src='([^']+)'", index.read_text(encoding="utf-8"))


def _self_contained(index: Path) -> list[str]:
    page = index.read_text(encoding="utf-8")
    assert not re.search(r"(https?:)?//[a-z0-9]", page, re.I), "external URL in the report"
    assert not re.search(r"<(script|link|iframe)", page), "the report is static: no script, no linked file"
    srcs = _imgs(index)
    for src in srcs:
        assert not src.startswith("/") and ".." not in src
        assert (index.parent / src).is_file(), src
    return srcs


def _explain_regions(self, images, captions):
    """A stand-in explain for SCAN while it has none: each word's softmax over the image's real regions
    ``[L, K_real]``."""
    words, regions = captions["words"][0], images["regions"][0][images["mask"][0]]
    return {"word_to_region": torch.softmax(words @ regions.t(), dim=1)}


def _scan_explains(monkeypatch) -> None:
    from retr.trainers.models.scan import SCAN

    if "explain" not in SCAN.__dict__:
        monkeypatch.setattr(SCAN, "explains", ("word_to_region",), raising=False)
        monkeypatch.setattr(SCAN, "explain", _explain_regions, raising=False)


def test_report_is_complete_and_self_contained(tiny, monkeypatch, tmp_path):
    folder, manifest, scan, _ = tiny
    _scan_explains(monkeypatch)
    index = rp.write_report([str(scan)], "f30k-1k", tmp_path / "report", samples=3, top=4, attention=1,
                            allow_size_mismatch=True, quiet=True)
    page = index.read_text(encoding="utf-8")
    srcs = _self_contained(index)
    for section in ("summary", "curves", "t2i-sampled", "t2i-worst", "i2t-sampled", "i2t-worst", "attention"):
        assert f"id=\"{section}\"" in page
    assert "assets/curves.png" in srcs and "not found under" not in page
    assert len(re.findall(r"class='query t2i'", page)) == 6 and len(re.findall(r"class='query i2t'", page)) == 6
    words = int(re.search(r"<h4>\w+ <span class='small'>\[(\d+)×[1-4]\] — boxes", page).group(1))
    panels = [s for s in srcs if s.startswith("assets/att-m0-0-0-") and not s.endswith("image.jpg")]
    assert len(panels) == words                                     # one panel per caption token
    # the numbers: the report's matrix is eval's, its rank list gives eval's R@1
    from retr.trainers.evaluation.runs import evaluate_runs

    result, _ = evaluate_runs([str(scan)], "f30k-1k", allow_size_mismatch=True, quiet=True)
    assert f"<td>{result['i2t']['r1']:.1f}</td>" in page and f"<td colspan='5'>{result['rsum']:.1f}</td>" in page


def test_report_without_image_files_draws_blank_canvases_of_the_stored_size(tiny, monkeypatch, tmp_path):
    folder, manifest, scan, _ = tiny
    _scan_explains(monkeypatch)
    (tmp_path / "empty").mkdir()
    index = rp.write_report([str(scan)], "f30k-1k", tmp_path / "report", samples=2, top=3, attention=1,
                            image_root=str(tmp_path / "empty"), allow_size_mismatch=True, quiet=True)
    page = index.read_text(encoding="utf-8")
    assert "not found under" in page and "blank canvases of the stored image size" in page
    srcs = _self_contained(index)
    plain = next(s for s in srcs if s.endswith("-image.jpg"))
    image = np.asarray(Image.open(index.parent / plain)).astype(int)
    assert image.shape[:2] == (explain.PANEL_SIDE, explain.PANEL_SIDE)     # image_hw is 224 × 224: a square canvas
    assert np.abs(image - np.array(draw.BLANK)).max() <= 3               # JPEG rounding only
    panel = next(s for s in srcs if s.startswith("assets/att-") and not s.endswith("-image.jpg"))
    tinted = np.asarray(Image.open(index.parent / panel)).astype(int)
    assert np.abs(tinted - np.array(draw.BLANK)).max(axis=2).max() > 40  # the boxes are drawn on it


def test_models_without_explain_say_so_and_two_step_ranks_are_evals(tiny, tmp_path):
    from retr.trainers.evaluation.runs import evaluate_runs
    from retr.trainers.models.sman import SMAN

    folder, manifest, _, sman = tiny
    index = rp.write_report([str(sman)], "f30k-1k", tmp_path / "report", samples=2, top=3,
                            allow_size_mismatch=True, quiet=True)
    page = index.read_text(encoding="utf-8")
    _self_contained(index)
    if "explain" in SMAN.__dict__:
        assert "— grid" in page and "— words" in page           # cells over the image, weights over words
    else:
        assert "no attention maps" in page
    assert "two-step run (shortlist 3)" in page
    result, _ = evaluate_runs([str(sman)], "f30k-1k", allow_size_mismatch=True, quiet=True)
    for side in ("i2t", "t2i"):
        assert f"<th>{side}</th><td>{result[side]['r1']:.1f}</td>" in page


def test_ensemble_report_names_its_members(tiny, tmp_path):
    folder, manifest, scan, sman = tiny
    from click.testing import CliRunner

    from retr.trainers.commands import cli

    out = tmp_path / "ens"
    result = CliRunner().invoke(cli, ["show", str(scan), str(sman), "--protocol", "coco-1k", "--samples", "2",
                                      "--top", "2", "--allow-size-mismatch", "--quiet", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"report written to {out / 'index.html'}" in result.output
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "ensemble of 2 runs" in page and "members:" in page and "every query ranks within its fold" in page
    _self_contained(out / "index.html")


def test_a_saved_matrix_is_ranked_instead_of_evaluating_again(tiny, tmp_path):
    from click.testing import CliRunner

    from retr.common.errors import ParameterError
    from retr.trainers.commands import cli

    folder, manifest, scan, sman = tiny
    saved = tmp_path / "scan.npy"
    result = CliRunner().invoke(cli, ["eval", str(scan), "--protocol", "f30k-1k", "--allow-size-mismatch", "--quiet",
                                      "--save-sims", str(saved)])
    assert result.exit_code == 0, result.output
    fresh = rp.write_report([str(scan)], "f30k-1k", tmp_path / "fresh", samples=3, attention=0,
                            allow_size_mismatch=True, quiet=True).read_text(encoding="utf-8")
    index = rp.write_report([str(scan)], "f30k-1k", tmp_path / "saved", samples=3, attention=0, sims=str(saved),
                            allow_size_mismatch=True, quiet=True)
    page = index.read_text(encoding="utf-8")
    assert "--save-sims" in page
    body = lambda p: p[p.index("<table class='metrics'>"):p.index("<section id=\"attention\">")]   # noqa: E731
    assert body(page) == body(fresh)                  # the same numbers, queries and scores
    with pytest.raises(ParameterError, match="not the test split of"):
        rp.write_report([str(scan), str(sman)], "f30k-1k", tmp_path / "other", sims=str(saved),
                        allow_size_mismatch=True, quiet=True)


def test_predicted_trees_are_drawn_beside_the_parsed_one(tmp_path):
    from types import SimpleNamespace

    from retr.store.trees import write_trees

    entities, relations = ["null", "unknown", "man", "horse", "field"], ["null", "unknown", "ride", "in"]
    path = write_trees(tmp_path / "trees.h5", ["a#0"], np.array([[2, 0, 0, 2, 3, 3, 4]]), ["(ride man horse)"],
                       ["ride"], [], SimpleNamespace(entities=entities, relations=relations), {})
    fs = SimpleNamespace(feature_shape=(36, 8), datasets={}, attrs={"kind": "regions"})
    member = SimpleNamespace(feature_set=fs, config={"inputs": {"trees": str(path)}})
    explainer = explain.Explainer(member, ["a"], ["a man rides a horse"], None, None, torch.device("cpu"), ["a#0"])
    html = explainer.draw_trees([("image_tree_nodes", np.array([3, 0, 0, 2, 2, 0, 4])),
                                 ("text_tree_nodes", np.array([2, 0, 0, 2, 3, 3, 4]))], explain.Pair(0, 0, "", ""))
    captions = re.findall(r"<caption>([^<]*)</caption>", html)
    assert captions == ["parsed (trees.h5)", "predicted: image_tree_nodes", "predicted: text_tree_nodes"]
    tables = html.split("<table")[1:]
    names = [re.findall(r"class='(?:ent|rel)'>([^<]*)<", t) for t in tables]
    assert names[0] == names[2] == ["ride", "null", "in", "man", "null", "horse", "field"]   # R4 R2 R6 E1 E3 E5 E7
    assert names[1] == ["ride", "null", "null", "horse", "null", "man", "field"]
    missing = explain.Explainer(SimpleNamespace(feature_set=fs, config={"inputs": {}}), ["a"], ["x"], None, None,
                           torch.device("cpu"), ["a#0"])
    assert "not available" in missing.draw_trees([("nodes", np.arange(7))], explain.Pair(0, 0, "", ""))


def test_stored_results_mark_a_split_of_another_size_than_the_protocol(tmp_path):
    """The summary's table of stored results (the report's and the search page's) marks a result evaluated with
    --allow-size-mismatch and says in a note what was evaluated; a result of the protocol's size is unmarked."""
    from retr.trainers.evaluation.runs import record_result

    metrics = {"i2t": {"r1": 50.0, "r5": 80.0, "r10": 90.0}, "t2i": {"r1": 40.0, "r5": 70.0, "r10": 85.0},
               "rsum": 415.0, "ensemble": False}
    run = tmp_path / "vsepp-small"
    run.mkdir()
    models = [{"run": str(run), "model": "vsepp"}]
    record_result(str(run), {"protocol": "f30k-1k", "split": "test", "runs": [str(run)], "models": models,
                             "size_mismatch": {"expected": 1000, "images": 16}, **metrics})
    record_result(str(run), {"protocol": "coco-5k", "split": "test", "runs": [str(run)], "models": models,
                             **metrics})
    page = str(page_html.stored_results([str(run)]))
    cells = re.findall(r"<td>([^<]*)</td>", page)
    assert "f30k-1k*" in cells and "coco-5k" in cells and "coco-5k*" not in cells
    notes = [html.unescape(n) for n in re.findall(r"<p class='note'>([^<]*)</p>", page)]
    assert notes == ["* vsepp-small: f30k-1k on a test split of 16 images, not the protocol's 1,000 "
                     "(--allow-size-mismatch): not comparable with published numbers"], page


# ------------------------------------------------------------------------------------------------ the templates

EVIL = "<script>alert('x')</script>"


class _Thumbs:
    """Assets that write nothing: each thumbnail's ``src`` names its image."""

    def thumb(self, images, i, side=explain.THUMB):
        return f"assets/img-{i:05d}-{side}.jpg"


def _no_markup(page: str) -> None:
    """``page`` holds the injected value only as text: no tag of it, its escaped form instead."""
    assert "<script" not in page and "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in page, page


def test_templates_escape_captions_ids_and_names():
    caption_image, _ = _split(3, per=2)
    sims = np.random.default_rng(4).standard_normal((3, 6))
    parts = rp.galleries("f30k-1k", 3, caption_image)
    ranking = rp.rank_all(sims, sims, caption_image, parts)
    ids, captions, keys = [EVIL, "i1", "i2"], [EVIL] * 6, [f"{EVIL}#{m}" for m in range(6)]
    for direction, render in (("t2i", rp._t2i_html), ("i2t", rp._i2t_html)):
        for index in range(3):
            q = rp.build_query(direction, index, sims, sims, caption_image, ranking, parts, top=1)
            block = str(render(q, ids, captions, keys, None, _Thumbs()))
            _no_markup(block)
            assert html.unescape(re.search(r"«([^»]*)»", block).group(1)) == EVIL     # the caption, as text
    _no_markup(str(explain.word_strip(np.array([[0.5, 1.0]]), [EVIL], ["a", EVIL])))
    tree = str(explain.tree_html(EVIL, [2, 0, 0, 2, 3, 3, 4], ["null", "unknown", EVIL, "horse", "field"],
                            ["null", "unknown", "ride"]))
    _no_markup(tree)
    assert html.unescape(re.search(r"<caption>([^<]*)</caption>", tree).group(1)) == EVIL
    assert [html.unescape(t) for t in re.findall(r"class='ent'>([^<]*)<", tree)] == [EVIL, "null", "horse", "field"]


def test_a_run_named_with_markup_shows_as_text_in_the_report(tiny, tmp_path):
    """A run folder named ``<script>…`` (any name a file system takes): the page escapes it wherever it shows — the
    title, the heading, the summary's table — and stays free of script."""
    import shutil

    folder, manifest, scan, _ = tiny
    name = "<script>alert('x')<"                      # a folder name: no '/'
    run = tmp_path / name
    shutil.copytree(scan, run)
    index = rp.write_report([str(run)], "f30k-1k", tmp_path / "report", samples=1, top=2, attention=0,
                            allow_size_mismatch=True, quiet=True)
    page = index.read_text(encoding="utf-8")
    _self_contained(index)                            # no <script anywhere
    escaped = "&lt;script&gt;alert(&#39;x&#39;)&lt;"
    assert f"<title>retr report — {escaped}</title>" in page and f"<h1>retr report — {escaped}</h1>" in page
    assert re.search(rf"<table class='members'>.*<td>[^<]*{re.escape(escaped)}</td>", page)


def test_show_without_jinja2_stops_in_one_line_naming_the_extra(tiny, monkeypatch, tmp_path, capsys):
    """jinja2 "not installed" (``None`` in ``sys.modules`` makes its import fail as a missing module does): ``show``,
    run as the console script runs it, stops before any work with the one line of every missing extra, and writes
    no report folder."""
    import sys

    from retr.common.cli import run
    from retr.trainers.commands import cli

    folder, manifest, scan, _ = tiny
    monkeypatch.setitem(sys.modules, "jinja2", None)
    page_html.environment.cache_clear()
    out = tmp_path / "report"
    try:
        with pytest.raises(SystemExit) as exited:
            run(cli, ["show", str(scan), "--protocol", "f30k-1k", "--allow-size-mismatch", "--quiet", "--out",
                      str(out)])
    finally:
        page_html.environment.cache_clear()                 # the next report builds its environment with jinja2 back
    assert exited.value.code == 1
    assert capsys.readouterr().err == ("error: jinja2 is not installed (needed by the report's pages): "
                                       "pip install 'retr[report]' (or make setup)\n")
    assert not out.exists()
