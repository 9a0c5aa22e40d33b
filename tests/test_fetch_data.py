"""``retr-pipeline fetch-data`` and ``extract-preset`` from nothing, on a tiny fake COCO (and Flickr30K) served
by a local HTTP server through ``--mirror``: archives of a few JPEGs, a tiny Karpathy split file and COCO caption
files, entered in the sources table with their own sizes and sha256s."""
from __future__ import annotations

import hashlib
import io
import json
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image

from retr.common import downloads
from retr.common.downloads import SOURCES
from tests.local_server import LocalServer

COCO = {"train2014": [9, 25, 30], "val2014": [42, 73, 74]}
SPLITS = {9: "train", 25: "train", 30: "restval", 42: "val", 73: "test", 74: "test"}
F30K = ["1000092795", "10002456", "1000268201"]


def _jpeg(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), (seed * 30 % 256, 80, 160)).save(buffer, "JPEG")
    return buffer.getvalue()


def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, body in members.items():
            archive.writestr(name, body)
    return buffer.getvalue()


def _karpathy_zip() -> bytes:
    coco = {"dataset": "coco", "images": [
        {"filepath": folder, "filename": f"COCO_{folder}_{i:012d}.jpg", "cocoid": i, "split": SPLITS[i],
         "sentences": [{"raw": f"picture {i} caption {k}"} for k in range(5)]}
        for folder, ids in COCO.items() for i in ids]}
    f30k = {"dataset": "flickr30k", "images": [
        {"filename": f"{name}.jpg", "split": split, "sentences": [{"raw": f"photo {name} {k}"} for k in range(5)]}
        for name, split in zip(F30K, ("train", "val", "test"))]}
    return _zip({"dataset_coco.json": json.dumps(coco).encode(), "dataset_flickr30k.json": json.dumps(f30k).encode(),
                 "dataset_flickr8k.json": b'{"dataset": "flickr8k", "images": []}'})


def _caption_files(texts=lambda i, k: f"picture {i} caption {k}") -> dict[str, bytes]:
    """COCO's caption files for the fake images: caption k of image i is annotation 1000·i + k, its text
    ``texts(i, k)`` (listed in reverse, as COCO's files do not follow Karpathy's order)."""
    files = {}
    for folder, ids in COCO.items():
        body = {"images": [{"id": i, "file_name": f"COCO_{folder}_{i:012d}.jpg"} for i in ids],
                "annotations": [{"image_id": i, "id": 1000 * i + k, "caption": texts(i, k)}
                                for i in reversed(ids) for k in range(5)]}
        files[f"annotations/captions_{folder}.json"] = json.dumps(body).encode()
    return files


def _annotations_zip(texts=lambda i, k: f"picture {i} caption {k}") -> bytes:
    return _zip({**_caption_files(texts), "annotations/instances_val2014.json": b"{}"})


def _coco_zip(folder: str) -> bytes:
    return _zip({f"{folder}/": b"", **{f"{folder}/COCO_{folder}_{i:012d}.jpg": _jpeg(i) for i in COCO[folder]}})


@pytest.fixture
def mirror(monkeypatch):
    """A local mirror serving the fake COCO, with the sources table describing these files."""
    monkeypatch.setenv("RETR_OFFLINE", "0")
    monkeypatch.setenv("RETR_MIRROR", "")
    monkeypatch.delenv("RETR_MIRROR")
    monkeypatch.setattr(downloads, "DEFAULT_RETRY_WAIT", 0.0)
    files = {"caption_datasets.zip": _karpathy_zip(), "train2014.zip": _coco_zip("train2014"),
             "val2014.zip": _coco_zip("val2014"), "annotations_trainval2014.zip": _annotations_zip()}
    for key, name in (("karpathy-splits", "caption_datasets.zip"), ("coco-train2014", "train2014.zip"),
                      ("coco-val2014", "val2014.zip"), ("coco-annotations", "annotations_trainval2014.zip")):
        serve(monkeypatch, key, files[name])
    with LocalServer() as server:
        server.files.update({f"/{name}": body for name, body in files.items()})
        yield server


def serve(monkeypatch, key: str, body: bytes) -> None:
    """Enter ``body`` in the sources table as the file of ``key`` (its size and sha256)."""
    monkeypatch.setitem(SOURCES, key, replace(SOURCES[key], size=len(body), sha256=hashlib.sha256(body).hexdigest(),
                                              unpacked_bytes=len(body), files=3 if SOURCES[key].files else None))


def test_fetch_data_coco_through_a_mirror_builds_the_manifest(mirror, tmp_path, run_cli):
    root = tmp_path / "coco"
    code, stdout, stderr = run_cli.as_user("pipeline", "fetch-data", "coco", "--root", root, "--mirror", mirror.url,
                                           "--quiet")
    assert (code, stderr) == (0, ""), stderr
    assert stdout == (f"wrote {root / 'manifest.jsonl'}: 6 images (train 2, restval 1, val 1, test 2), 30 captions "
                      f"(30 with their COCO caption ids); images under {root / 'images'}\n")
    rows = [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"coco_{i}" for ids in COCO.values() for i in ids]
    assert all(r["caption_ids"] == [1000 * int(r["id"][5:]) + k for k in range(5)] for r in rows)
    # only the two caption files are unpacked, and the annotations archive goes as the image archives do
    assert sorted(p.name for p in (root / "annotations").iterdir()) == ["captions_train2014.json",
                                                                         "captions_val2014.json"]
    assert rows[0]["path"] == "train2014/COCO_train2014_000000000009.jpg" and rows[0]["split"] == "train"
    assert all((root / "images" / r["path"]).read_bytes()[:2] == b"\xff\xd8" for r in rows)
    # image archives go once unpacked (the stamps say so); the small splits archive stays
    assert sorted(p.name for p in (root / "downloads").iterdir() if not p.name.endswith(".lock")) == [
        "caption_datasets.zip"]
    assert (root / "images" / ".coco-train2014.unpacked").is_file()
    assert (root / "dataset_coco.json").is_file()
    # a second run downloads nothing
    before = len(mirror.requests)
    code, stdout2, _ = run_cli.as_user("pipeline", "fetch-data", "coco", "--root", root, "--mirror", mirror.url,
                                       "--quiet")
    assert code == 0 and stdout2 == stdout and len(mirror.requests) == before
    # and the manifest is the one `manifest karpathy` writes from the same split file and caption files
    code, _, _ = run_cli.as_user("pipeline", "manifest", "karpathy", root / "dataset_coco.json", "--out",
                                 tmp_path / "k.jsonl", "--coco-captions", root / "annotations")
    assert code == 0 and (tmp_path / "k.jsonl").read_text() == (root / "manifest.jsonl").read_text()


def test_captions_that_match_no_annotation_are_counted_and_named_never_guessed(mirror, tmp_path, run_cli,
                                                                              monkeypatch):
    """COCO's texts may differ from Karpathy's in whitespace only (matched) or not at all; one that differs
    otherwise keeps no id and is named in one warning line."""
    def texts(i, k):
        if (i, k) == (73, 2):
            return "a different caption"
        return f"  picture {i}\n caption {k} " if i == 9 else f"picture {i} caption {k}"

    body = _annotations_zip(texts)
    mirror.files["/annotations_trainval2014.zip"] = body
    serve(monkeypatch, "coco-annotations", body)
    root = tmp_path / "coco"
    code, stdout, stderr = run_cli.as_user("pipeline", "fetch-data", "coco", "--root", root, "--mirror", mirror.url,
                                           "--quiet")
    assert code == 0 and "30 captions (29 with their COCO caption ids)" in stdout
    assert stderr == ("warning: COCO caption ids for 29 of 30 captions; 1 captions match no annotation of their "
                      "image, left without an id: coco_73#2 'picture 73 caption 2'\n")
    rows = {json.loads(line)["id"]: json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines()}
    assert rows["coco_73"]["caption_ids"] == [73000, 73001, None, 73003, 73004]
    assert rows["coco_9"]["caption_ids"] == [9000 + k for k in range(5)]


def test_an_interrupted_archive_resumes_on_the_next_run(mirror, tmp_path, run_cli, monkeypatch):
    monkeypatch.setattr(downloads, "DEFAULT_RETRIES", 0)
    size = len(mirror.files["/train2014.zip"])
    mirror.cut["/train2014.zip"] = [size // 3]
    root = tmp_path / "coco"
    argv = ["fetch-data", "coco", "--root", root, "--mirror", mirror.url, "--quiet", "--keep-archives"]
    code, stdout, stderr = run_cli.as_user("pipeline", *argv)
    assert code == 1 and stdout == "" and stderr.count("\n") == 1
    assert "train2014.zip.partial keeps the" in stderr and "the next run resumes from there" in stderr
    assert not (root / "downloads" / "train2014.zip").exists() and not (root / "manifest.jsonl").exists()
    code, _, stderr = run_cli.as_user("pipeline", *argv)
    assert code == 0, stderr
    assert ("/train2014.zip", f"bytes={size // 3}-") in mirror.requests
    assert (root / "downloads" / "train2014.zip").read_bytes() == mirror.files["/train2014.zip"]   # --keep-archives


def test_a_damaged_archive_member_is_refused_and_the_archive_removed(mirror, tmp_path, run_cli, monkeypatch):
    good = mirror.files["/val2014.zip"]
    jpeg = _jpeg(73)
    damaged = good.replace(jpeg, jpeg[:-10] + bytes(10))              # CRC no longer matches; sizes do
    assert damaged != good and len(damaged) == len(good)
    mirror.files["/val2014.zip"] = damaged
    serve(monkeypatch, "coco-val2014", damaged)                      # published checksum of the damaged file
    root = tmp_path / "coco"
    code, stdout, stderr = run_cli.as_user("pipeline", "fetch-data", "coco", "--root", root, "--mirror",
                                           mirror.url, "--quiet")
    assert code == 1 and stderr.count("\n") == 1
    assert "member val2014/COCO_val2014_000000000073.jpg fails its check" in stderr and "removed" in stderr
    assert not (root / "downloads" / "val2014.zip").exists() and not (root / "manifest.jsonl").exists()
    assert not (root / "images" / ".coco-val2014.unpacked").exists()
    assert not list((root / "images").rglob("*.partial"))


def test_a_checksum_mismatch_is_refused_without_leaving_the_file(mirror, tmp_path, run_cli, monkeypatch):
    monkeypatch.setitem(SOURCES, "coco-val2014", replace(SOURCES["coco-val2014"], sha256="0" * 64))
    root = tmp_path / "coco"
    code, _, stderr = run_cli.as_user("pipeline", "fetch-data", "coco", "--root", root, "--mirror", mirror.url,
                                      "--quiet")
    assert code == 1 and stderr.count("\n") == 1 and "fails its sha256 check" in stderr
    assert sorted(p.name for p in (root / "downloads").iterdir() if not p.name.endswith(".lock")) == [
        "caption_datasets.zip"]


def test_not_enough_disk_stops_before_any_download(mirror, tmp_path, run_cli, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    code, _, stderr = run_cli.as_user("pipeline", "fetch-data", "coco", "--root", tmp_path / "coco", "--mirror",
                                      mirror.url)
    assert code == 1 and stderr.startswith(f"error: not enough free disk space in {tmp_path / 'coco'}: fetching coco")
    assert mirror.requests == []


def test_flickr30k_takes_the_archive_the_user_was_sent(mirror, tmp_path, run_cli):
    root = tmp_path / "f30k"
    code, _, stderr = run_cli.as_user("pipeline", "fetch-data", "f30k", "--root", root, "--mirror", mirror.url)
    assert code == 1 and stderr.count("\n") == 1
    assert "Flickr30K images (3 of the 3 in dataset_flickr30k.json, e.g. 1000092795.jpg) not found" in stderr
    assert f"run retr-pipeline fetch-data f30k --root {root} --images-zip FILE" in stderr
    archive = tmp_path / "flickr30k-images.zip"
    archive.write_bytes(_zip({f"flickr30k-images/{name}.jpg": _jpeg(i) for i, name in enumerate(F30K)}
                             | {"flickr30k-images/readme.txt": b"x"}))
    code, stdout, stderr = run_cli.as_user("pipeline", "fetch-data", "f30k", "--root", root, "--mirror", mirror.url,
                                           "--images-zip", archive, "--quiet")
    assert code == 0, stderr
    assert "3 images (train 1, val 1, test 1), 15 captions" in stdout
    assert sorted(p.name for p in (root / "images").iterdir()) == [".f30k-images.unpacked",
                                                                    *sorted(f"{n}.jpg" for n in F30K)]
    assert archive.is_file()                                             # the user's own file is never removed
    # without --quiet the archive's unpacking is one line on stderr (the retr logger), the manifest's on stdout
    (root / "images" / ".f30k-images.unpacked").unlink()
    code, stdout, stderr = run_cli.as_user("pipeline", "fetch-data", "f30k", "--root", root, "--mirror", mirror.url,
                                           "--images-zip", archive)
    assert code == 0 and stderr.splitlines() == [
        f"flickr30k-images.zip: 0 images unpacked (3 already there) into {root / 'images'}"], stderr


def test_extract_preset_fetches_a_missing_dataset_then_extracts(mirror, tmp_path, run_cli, monkeypatch):
    """`make extract DATASET=coco` on a fresh machine: fetch-data, then the extractors (faked here)."""
    import retr.pipeline.commands.extract as command

    calls = []

    class Summary:
        def line(self):
            return "done"

    def fake_extract(manifest, name, out, **kwargs):
        calls.append((name, Path(manifest), kwargs["image_root"]))
        return Summary()

    monkeypatch.setattr(command, "extract_features", fake_extract)
    monkeypatch.setenv("RETR_DATA", str(tmp_path / "data"))
    code, stdout, stderr = run_cli.as_user("pipeline", "extract-preset", "coco", "--weights", "random", "--only",
                                           "vgg16-maps", "--mirror", mirror.url, "--quiet")
    assert code == 0, stderr
    assert calls == [("vgg16-maps", tmp_path / "data" / "coco" / "manifest.jsonl", tmp_path / "data" / "coco" / "images")]
    assert (tmp_path / "data" / "coco" / "manifest.jsonl").is_file() and stdout == "done\n"
    # offline, data present but the default weights absent: one line naming fetch-weights, nothing extracted
    monkeypatch.setenv("RETR_OFFLINE", "1")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    code, stdout, stderr = run_cli.as_user("pipeline", "extract-preset", "coco", "--only", "vgg16-maps",
                                           "--only", "tencrop-vgg19")
    assert code == 1 and stdout == "" and stderr.count("\n") == 1, stderr
    assert stderr.startswith("error: weights vgg16, vgg19 not found (looked in ")
    assert "run retr-pipeline fetch-weights vgg16 vgg19 on a connected machine" in stderr and len(calls) == 1


def test_extract_preset_synthetic_needs_no_network(tmp_path, run_cli, monkeypatch):
    import socket

    import retr.pipeline.commands.extract as command

    opened = []
    monkeypatch.setattr(socket, "socket", lambda *a, **k: opened.append(a))
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: opened.append(a))
    calls = []

    class Summary:
        def line(self):
            return "done"

    monkeypatch.setattr(command, "extract_features",
                        lambda manifest, name, out, **kwargs: calls.append((name, kwargs["options"])) or Summary())
    monkeypatch.setenv("RETR_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("RETR_OFFLINE", "0")
    code, stdout, stderr = run_cli.as_user("pipeline", "extract-preset", "synthetic", "--quiet")
    assert code == 0, stderr
    assert (tmp_path / "data" / "synthetic" / "manifest.jsonl").is_file() and opened == []
    options = dict(calls)
    assert set(options) == {"resnet152-grid", "vgg16-maps", "tencrop-vgg19", "tencrop-resnet152", "butd-regions"}
    assert all(o["weights"] == "random" for o in options.values())
    assert options["butd-regions"]["short_side"] == 224 and options["tencrop-vgg19"]["image_size"] == 64
