"""``retr-train index`` and ``retr-train search`` (``--image``, ``--images``, ``--index``, ``--query``, ``--top``),
given what a new user gets wrong — a folder that is absent, a file where a folder goes, a folder with no image in
it, a text file named like an image, an index built by another model, an empty query, ``--top 0`` — answer with
one ``error:`` line (click's usage errors: its usage and hint first) and a non-zero exit status, and leave
nothing broken: an existing index is byte for byte as it was, and no new index folder is left behind.

The runs are VSE++ and SCAN trained for one epoch on features ``resnet152-grid`` (random weights) made from four
synthetic images, so that an image file is really embedded (``tests/test_search_images.py`` does the same).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from retr.trainers.search.index import GalleryIndex
from retr.trainers.search.retrieval import CACHE_DIR, Retriever
from test_pipeline_wrong_inputs import assert_one_error_line
from test_search_images import TRAIN, _make_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Runs, a good index of each, and one of every wrong input (names below)."""
    from conftest import CliRunnerHelper
    run_cli = CliRunnerHelper()
    root = tmp_path_factory.mktemp("search_wrong_inputs")
    data, run = _make_run(root, run_cli, "resnet152-grid", ["--image-size", "224"])
    scan = root / "run-scan"                                 # another model and checkpoint, the same features
    run_cli("train", "scan", "--features", root / "features" / "resnet152-grid.h5", "--manifest",
            data / "manifest.jsonl", "--out", scan, "--direction", "t2i", *TRAIN)
    jpegs = sorted((data / "images").glob("*.jpg"))
    p = {"photos": root / "photos", "empty": root / "empty", "notes_only": root / "notes_only",
         "broken_only": root / "broken_only", "other_files": root / "other_files", "missing": root / "missing",
         "a_file": root / "a_file.jpg", "notes": root / "notes.txt", "text_jpg": root / "text.jpg",
         "truncated": root / "truncated.jpg", "index": root / "photos.index", "scan_index": root / "scan.index",
         "damaged_index": root / "damaged.index", "garbled_index": root / "garbled.index"}
    for name in ("photos", "empty", "notes_only", "broken_only", "other_files"):
        p[name].mkdir()
    for jpeg in jpegs[:2]:
        shutil.copy(jpeg, p["photos"] / jpeg.name)
    shutil.copy(jpegs[2], p["a_file"])
    (p["notes_only"] / "notes.txt").write_text("where the photos were taken")
    p["notes"].write_text("where the photos were taken")
    p["text_jpg"].write_text("a text file named like an image")
    p["truncated"].write_bytes(jpegs[3].read_bytes()[:200])
    shutil.copy(p["text_jpg"], p["broken_only"] / "a.jpg")
    shutil.copy(p["truncated"], p["broken_only"] / "b.jpg")
    (p["other_files"] / "thesis.tex").write_text("\\documentclass{article}")
    common = ["--device", "cpu", "--workers", "0", "--quiet"]
    run_cli("train", "index", run, "--images", p["photos"], "--out", p["index"], *common)
    run_cli("train", "index", scan, "--images", p["photos"], "--out", p["scan_index"], *common)
    for name in ("damaged_index", "garbled_index"):
        shutil.copytree(p["index"], p[name])
    (p["damaged_index"] / "shard-00000.pt").write_bytes(b"half a shard")
    (p["garbled_index"] / "meta.json").write_text("{not json")
    return run, scan, p


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root``: its path inside and its bytes."""
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def _cases(run, scan, p):
    """``name → (argv, the message's telling part)``; every case is refused."""
    index = ["index", run, "--device", "cpu", "--workers", "0", "--quiet"]
    search = ["search", run, "--device", "cpu", "--quiet"]
    query = ["--query", "a small red circle"]
    return {
        # retr-train index
        "index --images absent": ([*index, "--images", p["missing"], "--out", p["index"]], "does not exist"),
        "index --images a file": ([*index, "--images", p["a_file"], "--out", p["index"]], "is a file"),
        "index --images empty folder": ([*index, "--images", p["empty"], "--out", p["index"]], "holds no files"),
        "index --images only notes.txt": ([*index, "--images", p["notes_only"], "--out", p["index"]],
                                          "holds no image files: 1 other file (notes.txt)"),
        "index --images only broken images": ([*index, "--images", p["broken_only"], "--out", p["missing"]],
                                              "no usable image to index: 2 unusable images"),
        "index --out another model's index": ([*index, "--images", p["photos"], "--out", p["scan_index"]],
                                              "built with another checkpoint"),
        "index --out a folder of other files": ([*index, "--images", p["photos"], "--out", p["other_files"]],
                                                "not a gallery index (no meta.json) and holds other files"),
        "index --out the images folder": ([*index, "--images", p["photos"], "--out", p["photos"]],
                                          "not a gallery index (no meta.json) and holds other files"),
        "index --out a file": ([*index, "--images", p["photos"], "--out", p["a_file"]], "is a file"),
        "index --out a damaged index": ([*index, "--images", p["photos"], "--out", p["damaged_index"]],
                                        "is damaged"),
        "index --out a garbled meta.json": ([*index, "--images", p["photos"], "--out", p["garbled_index"]],
                                            "meta.json is damaged"),
        "index --shard-size 0": ([*index, "--images", p["photos"], "--out", p["index"], "--shard-size", "0"],
                                 "--shard-size must be ≥ 1"),
        "index --images and --manifest": ([*index, "--images", p["photos"], "--manifest", p["notes"], "--out",
                                           p["index"]], "give one of --images DIR or --manifest FILE"),
        # retr-train search --image
        "search --image ''": ([*search, "--image", ""], "--image is empty"),
        "search --image absent": ([*search, "--image", p["missing"] / "dog.jpg"], "no image file or folder"),
        "search --image a text file": ([*search, "--image", p["notes"]], "notes.txt cannot be used"),
        "search --image text named .jpg": ([*search, "--image", p["text_jpg"]], "text.jpg cannot be used"),
        "search --image truncated": ([*search, "--image", p["truncated"]], "truncated.jpg cannot be used"),
        "search --image empty folder": ([*search, "--image", p["empty"]], "holds no files"),
        "search --image folder of notes": ([*search, "--image", p["notes_only"]], "holds no image files"),
        # retr-train search --images
        "search --images absent": ([*search, *query, "--images", p["missing"]], "does not exist"),
        "search --images a file": ([*search, *query, "--images", p["a_file"]], "is a file"),
        "search --images empty folder": ([*search, *query, "--images", p["empty"]], "holds no files"),
        "search --images only notes.txt": ([*search, *query, "--images", p["notes_only"]], "holds no image files"),
        "search --images only broken images": ([*search, *query, "--images", p["broken_only"]],
                                               f"error: {p['broken_only']}: no usable image to index: 2 unusable"),
        "search --images and --index": ([*search, *query, "--images", p["photos"], "--index", p["index"]],
                                        "not both"),
        # retr-train search --index
        "search --index absent": ([*search, *query, "--index", p["missing"]],
                                  "does not exist (expected a gallery index folder)"),
        "search --index a file": ([*search, *query, "--index", p["a_file"]], "is a file"),
        "search --index empty folder": ([*search, *query, "--index", p["empty"]], "(no meta.json)"),
        "search --index another model's": ([*search, *query, "--index", p["scan_index"]],
                                           "built with another checkpoint"),
        "search --index damaged": ([*search, *query, "--index", p["damaged_index"]], "is damaged"),
        "search --index garbled meta.json": ([*search, *query, "--index", p["garbled_index"]],
                                             "meta.json is damaged"),
        "search --index ivf on 2 images": ([*search, *query, "--index", p["index"], "--vector-index", "ivf"],
                                           "needs at least 39 gallery images"),
        # retr-train search: queries and counts
        "search --query ''": ([*search, "--query", ""], "has no words"),
        "search --query spaces": ([*search, "--query", "   "], "has no words"),
        "search --top 0": ([*search, *query, "--top", "0"], "--top must be ≥ 1, not 0"),
        "search --top -3": ([*search, *query, "--top", "-3"], "--top must be ≥ 1, not -3"),
        "search --shortlist 0": ([*search, *query, "--shortlist", "0"], "--shortlist"),
        "search --split absent": ([*search, *query, "--split", "holiday"], "holiday"),
        "search scan --vector-index hnsw": (["search", scan, *query, "--vector-index", "hnsw", "--device", "cpu"],
                                            "add --shortlist N"),
    }


def _names() -> list[str]:
    """The case names (collected before the fixture exists: placeholder paths)."""
    class Paths(dict):
        def __missing__(self, key):
            return Path(key)
    return list(_cases(Path("run"), Path("scan"), Paths()))


@pytest.mark.parametrize("name", _names())
def test_a_wrong_input_is_one_error_line_and_leaves_nothing_broken(setup, run_cli, name):
    run, scan, p = setup
    argv, telling = _cases(run, scan, p)[name]
    watched = [p[k] for k in ("index", "scan_index", "damaged_index", "garbled_index", "other_files", "photos")]
    before = {folder: _snapshot(folder) for folder in watched}
    caches = {r: _snapshot(r / CACHE_DIR) for r in (run, scan)}
    code, stdout, stderr = run_cli.as_user("train", *argv)
    assert_one_error_line(code, stdout, stderr)
    assert telling in stderr, stderr
    assert {folder: _snapshot(folder) for folder in watched} == before
    assert not p["missing"].exists()
    for r in (run, scan):                  # a refused search leaves no folder index in the run's cache
        assert not [f for f in _snapshot(r / CACHE_DIR) if f not in caches[r] and f.startswith("folder-")]


def test_the_indexes_refused_above_still_serve(setup):
    """After every refusal the good index still loads and searches (the cases run in any order)."""
    run, _scan, p = setup
    r = Retriever.from_run(run, device="cpu", index=p["index"])
    assert sorted(r.image_ids) == sorted(f.name for f in p["photos"].iterdir())
    assert len(r.text_to_images(["a small red circle"], k=2)[0].hits) == 2
    assert sorted(GalleryIndex(p["index"]).load()[0]) == sorted(r.image_ids)
