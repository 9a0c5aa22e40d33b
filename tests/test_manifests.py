"""Manifest schema validation, the Karpathy reader and dataset presets."""
from __future__ import annotations

import json

import pytest

from retr.common.errors import UserError
from retr.manifests.karpathy import read_karpathy
from retr.manifests.presets import get_preset
from retr.manifests.schema import ManifestError, ManifestRecord, read_manifest, resolve_image_root, write_manifest

GOOD = {"id": "coco_1", "path": "val2014/a.jpg", "split": "test", "captions": ["a dog", "a cat"]}


def write_lines(path, objs):
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def test_round_trip_keeps_order_and_extra_fields(tmp_path):
    records = [ManifestRecord("b", "b.jpg", "train", ("x y",), {"scene": {"n": 2}}),
               ManifestRecord("a", "a.jpg", "restval", ("z",))]
    write_manifest(tmp_path / "m.jsonl", records)
    back = read_manifest(tmp_path / "m.jsonl")
    assert back == records and back[0].extra == {"scene": {"n": 2}}
    assert [r.id for r in read_manifest(tmp_path / "m.jsonl", splits=["restval"])] == ["a"]
    assert back[0].caption_key(3) == "b#3"
    assert not (tmp_path / "m.jsonl.partial").exists()


@pytest.mark.parametrize("bad, message", [
    ({k: v for k, v in GOOD.items() if k != "captions"}, "line 2: missing field 'captions'"),
    ({k: v for k, v in GOOD.items() if k not in ("path", "split")}, "line 2: missing fields 'path', 'split'"),
    (dict(GOOD, split="training"), "line 2: unknown split 'training' for id 'coco_1'"),
    (dict(GOOD, captions=["fine", "  "]), "line 2: caption 1 of id 'coco_1' is empty"),
    (dict(GOOD, captions=[]), "line 2: 'captions' must be a non-empty list"),
    (dict(GOOD, id=""), "line 2: 'id' must be a non-empty string"),
    (dict(GOOD, id="a#1"), "line 2: id 'a#1' contains '#'"),
    ("{not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
    (dict(GOOD, caption_ids=[1]), "line 2: 'caption_ids' must be a list of 2 ids, one per caption (id 'coco_1')"),
    (dict(GOOD, caption_ids=7), "line 2: 'caption_ids' must be a list of 2 ids"),
    (dict(GOOD, caption_ids=[1, -2]), "line 2: caption id 1 of id 'coco_1' is -2, not a non-negative integer or null"),
    (dict(GOOD, caption_ids=[True, 2]), "caption id 0 of id 'coco_1' is True"),
    (dict(GOOD, caption_ids=["5", 2]), "caption id 0 of id 'coco_1' is '5'"),
    (dict(GOOD, id="second", caption_ids=[3, 9]), "line 2: caption id 3 of id 'second' is already a caption id on "
                                                  "line 1"),
])
def test_validation_errors_name_the_line(tmp_path, bad, message):
    path = write_lines(tmp_path / "m.jsonl", [dict(GOOD, id="first", caption_ids=[3, 4]), bad])
    with pytest.raises(ManifestError) as info:
        read_manifest(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_caption_ids_round_trip_last_on_their_line_and_out_of_the_digest(tmp_path):
    """Caption ids (null where unknown) are read and written back, last on the line; the manifest's digest, which
    every feature set, parse and run records, is the one of the same manifest without them."""
    import dataclasses
    import hashlib

    from retr.manifests.schema import manifest_sha256, rewrite_caption_ids

    records = [ManifestRecord("coco_1", "a.jpg", "test", ("a dog", "a cat"), {"scene": 1}),
               ManifestRecord("coco_2", "b.jpg", "train", ("a bird",))]
    write_manifest(tmp_path / "plain.jsonl", records)
    with_ids = [dataclasses.replace(records[0], caption_ids=(770337, None)), records[1]]
    write_manifest(tmp_path / "ids.jsonl", with_ids)
    assert read_manifest(tmp_path / "ids.jsonl") == with_ids
    assert read_manifest(tmp_path / "ids.jsonl")[0].extra == {"scene": 1}
    assert (tmp_path / "ids.jsonl").read_text().splitlines()[0].endswith(', "scene": 1, "caption_ids": [770337, null]}')
    plain = hashlib.sha256((tmp_path / "plain.jsonl").read_bytes()).hexdigest()
    assert manifest_sha256(tmp_path / "plain.jsonl") == manifest_sha256(tmp_path / "ids.jsonl") == plain
    # rewriting ids keeps every other byte (a CRLF file, a line not named, trailing blanks) and the digest
    body = b'{"id": "x", "path": "x.jpg", "split": "test", "captions": ["c", "d"]}\r\n\r\n' \
           b'{"id": "y", "path": "y.jpg", "split": "test", "captions": ["e"]}  \r\n'
    (tmp_path / "crlf.jsonl").write_bytes(body)
    digest = manifest_sha256(tmp_path / "crlf.jsonl")
    assert rewrite_caption_ids(tmp_path / "crlf.jsonl", {"x": [5, 6]}, tmp_path / "out.jsonl") == 1
    assert (tmp_path / "out.jsonl").read_bytes() == body.replace(b'["c", "d"]}', b'["c", "d"], "caption_ids": [5, 6]}')
    assert manifest_sha256(tmp_path / "out.jsonl") == digest
    assert rewrite_caption_ids(tmp_path / "out.jsonl", {"x": [7, None], "y": [8]}) == 2     # in place, replaced
    assert [r.caption_ids for r in read_manifest(tmp_path / "out.jsonl")] == [(7, None), (8,)]
    assert manifest_sha256(tmp_path / "out.jsonl") == digest
    with pytest.raises(ManifestError, match="1 caption ids for the 2 captions of 'x'"):
        rewrite_caption_ids(tmp_path / "out.jsonl", {"x": [1]})
    with pytest.raises(ManifestError, match="has no image 'z'"):
        rewrite_caption_ids(tmp_path / "out.jsonl", {"z": [1]})


def test_duplicate_ids(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [GOOD, dict(GOOD, path="other.jpg"), "", GOOD])
    with pytest.raises(ManifestError, match=r"m.jsonl line 2: duplicate id 'coco_1' \(first on line 1\)"):
        read_manifest(path)
    with pytest.raises(ManifestError, match="duplicate id"):
        write_manifest(tmp_path / "out.jsonl", [ManifestRecord("a", "a", "train", ("c",))] * 2)


def test_missing_manifest_and_unknown_split_filter(tmp_path):
    with pytest.raises(ManifestError, match="does not exist"):
        read_manifest(tmp_path / "absent.jsonl")
    path = write_lines(tmp_path / "m.jsonl", [GOOD])
    with pytest.raises(ValueError, match="unknown split 'dev' in splits"):
        read_manifest(path, splits=["dev"])


def test_image_root_resolution(tmp_path):
    manifest = tmp_path / "sub" / "m.jsonl"
    assert resolve_image_root(manifest, "/imgs", "/preset") == __import__("pathlib").Path("/imgs")
    assert str(resolve_image_root(manifest, None, "/preset")) == "/preset"
    assert resolve_image_root(manifest) == (tmp_path / "sub").resolve()


def karpathy_coco():
    """A small file in the real dataset_coco.json layout (fields as released, values made up)."""
    def image(cocoid, split, n, folder="val2014"):
        return {"filepath": folder, "sentids": list(range(n)), "filename": f"COCO_{folder}_{cocoid:012d}.jpg",
                "imgid": cocoid % 100, "split": split, "cocoid": cocoid,
                "sentences": [{"tokens": ["a", "thing", str(k)], "raw": f" A thing number {k}. ",
                               "imgid": cocoid % 100, "sentid": k} for k in range(n)]}
    return {"dataset": "coco", "images": [image(391895, "test", 5), image(522418, "restval", 7),
                                          image(184613, "train", 5, "train2014"), image(318219, "val", 6)]}


def test_karpathy_coco(tmp_path):
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps(karpathy_coco()))
    records = read_karpathy(path)
    assert [r.id for r in records] == ["coco_391895", "coco_522418", "coco_184613", "coco_318219"]
    assert [r.split for r in records] == ["test", "restval", "train", "val"]
    assert records[0].path == "val2014/COCO_val2014_000000391895.jpg"
    assert records[2].path == "train2014/COCO_train2014_000000184613.jpg"
    assert records[0].captions[0] == "A thing number 0."
    assert [len(r.captions) for r in records] == [5, 5, 5, 5]
    assert [len(r.captions) for r in read_karpathy(path, max_captions=None)] == [5, 7, 5, 6]


def test_karpathy_flickr_and_cli(tmp_path, run_cli):
    data = {"dataset": "flickr30k", "images": [
        {"sentids": [0, 1], "imgid": 0, "split": "train", "filename": "1000092795.jpg",
         "sentences": [{"tokens": ["two", "men"], "raw": "Two young guys with shaggy hair .", "imgid": 0,
                        "sentid": 0}, {"tokens": ["x"], "raw": "Two friends enjoy time spent together .",
                                       "imgid": 0, "sentid": 1}]},
        {"sentids": [2], "imgid": 1, "split": "test", "filename": "10002456.jpg",
         "sentences": [{"tokens": ["y"], "raw": "Several men in hard hats .", "imgid": 1, "sentid": 2}]}]}
    path = tmp_path / "dataset_flickr30k.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "f30k.jsonl"
    result = run_cli("pipeline", "manifest", "karpathy", path, "--out", out)
    assert "2 images (train 1, test 1), 3 captions" in result.output
    records = read_manifest(out)
    assert records[0].id == "f30k_1000092795" and records[0].path == "1000092795.jpg"
    assert records[1].captions == ("Several men in hard hats .",)


def test_karpathy_bad_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_karpathy(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"dataset": "imagenet", "images": []}))
    with pytest.raises(UserError, match="unknown dataset 'imagenet'"):
        read_karpathy(bad)
    bad.write_text(json.dumps({"dataset": "coco", "images": [{"filename": "x.jpg", "split": "dev",
                                                              "sentences": []}]}))
    with pytest.raises(UserError, match=r"images\[0\]: unknown split 'dev'"):
        read_karpathy(bad)


def test_presets_and_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("RETR_DATA", str(tmp_path))
    coco = get_preset("coco")
    assert coco.images == tmp_path / "coco/images" and coco.manifest == tmp_path / "coco/manifest.jsonl"
    assert coco.karpathy == tmp_path / "coco/dataset_coco.json"
    assert coco.test_protocols == ("coco-1k", "coco-5k")
    monkeypatch.setenv("RETR_COCO_IMAGES", "/mnt/coco")
    assert str(get_preset("coco").images) == "/mnt/coco"
    assert str(get_preset("coco", images="/flag").images) == "/flag"  # a flag beats the environment
    assert get_preset("synthetic").karpathy is None
    with pytest.raises(ValueError, match="unknown dataset preset 'imagenet'"):
        get_preset("imagenet")
