"""Manifest image paths that leave the image root (absolute, ``..`` above it) are refused by ``manifest check``
and recorded as errors by extraction — never opened — unless ``--allow-outside-root``."""
from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
import pytest
import torch

from retr.extractors.base import Extractor
from retr.manifests.schema import outside_root_reason
from retr.manifests.synthetic import generate_synthetic
from retr.pipeline.extract import extract_features
from retr.store.features import decode_str


@pytest.mark.parametrize("path, reason", [
    ("images/a.jpg", None), ("a/../b.jpg", None), ("./a/./b.jpg", None), ("a..b/c.jpg", None),
    ("../secret.jpg", "'..' climbs above the image root"), ("a/../../b.jpg", "'..' climbs above the image root"),
    ("a/..\\..\\b.jpg", "'..' climbs above the image root"),
    ("/etc/passwd", "absolute path"), ("C:\\data\\a.jpg", "absolute path"), ("\\\\server\\share\\a.jpg", "absolute path"),
])
def test_outside_root_reason(path, reason):
    assert outside_root_reason(path) == reason


@pytest.fixture
def layout(tmp_path):
    """A synthetic root with 3 images, one image above it and one elsewhere; a manifest naming all five."""
    generate_synthetic(tmp_path / "root", num_images=3, seed=0)
    records = [json.loads(line) for line in (tmp_path / "root" / "manifest.jsonl").read_text().splitlines()]
    shutil.copy(tmp_path / "root" / records[0]["path"], tmp_path / "secret.png")
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(tmp_path / "root" / records[1]["path"], tmp_path / "elsewhere" / "abs.png")
    records.insert(1, {"id": "climbs", "path": "../secret.png", "split": "train", "captions": ["a secret"]})
    records.append({"id": "absolute", "path": str(tmp_path / "elsewhere" / "abs.png"), "split": "test",
                    "captions": ["an absolute path"]})
    manifest = tmp_path / "root" / "outside.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in records))
    return manifest, [r["id"] for r in records]


def test_manifest_check_refuses_paths_outside_the_root(layout, run_cli, tmp_path):
    manifest, _ids = layout
    root = tmp_path / "root"
    code, out, err = run_cli.as_user("pipeline", "manifest", "check", manifest, "--image-root", root)
    assert code == 1 and "Traceback" not in err and err.count("\n") == 1
    assert err == (f"error: 2 image paths leave the image root: climbs (../secret.png: '..' climbs above the image "
                   f"root), absolute ({tmp_path / 'elsewhere' / 'abs.png'}: absolute path) (--allow-outside-root "
                   f"accepts them)\n")
    code, out, err = run_cli.as_user("pipeline", "manifest", "check", manifest)   # without --image-root too
    assert code == 1 and err.startswith("error: 2 image paths leave the image root")
    code, out, err = run_cli.as_user("pipeline", "manifest", "check", manifest, "--image-root", root,
                                     "--allow-outside-root")
    assert code == 0, err
    assert "note: 2 image paths leave the image root (accepted: --allow-outside-root)" in out
    assert "all 5 image files present" in out


class Recording(Extractor):
    """A network-free extractor that records every path it is asked to open."""

    name, kind = "tencrop-resnet152", "tencrop"

    def __init__(self):
        self.opened: list[str] = []

    @property
    def feature_shape(self):
        return (10, 2048)

    def attrs(self):
        return dict(kind="tencrop", extractor="recording", backbone="none", weights="random", image_size=32)

    def load(self, path):
        self.opened.append(path)
        return torch.zeros(1)

    def extract(self, batch):
        return {"features": np.ones((len(batch), 10, 2048), np.float32)}


def _read(index):
    with h5py.File(index, "r") as f:
        return ([decode_str(v) for v in f["ids"][:]], {decode_str(a): decode_str(b) for a, b in f["errors"][:]},
                dict(f.attrs))


def test_extraction_records_outside_paths_as_errors_without_opening_them(layout, tmp_path):
    manifest, ids = layout
    extractor = Recording()
    summary = extract_features(manifest, "tencrop-resnet152", tmp_path / "f", workers=0, quiet=True,
                               build=lambda name, **o: extractor)
    assert (summary.rows, summary.errors) == (3, 2)
    assert all(path.startswith(str(tmp_path / "root")) and ".." not in path for path in extractor.opened)
    assert len(extractor.opened) == 3
    rows, errors, attrs = _read(summary.index_path)
    assert rows == [i for i in ids if i not in ("climbs", "absolute")]
    assert errors == {
        "climbs": "path '../secret.png' leaves the image root ('..' climbs above the image root); not read "
                  "(--allow-outside-root reads it)",
        "absolute": f"path '{tmp_path / 'elsewhere' / 'abs.png'}' leaves the image root (absolute path); not read "
                    f"(--allow-outside-root reads it)"}
    assert "images_outside_root" not in attrs

    allowed = Recording()
    summary = extract_features(manifest, "tencrop-resnet152", tmp_path / "g", workers=0, quiet=True,
                               allow_outside_root=True, build=lambda name, **o: allowed)
    assert (summary.rows, summary.errors) == (5, 0) and len(allowed.opened) == 5
    rows, errors, attrs = _read(summary.index_path)
    assert rows == ids and attrs["images_outside_root"] == "read"


def test_the_extract_command_takes_the_flag(layout, tmp_path, run_cli):
    manifest, _ids = layout
    base = ["extract", "--manifest", manifest, "--extractor", "tencrop-resnet152", "--weights", "random",
            "--image-size", "32", "--workers", "0", "--quiet"]
    code, out, err = run_cli.as_user("pipeline", *base, "--out", tmp_path / "f")
    assert code == 0, err
    assert "3 rows, 2 unreadable images (listed in errors)" in out
    code, out, err = run_cli.as_user("pipeline", *base, "--out", tmp_path / "g", "--allow-outside-root")
    assert code == 0, err
    assert "5 rows, 0 unreadable images" in out
