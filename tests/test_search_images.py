"""Raw images searched through the run's own extraction, and a gallery index built once and grown.

Runs trained for one epoch on features the real extractors (random weights) made from four synthetic images, so
that a stored image given again as a file can be compared with its stored row.
"""
from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from retr.common.errors import MissingResourceError, UserError
from retr.manifests.schema import read_manifest
from retr.manifests.synthetic import generate_synthetic
from retr.store.features import FeatureSet, ShardWriter
from retr.trainers.search import images as search_images
from retr.trainers.search.images import FeatureMaker, extraction_options
from retr.trainers.search.index import GalleryIndex
from retr.trainers.search.retrieval import Retriever

pytestmark = pytest.mark.slow
TRAIN = ["--embed-size", "16", "--word-dim", "8", "--batch-size", "4", "--quiet", "--val-images", "1",
         "--device", "cpu", "--epochs", "1"]
# speed options of test_butd_extract (its random detector is reused in one process)
BUTD = ["--short-side", "96", "--max-side", "128", "--pre-nms-topk", "600", "--post-nms-topk", "40",
        "--pooled-size", "7"]
#: a stored row's embedding was made in a batch of the split's images, a file's alone: float32 encoder rounding
EMBED_ATOL = 1e-6


def _make_run(folder, run_cli, extractor, options, seed=0):
    data = folder / "data"
    if not data.exists():
        generate_synthetic(data, num_images=4, seed=0)
    run_cli("pipeline", "extract", "--manifest", data / "manifest.jsonl", "--extractor", extractor, "--weights",
            "random", "--out", folder / "features", "--workers", "0", "--device", "cpu", "--quiet",
            *options)                                   # the device the searches below embed new images on
    run = folder / f"run-{seed}"
    run_cli("train", "vsepp", "--features", folder / "features" / f"{extractor}.h5", "--manifest",
            data / "manifest.jsonl", "--out", run, "--seed", seed, *TRAIN)
    return data, run


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    from conftest import CliRunnerHelper
    folder = tmp_path_factory.mktemp("grid")
    data, run = _make_run(folder, CliRunnerHelper(), "resnet152-grid", ["--image-size", "224"])
    return data, run, folder


def _path_of(data, image_id):
    return next(data / r.path for r in read_manifest(data / "manifest.jsonl") if r.id == image_id)


def _same_as_stored_row(run, data):
    r = Retriever.from_run(run, device="cpu")
    image_id = r.data.image_ids[0]
    path = _path_of(data, image_id)
    features, mask = r.feature_maker([path])
    fs = r.feature_set
    row = fs.rows_of([image_id])
    # equal, not close: the same network (seeded random weights) on the same pixels in this process, one image a
    # forward both times, rounded through the stored float16
    np.testing.assert_array_equal(features.numpy(), fs.read_rows(row).astype(np.float32))
    stored_mask = (np.arange(fs.feature_shape[0]) < fs.read_rows(row, "num_boxes")[0]
                   if "num_boxes" in fs.datasets else np.ones(fs.feature_shape[0], bool))
    assert mask[0].numpy().tolist() == stored_mask.tolist()
    [by_id], [by_file] = r.image_to_texts([image_id], k=6), r.image_to_texts([str(path)], k=6)
    assert by_file.query == str(path)
    assert [h.caption_index for h in by_file.hits] == [h.caption_index for h in by_id.hits]
    np.testing.assert_allclose([h.score for h in by_file.hits], [h.score for h in by_id.hits], rtol=0,
                               atol=EMBED_ATOL)
    return r, path, features


def test_grid_image_file_bytes_and_pil_give_the_stored_row_and_its_results(grid):
    data, run, _ = grid
    r, path, features = _same_as_stored_row(run, data)
    again, _ = r.feature_maker([path.read_bytes(), Image.open(path)])
    assert np.array_equal(again[0].numpy(), features[0].numpy())      # bytes: the same file, decoded the same way
    assert np.array_equal(again[1].numpy(), features[0].numpy())      # PIL: its pixels, saved losslessly
    hits = r.image_to_texts([path.read_bytes()], k=3)[0]
    assert hits.query == "<bytes>" and len(hits.hits) == 3
    with pytest.raises(UserError, match="not in the gallery .* no image file or folder"):
        r.image_to_texts(["no_such_image.jpg"])


def test_butd_image_file_gives_the_stored_regions_and_results(tmp_path, run_cli):
    data, run = _make_run(tmp_path, run_cli, "butd-regions", BUTD)
    _same_as_stored_row(run, data)


def _count_extracted(monkeypatch) -> list[int]:
    """How many image files go through the extractor (every call of the shared extraction loop)."""
    counts = []
    real = search_images.extracted_batches

    def counting(extractor, paths, **kwargs):
        counts.append(len(paths))
        return real(extractor, paths, **kwargs)
    monkeypatch.setattr(search_images, "extracted_batches", counting)
    return counts


def test_index_builds_grows_records_bad_images_and_is_searched(grid, tmp_path, monkeypatch, run_cli):
    data, run, _ = grid
    photos = tmp_path / "photos"
    (photos / "sub").mkdir(parents=True)
    images = sorted((data / "images").glob("*.jpg"))
    shutil.copy(images[0], photos / "a.jpg")
    shutil.copy(images[1], photos / "sub" / "b.jpg")
    (photos / "broken.jpg").write_bytes(images[2].read_bytes()[:200])        # a truncated JPEG
    (photos / "notes.txt").write_text("where the photos were taken")          # not an image by its suffix
    counts = _count_extracted(monkeypatch)
    out = tmp_path / "photos.index"
    args = ["index", run, "--images", photos, "--out", out, "--device", "cpu", "--workers", "0", "--quiet"]
    lines = run_cli("train", *args).stdout.splitlines()
    assert lines[0] == (f"{out}: 2 images added, 0 already in the index, 2 usable in all; skipped: 1 unusable "
                        f"image (recorded, not retried), 1 file not an image by its suffix")
    assert lines[1].startswith("  unusable: broken.jpg: ") and lines[2:] == ["  not an image: notes.txt"]
    assert sum(counts) == 3
    shutil.copy(images[3], photos / "c.jpg")                                  # the folder grows by one image
    lines = run_cli("train", *args).stdout.splitlines()
    # each kind apart: the broken file is no image "already in the index", it is the unusable one recorded before
    assert lines[0] == (f"{out}: 1 image added, 2 already in the index, 3 usable in all; skipped: 1 image "
                        f"recorded as unusable before (not retried), 1 file not an image by its suffix")
    assert lines[1].startswith("  unusable before: broken.jpg: ") and lines[2:] == ["  not an image: notes.txt"]
    assert sum(counts) == 4                                                  # only the new one was read
    ids, embeddings, errors = GalleryIndex(out).load()
    assert sorted(ids) == ["a.jpg", "c.jpg", "sub/b.jpg"] and [e[0] for e in errors] == ["broken.jpg"]
    r = Retriever.from_run(run, device="cpu", index=out)
    fresh = r.encode_images([photos / "c.jpg"])
    for key, value in fresh.items():
        np.testing.assert_allclose(embeddings[key][ids.index("c.jpg")].numpy(), value[0].numpy(), rtol=0,
                                   atol=EMBED_ATOL)
    [result] = r.text_to_images(["a small red circle"], k=5)
    assert sorted(h.image_id for h in result.hits) == sorted(ids)
    by_id = r.image_to_texts(["sub/b.jpg"], k=3)[0]                          # an index id is a query too
    by_file = r.image_to_texts([photos / "sub" / "b.jpg"], k=3)[0]
    assert [h.caption_index for h in by_id.hits] == [h.caption_index for h in by_file.hits]
    lines = run_cli("train", "search", run, "--index", out, "--query", "a small red circle", "--json",
                    "--device", "cpu").output.splitlines()
    assert sorted(h["image_id"] for h in json.loads(lines[0])["hits"]) == sorted(ids)
    if importlib.util.find_spec("faiss") is None:             # the approximate kinds are faiss's
        return
    approx = Retriever.from_run(run, device="cpu", index=out, vector_index="hnsw")    # 3 items: HNSW is exact
    assert approx.image_index.kind == "hnsw"
    assert ([vars(h) for h in approx.text_to_images(["a small red circle"], k=2)[0].hits]
            == [vars(h) for h in r.text_to_images(["a small red circle"], k=2)[0].hits])


def test_an_index_of_only_unusable_files_is_an_error_that_leaves_no_index(grid, tmp_path, run_cli):
    """Nothing usable in what was given: a non-zero exit whose one line counts each kind with the first reasons,
    and no index folder recording the files as unusable, so that once they are mended a re-run reads them."""
    data, run, _ = grid
    photos, out = tmp_path / "photos", tmp_path / "photos.index"
    photos.mkdir()
    image = sorted((data / "images").glob("*.jpg"))[0]
    (photos / "a.jpg").write_bytes(image.read_bytes()[:200])                # truncated
    (photos / "b.png").write_text("a text file named like an image")
    (photos / "notes.txt").write_text("where the photos were taken")
    args = ["index", run, "--images", photos, "--out", out, "--device", "cpu", "--workers", "0", "--quiet"]
    code, stdout, err = run_cli.as_user("train", *args)
    assert code == 1 and stdout == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {out}: no usable image to index: 2 unusable images, 1 file not an image by its "
                          f"suffix (first: a.jpg: ")
    assert "; b.png: " in err and not out.exists()
    shutil.copy(image, photos / "a.jpg")                                     # mended: read again, not skipped
    lines = run_cli("train", *args).stdout.splitlines()
    assert lines[0].startswith(f"{out}: 1 image added, 0 already in the index, 1 usable in all; skipped: 1 unusable")
    assert GalleryIndex(out).load()[0] == ["a.jpg"]


def test_index_resumes_after_an_interruption(grid, tmp_path, monkeypatch):
    data, run, _ = grid
    items = [(p.name, p) for p in sorted((data / "images").glob("*.jpg"))[:3]]
    r = Retriever.from_run(run, device="cpu")
    real, calls = Retriever.encode_files, []

    def interrupted(self, paths):
        calls.append(len(paths))
        if len(calls) == 2:
            raise KeyboardInterrupt                                          # killed while on the second shard
        return real(self, paths)
    monkeypatch.setattr(Retriever, "encode_files", interrupted)
    out = tmp_path / "index"
    with pytest.raises(KeyboardInterrupt):
        r.add_to_index(out, items, shard_size=1)
    assert [p.name for p in GalleryIndex(out).shard_paths()] == ["shard-00000.pt"]
    (out / "shard-00001.pt.partial").write_bytes(b"half a shard")           # what a kill mid-write leaves
    monkeypatch.setattr(Retriever, "encode_files", real)
    counts = _count_extracted(monkeypatch)
    summary = r.add_to_index(out, items, shard_size=1)
    assert (summary.encoded, summary.already, sum(counts)) == (2, 1, 2)
    assert sorted(GalleryIndex(out).load()[0]) == sorted(i for i, _ in items)


def test_folder_search_is_one_command_and_encodes_each_image_once(grid, tmp_path, monkeypatch, run_cli):
    data, run, _ = grid
    photos = tmp_path / "new"
    photos.mkdir()
    for p in sorted((data / "images").glob("*.jpg"))[:2]:
        shutil.copy(p, photos / p.name)
    (photos / "notes.txt").write_text("where the photos were taken")          # skipped, and said so
    jpegs = sorted(p.name for p in photos.glob("*.jpg"))
    counts = _count_extracted(monkeypatch)
    result = run_cli("train", "search", run, "--images", photos, "--query", "a large blue star", "--top", "2",
                     "--device", "cpu", "--quiet")
    assert result.stdout.splitlines()[0] == "a large blue star" and all(name in result.stdout for name in jpegs)
    assert result.stderr.splitlines() == [f"note: {photos}: 1 file not an image by its suffix; retr-train index "
                                          f"lists them"]
    r = Retriever.from_run(run, device="cpu", images=photos)                 # Python, same folder: nothing new
    assert sum(counts) == 2 and sorted(r.image_ids) == jpegs


def test_index_of_another_run_is_refused_and_a_cross_attention_run_indexes_its_own(grid, tmp_path, run_cli):
    data, run, folder = grid
    other = folder / "run-scan"                       # SCAN: another checkpoint, and a score that needs the masks
    if not other.exists():
        run_cli("train", "scan", "--features", folder / "features" / "resnet152-grid.h5", "--manifest",
                data / "manifest.jsonl", "--out", other, "--direction", "t2i", *TRAIN)
    image = sorted((data / "images").glob("*.jpg"))[0]
    out = tmp_path / "index"
    Retriever.from_run(run, device="cpu").add_to_index(out, [("a", image)])
    with pytest.raises(UserError, match="built with another checkpoint"):
        Retriever.from_run(other, device="cpu", index=out)
    code, _out, err = run_cli.as_user("train", "index", other, "--images", data / "images", "--out", out,
                                      "--device", "cpu")
    assert code != 0 and err.startswith("error: ") and "another checkpoint" in err and len(err.splitlines()) == 1
    scan = Retriever.from_run(other, device="cpu")
    scan.add_to_index(tmp_path / "scan-index", [("a", image)])
    _, embeddings, _ = GalleryIndex(tmp_path / "scan-index").load()
    assert embeddings["mask"].dtype == torch.bool                 # stored as encode_images gives it
    scan.use_index(tmp_path / "scan-index")
    [by_index] = scan.text_to_images(["a small red circle"], k=1)
    [hit] = by_index.hits
    assert hit.image_id == "a"
    fresh = scan._score64(scan.encode_images([image]), scan.encode_texts(["a small red circle"])[0])[0, 0]
    assert hit.score == pytest.approx(fresh, abs=EMBED_ATOL)


def _set_with(tmp_path, attrs, name="x"):
    """A one-row feature set with ``attrs``."""
    path = tmp_path / f"{name}.h5"
    with ShardWriter(path, attrs, (49, 2048)) as writer:
        writer.append(["x"], np.zeros((1, 49, 2048), np.float32))
    return FeatureSet(path)


def _grid_attrs(grid):
    fs = FeatureSet(grid[2] / "features" / "resnet152-grid.h5")
    skip = ("created", "retr_version", "format_version", "complete", "num_rows", "shards", "num_shards",
            "shard_index", "dtype")
    return {k: v for k, v in fs.attrs.items() if k not in skip}


def test_imported_features_and_older_sets_are_refused_in_one_line(grid, tmp_path, run_cli, synthetic_data,
                                                                  synthetic_run):
    from retr.pipeline.importers import import_attrs
    with pytest.raises(UserError, match=r"imported \(scan-precomp\).*re-extract"):
        extraction_options(_set_with(tmp_path, import_attrs("scan-precomp", "released"), "imported"))
    older = {k: v for k, v in _grid_attrs(grid).items() if k != "grid_size"}
    with pytest.raises(UserError, match="does not record grid_size"):
        extraction_options(_set_with(tmp_path, older, "older"))
    manifest, _ = synthetic_data(images=20)                      # features no retr extractor made
    run = synthetic_run("vsepp", *TRAIN, images=20, copy_to=tmp_path / "scene-run")    # search caches its gallery
    image = sorted((manifest.parent / "images").glob("*.jpg"))[0]
    code, _out, err = run_cli.as_user("train", "search", run, "--image", image, "--device", "cpu")
    assert code != 0 and len(err.splitlines()) == 1 and "'scene-regions', not a retr extractor" in err


def test_absent_weights_say_which_and_how_to_fetch(grid, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    attrs = _grid_attrs(grid)
    fs = _set_with(tmp_path, {**attrs, "weights": "ResNet152_Weights.IMAGENET1K_V1"}, "imagenet")
    with pytest.raises(MissingResourceError, match="retr-pipeline fetch-weights resnet152"):
        FeatureMaker(fs)
    weights = tmp_path / "mine.pt"
    weights.write_bytes(b"some weights")
    fs = _set_with(tmp_path, {**attrs, "weights": "sha256:" + "ab" * 32, "weights_file": "mine.pt"}, "file")
    with pytest.raises(MissingResourceError, match=r"weights file mine.pt .*--extractor-weights PATH"):
        FeatureMaker(fs)
    with pytest.raises(UserError, match="sha256 differs"):
        FeatureMaker(fs, weights=str(weights))
    monkeypatch.setenv("RETR_WEIGHTS", str(tmp_path / "weights"))
    monkeypatch.delenv("RETR_BUTD_WEIGHTS", raising=False)
    from retr.extractors.butd.extractor import DEFAULT_CHECKPOINT
    regions = {"kind": "regions", "extractor": "butd-regions", "backbone": "x", "image_size": "600",
               "weights": f"{DEFAULT_CHECKPOINT} sha256:{'cd' * 32}", "manifest_sha256": "0" * 64}
    path = tmp_path / "regions.h5"
    with ShardWriter(path, regions, (36, 2048)) as writer:
        writer.append(["x"], np.zeros((1, 36, 2048), np.float32))
    with pytest.raises(MissingResourceError, match="fetch-weights butd"):
        search_images.resolve_weights(FeatureSet(path))


def test_butd_tf32_choice_is_rebuilt_from_the_feature_set(tmp_path):
    """``--tf32`` changes which boxes CUDA keeps (docs/butd.md, TF32), so a new image is detected as the set was."""
    from retr.extractors.butd.model import DetectorSettings
    attrs = {"kind": "regions", "extractor": "butd-regions", "backbone": "x", "weights": "random",
             "image_size": "600", "short_side": 600, "max_side": 1000, "exif_orientation": False,
             "detector_settings": json.dumps(DetectorSettings().__dict__), "min_boxes": 36, "max_boxes": 36,
             "conf_threshold": 0.2, "detector_batch": 4, "manifest_sha256": "0" * 64}
    name, options = extraction_options(_set_with(tmp_path, {**attrs, "tf32": True}, "tf32"))
    assert name == "butd-regions" and options["tf32"] is True and options["detector_batch"] == 4
    _, older = extraction_options(_set_with(tmp_path, attrs, "older"))
    assert older["tf32"] is False               # made before it was recorded: read as exact float32
