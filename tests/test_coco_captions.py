"""COCO caption ids for a manifest (manifests/coco_captions.py) and ``retr-pipeline manifest coco-caption-ids``:
each caption matched to its annotation by image and text, the unmatched counted and named, never guessed; an
existing manifest given its ids with every other byte kept, so what was made from it still matches it."""
from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest

from retr.common.errors import MissingResourceError, UserError
from retr.manifests.coco_captions import join_caption_ids, read_coco_captions
from retr.manifests.schema import ManifestRecord, manifest_sha256, read_manifest, write_manifest
from test_pipeline_wrong_inputs import assert_one_error_line

RECORDS = [ManifestRecord("coco_42", "val2014/COCO_val2014_000000000042.jpg", "test",
                          ("A dog on a couch.", "A dog on a couch.", "Two  cats", "A bird")),
           ManifestRecord("coco_9", "train2014/COCO_train2014_000000000009.jpg", "train", ("Plates of food",))]


def _files(folder, annotations=None):
    """COCO's two caption files in ``folder`` (annotations not given: those matching :data:`RECORDS`, the
    duplicated caption listed twice, whitespace as COCO has it, and no text for "A bird")."""
    annotations = annotations or {
        "val": [(42, 501, "A dog on a couch. "), (42, 502, "Two cats\n"), (42, 503, "A dog on a couch."),
                (42, 504, "A cat on a bird")],
        "train": [(9, 77, "Plates of food")]}
    names = {"val": "COCO_val2014_000000000042.jpg", "train": "COCO_train2014_000000000009.jpg"}
    ids = {"val": 42, "train": 9}
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in annotations.items():
        body = {"images": [{"id": ids[split], "file_name": names[split]}],
                "annotations": [{"image_id": i, "id": a, "caption": c} for i, a, c in rows]}
        (folder / f"captions_{split}2014.json").write_text(json.dumps(body))
    return folder


def test_captions_match_by_image_and_text_duplicates_in_file_order_the_rest_named(tmp_path):
    join = join_caption_ids(RECORDS, read_coco_captions([_files(tmp_path / "ann")]))
    assert [r.caption_ids for r in join.records] == [(501, 503, 502, None), (77,)]
    assert (join.matched, join.captions) == (4, 5)
    assert join.summary() == ("COCO caption ids for 4 of 5 captions; 1 captions match no annotation of their image, "
                              "left without an id: coco_42#3 'A bird'")


def test_caption_files_are_found_in_a_folder_its_annotations_folder_or_cocos_zip(tmp_path):
    folder = _files(tmp_path / "data" / "annotations")
    archive = tmp_path / "annotations_trainval2014.zip"
    with zipfile.ZipFile(archive, "w") as handle:
        for path in folder.iterdir():
            handle.write(path, f"annotations/{path.name}")
        handle.writestr("annotations/instances_val2014.json", "{}")
    for given in ([folder], [tmp_path / "data"], [archive], sorted(folder.iterdir())):
        assert join_caption_ids(RECORDS, read_coco_captions(given)).matched == 4
    with pytest.raises(MissingResourceError, match=r"COCO caption annotations captions_val2014.json not found .*"
                                                   r"run `retr-pipeline fetch-data coco`"):
        read_coco_captions([folder / "captions_train2014.json"])


def test_files_that_are_not_cocos_captions_and_manifests_that_are_not_coco_are_refused(tmp_path):
    folder = _files(tmp_path / "ann")
    (folder / "captions_val2014.json").write_text('{"images": [], "annotations": [{"image_id": 1, "id": 2, '
                                                  '"category_id": 3}], "categories": []}')
    with pytest.raises(UserError, match=r"captions_val2014.json: annotations\[0\] is for image 1, which 'images' "
                                        r"does not list"):
        read_coco_captions([folder])
    (folder / "captions_val2014.json").write_text('{"images": [{"id": 1, "file_name": "x.jpg"}], "annotations": '
                                                  '[{"image_id": 1, "id": 2, "category_id": 3}]}')
    with pytest.raises(UserError, match=r"missing field 'caption'\) — an instances file\? give captions_\*.json"):
        read_coco_captions([folder])
    (folder / "captions_val2014.json").write_text('{"images": [')
    with pytest.raises(UserError, match="captions_val2014.json: not valid JSON"):
        read_coco_captions([folder])
    captions = read_coco_captions([_files(tmp_path / "good")])
    with pytest.raises(UserError, match="none of the manifest's 1 images is in captions_train2014.json or "
                                        "captions_val2014.json"):
        join_caption_ids([ManifestRecord("f30k_1", "1.jpg", "test", ("a",))], captions)
    with pytest.raises(UserError, match="is COCO image 42 by its file name but 9 by its id"):
        join_caption_ids([ManifestRecord("coco_9", RECORDS[0].path, "test", ("a",))], captions)


def test_manifest_coco_caption_ids_adds_the_ids_and_nothing_made_from_the_manifest_changes(tmp_path, run_cli):
    """In place: the ids, every other byte kept, the digest features record unchanged — a feature set made from
    the manifest before still pairs with it, with no note; a run's data identity is the same."""
    from retr.store.features import FeatureSet, ShardWriter, shard_name, write_index
    from retr.trainers.data.pairing import check_manifest_pairing
    from retr.trainers.runs.resume import data_identity

    manifest = tmp_path / "manifest.jsonl"
    write_manifest(manifest, RECORDS)
    before = manifest.read_text()
    digest = manifest_sha256(manifest)
    attrs = dict(kind="regions", extractor="r", backbone="b", weights="random", image_size=224, manifest_sha256=digest)
    shard = tmp_path / "r" / shard_name(0, 1)
    with ShardWriter(shard, attrs, (2, 4), shard_index=0, num_shards=1) as writer:
        writer.append([r.id for r in RECORDS], np.zeros((2, 2, 4), dtype=np.float32))
    features = FeatureSet(write_index(tmp_path / "r.h5", [shard]))
    identity = data_identity(features, str(manifest))
    code, stdout, stderr = run_cli.as_user("pipeline", "manifest", "coco-caption-ids", manifest, "--annotations",
                                           _files(tmp_path / "ann"))
    assert code == 0 and stderr == "", stderr
    assert stdout == (f"wrote {manifest}: COCO caption ids for 4 of 5 captions; 1 captions match no annotation of "
                      "their image, left without an id: coco_42#3 'A bird'\n")
    assert [r.caption_ids for r in read_manifest(manifest)] == [(501, 503, 502, None), (77,)]
    assert [line[:line.rindex(', "caption_ids"')] + "}" for line in manifest.read_text().splitlines()] == \
        before.splitlines()
    assert manifest_sha256(manifest) == digest
    assert check_manifest_pairing(features, manifest) == []
    assert data_identity(features, str(manifest)) == identity
    # --out leaves the manifest as it is; the manifest karpathy builder gives the same ids
    code, _, _ = run_cli.as_user("pipeline", "manifest", "coco-caption-ids", manifest, "--annotations",
                                 tmp_path / "ann", "--out", tmp_path / "copy.jsonl")
    assert code == 0 and (tmp_path / "copy.jsonl").read_text() == manifest.read_text()


def test_manifest_karpathy_coco_captions_builds_the_ids_in(tmp_path, run_cli):
    karpathy = {"dataset": "coco", "images": [
        {"filepath": "val2014", "filename": "COCO_val2014_000000000042.jpg", "cocoid": 42, "split": "test",
         "sentences": [{"raw": c} for c in RECORDS[0].captions]},
        {"filepath": "train2014", "filename": "COCO_train2014_000000000009.jpg", "cocoid": 9, "split": "train",
         "sentences": [{"raw": "Plates of food"}]}]}
    (tmp_path / "dataset_coco.json").write_text(json.dumps(karpathy))
    code, stdout, stderr = run_cli.as_user("pipeline", "manifest", "karpathy", tmp_path / "dataset_coco.json",
                                           "--out", tmp_path / "m.jsonl", "--max-captions", "0", "--coco-captions",
                                           _files(tmp_path / "ann"))
    assert code == 0, stderr
    assert stdout == (f"wrote {tmp_path / 'm.jsonl'}: 2 images (train 1, test 1), 5 captions; COCO caption ids for 4 "
                      "of 5 captions; 1 captions match no annotation of their image, left without an id: coco_42#3 "
                      "'A bird'\n")
    assert [r.caption_ids for r in read_manifest(tmp_path / "m.jsonl")] == [(501, 503, 502, None), (77,)]


def test_wrong_inputs_of_coco_caption_ids_are_one_line_and_write_nothing(tmp_path, run_cli):
    manifest = tmp_path / "manifest.jsonl"
    write_manifest(manifest, RECORDS)
    before = manifest.read_bytes()
    folder = _files(tmp_path / "ann")
    (folder / "captions_train2014.json").unlink()
    for argv, expected in (
            (["--annotations", folder], "COCO caption annotations captions_train2014.json not found"),
            (["--annotations", tmp_path / "absent"], "COCO caption annotations absent not found"),
            ([], "Missing option '--annotations'")):
        code, stdout, stderr = run_cli.as_user("pipeline", "manifest", "coco-caption-ids", manifest, *argv)
        assert_one_error_line(code, stdout, stderr)
        assert expected in stderr
        assert manifest.read_bytes() == before and not list(tmp_path.glob("*.partial"))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as handle:
        handle.writestr("readme.txt", "x")
    (tmp_path / "other.zip").write_bytes(buffer.getvalue())
    code, stdout, stderr = run_cli.as_user("pipeline", "manifest", "coco-caption-ids", manifest, "--annotations",
                                           tmp_path / "other.zip")
    assert_one_error_line(code, stdout, stderr)
    assert "captions_train2014.json and captions_val2014.json not found" in stderr and manifest.read_bytes() == before
