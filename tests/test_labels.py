"""Image-label files: the store's writer/reader pair, the COCO instances and Flickr30K Entities readers (both label
readings: head nouns, entity types), and ``retr-pipeline labels coco|f30k-entities`` end to end on small annotation
files written here (by hand, and Entities-format files from `tests/f30k_entities_synth.py`)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from retr.common.atomic import atomic_text, partial_path
from retr.common.errors import ParameterError, UserError
from retr.manifests.dataset_labels import (EntityPhrase, entity_labels, entity_phrases, f30k_entity_labels,
                                           parse_entity_sentence, phrase_head, singular)
from f30k_entities_synth import write_entities_files
from retr.manifests.schema import ManifestRecord, manifest_sha256, write_manifest
from retr.store.labels import ATTRS_KEY, read_label_attrs, read_label_file, write_label_file


# ------------------------------------------------------------------------------------------ store format

@pytest.mark.parametrize("name", ["labels.json", "labels.jsonl"])
def test_write_then_read_round_trips_with_attributes(tmp_path, name):
    labels = {"coco_3": ["person", "traffic light"], "coco_1": [], "f30k_7": ["dog"]}
    path = write_label_file(tmp_path / "sub" / name, labels, {"source": "test", "vocabulary": ["dog"]})
    assert path == tmp_path / "sub" / name and not partial_path(path).exists()
    back = read_label_file(path)
    assert back == labels and list(back) == ["coco_3", "coco_1", "f30k_7"]  # order kept, attrs not an image
    attrs = read_label_attrs(path)
    assert attrs["source"] == "test" and attrs["vocabulary"] == ["dog"] and attrs["num_images"] == 3
    assert attrs["format_version"] == 1 and "created" in attrs and "retr_version" in attrs
    text = path.read_text()
    if name.endswith(".jsonl"):
        lines = text.splitlines()
        assert json.loads(lines[0]) == {ATTRS_KEY: attrs} and json.loads(lines[1]) == {"id": "coco_3",
                                                                                      "labels": labels["coco_3"]}
    else:
        assert len(text.splitlines()) == 4 + 1  # attrs + one line per image + closing brace
        assert json.loads(text)[ATTRS_KEY] == attrs


def test_hand_written_files_without_attributes_still_read(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"x": ["cat", 3]}))
    assert read_label_file(tmp_path / "a.json") == {"x": ["cat", "3"]} and read_label_attrs(tmp_path / "a.json") == {}
    (tmp_path / "a.jsonl").write_text('{"id": "y", "labels": []}\n')
    assert read_label_file(tmp_path / "a.jsonl") == {"y": []}


@pytest.mark.parametrize("labels, attrs, parameter, message", [
    ({"a#0": ["x"]}, None, "labels", "image id 'a#0'"),
    ({"a": "person"}, None, "labels", "labels of 'a' in labels must be a list of strings"),
    ({"a": [1]}, None, "labels", "must be a list of strings"),
    ({"a": []}, {"when": object()}, "attrs", "attrs must be JSON-serialisable"),
])
def test_write_refuses_bad_values_and_writes_nothing(tmp_path, labels, attrs, parameter, message):
    path = tmp_path / "labels.json"
    with pytest.raises(ParameterError, match=message) as caught:
        write_label_file(path, labels, attrs)
    assert caught.value.parameter == parameter
    assert not path.exists() and not partial_path(path).exists()


def test_atomic_text_leaves_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "labels.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_text(path) as handle:
            handle.write("half of a new file")
            assert partial_path(path).exists()
            raise RuntimeError("killed")
    assert path.read_text() == "old" and not partial_path(path).exists()


# ------------------------------------------------------------------------------------------------- COCO

def _record(image_id: str, path: str, split: str = "train") -> ManifestRecord:
    return ManifestRecord(image_id, path, split, ("a caption",))


def _coco_file(path: Path, images, annotations, categories=None) -> Path:
    """A COCO instances file with the fields the real ones have (segmentation polygons, bbox, area, …)."""
    categories = categories or [{"supercategory": "person", "id": 1, "name": "person"},
                                {"supercategory": "vehicle", "id": 4, "name": "motorcycle"},
                                {"supercategory": "animal", "id": 18, "name": "dog"}]
    data = {"info": {"description": "test", "year": 2014}, "licenses": [{"id": 1, "name": "x", "url": "y"}],
            "images": [{"license": 1, "file_name": name, "height": 480, "width": 640, "id": image_id}
                       for image_id, name in images],
            "annotations": [{"segmentation": [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], "area": 10.5, "iscrowd": 0,
                             "image_id": image_id, "bbox": [1.0, 2.0, 3.0, 4.0], "category_id": cid, "id": n}
                            for n, (image_id, cid) in enumerate(annotations, 1)],
            "categories": categories}
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def coco(tmp_path):
    """instances_val2014.json: 3 images, 4 annotations (one image has two people), 3 categories; a manifest of
    those 3 images and one train2014 image that only instances_train2014.json has."""
    val = _coco_file(tmp_path / "instances_val2014.json",
                     [(391895, "COCO_val2014_000000391895.jpg"), (522418, "COCO_val2014_000000522418.jpg"),
                      (184613, "COCO_val2014_000000184613.jpg")],
                     [(391895, 1), (391895, 4), (391895, 1), (522418, 18)])
    train = _coco_file(tmp_path / "instances_train2014.json", [(57870, "COCO_train2014_000000057870.jpg")],
                       [(57870, 18)])
    manifest = tmp_path / "manifest.jsonl"
    write_manifest(manifest, [_record("coco_391895", "val2014/COCO_val2014_000000391895.jpg", "test"),
                              _record("coco_57870", "train2014/COCO_train2014_000000057870.jpg"),
                              _record("coco_522418", "val2014/COCO_val2014_000000522418.jpg", "restval"),
                              _record("coco_184613", "val2014/COCO_val2014_000000184613.jpg", "val")])
    return val, train, manifest


def test_coco_labels_end_to_end(run_cli, coco, tmp_path):
    val, train, manifest = coco
    out = tmp_path / "out" / "instance_labels.json"
    result = run_cli("pipeline", "labels", "coco", "--instances", val, "--manifest", manifest, "--out", out)
    assert (f"wrote {out}: labels for 3 of 4 manifest images (3 labels; 1 images with none); 1 images not found "
            "in the annotations, left out (first: coco_57870 train2014/COCO_train2014_000000057870.jpg)"
            in result.output)
    assert "warning: retr-train jgcar --labels needs an entry for every training image" in result.output
    assert read_label_file(out) == {"coco_391895": ["motorcycle", "person"], "coco_522418": ["dog"],
                                    "coco_184613": []}
    attrs = read_label_attrs(out)
    assert attrs["source"] == "coco-instances" and attrs["inputs"] == ["instances_val2014.json"]
    assert attrs["vocabulary"] == ["dog", "motorcycle", "person"] and attrs["unmatched_images"] == 1
    assert attrs["manifest_sha256"] == manifest_sha256(manifest) and attrs["num_images"] == 3
    # Both files, written the way the brief's users type them (--instances A B): every image, manifest order.
    result = run_cli("pipeline", "labels", "coco", "--instances", train, val, "--manifest", manifest,
                     "--out", out.with_suffix(".jsonl"))
    assert "labels for 4 of 4 manifest images" in result.output and "warning" not in result.output
    both = read_label_file(out.with_suffix(".jsonl"))
    assert list(both) == ["coco_391895", "coco_57870", "coco_522418", "coco_184613"]
    assert both["coco_57870"] == ["dog"]
    assert read_label_attrs(out.with_suffix(".jsonl"))["inputs"] == ["instances_train2014.json",
                                                                     "instances_val2014.json"]


def test_coco_2017_files_join_by_the_manifest_id(run_cli, coco, tmp_path):
    """instances_val2017.json names files by the bare id; a Karpathy manifest's coco_<cocoid> ids still join."""
    _, _, manifest = coco
    val2017 = _coco_file(tmp_path / "instances_val2017.json",
                         [(391895, "000000391895.jpg"), (522418, "000000522418.jpg")], [(391895, 4)])
    out = tmp_path / "labels.json"
    result = run_cli("pipeline", "labels", "coco", "--instances", val2017, "--manifest", manifest, "--out", out)
    assert "labels for 2 of 4 manifest images" in result.output
    assert read_label_file(out) == {"coco_391895": ["motorcycle"], "coco_522418": []}


def test_coco_join_keys_that_disagree_stop(run_cli, coco, tmp_path):
    val, _, _ = coco
    manifest = tmp_path / "other.jsonl"
    write_manifest(manifest, [_record("coco_5", "val2014/COCO_val2014_000000391895.jpg")])
    code, out, err = run_cli.as_user("pipeline", "labels", "coco", "--instances", val, "--manifest", manifest,
                                     "--out", tmp_path / "labels.json")
    assert code == 1 and out == ""
    assert err == ("error: manifest image coco_5 (val2014/COCO_val2014_000000391895.jpg) is COCO image 391895 by "
                   "its file name but 5 by its id; the manifest and the instance files disagree\n")


def test_coco_errors_are_one_line(run_cli, coco, tmp_path):
    val, _, _ = coco
    out = tmp_path / "labels.json"
    flickr = tmp_path / "flickr.jsonl"
    write_manifest(flickr, [_record("f30k_1000092795", "1000092795.jpg")])
    cases = {
        "no match": ([val], flickr, f"error: none of the 1 images of {flickr} is in instances_val2014.json (joined "
                                    f"by file name, e.g. 1000092795.jpg, and by coco_<id> ids; the instance files "
                                    f"name e.g. COCO_val2014_000000391895.jpg); are they the same dataset?"),
    }
    broken = tmp_path / "instances_broken.json"
    broken.write_text('{"images": [')
    cases["malformed"] = ([broken], flickr, f"error: {broken}: not valid JSON (Expecting value at line 1)")
    captions = tmp_path / "captions_val2014.json"
    captions.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.jpg"}],
                                    "annotations": [{"image_id": 1, "id": 2, "caption": "a dog"}]}))
    cases["captions"] = ([captions], flickr, f"error: {captions}: not a COCO instances file (no 'categories' "
                                             "list) — a captions file? give instances_*.json")
    stray = _coco_file(tmp_path / "instances_stray.json", [(1, "a.jpg")], [(1, 99)])
    cases["unknown category"] = ([stray], flickr, f"error: {stray}: annotations[0] has category_id 99, which "
                                                  "'categories' does not list")
    absent = tmp_path / "annotations" / "instances_train2014.json"
    cases["missing"] = ([absent], flickr, f"error: COCO instance annotations instances_train2014.json not found "
                                          f"(looked in {absent.parent}); download annotations_trainval2014.zip")
    for name, (files, manifest, expected) in cases.items():
        code, stdout, err = run_cli.as_user("pipeline", "labels", "coco", "--instances", *files,
                                            "--manifest", manifest, "--out", out)
        assert code == 1 and stdout == "", name
        assert err.startswith(expected) and err.count("\n") == 1, (name, err)
        assert not out.exists() and not partial_path(out).exists(), name


# ------------------------------------------------------------------------------------ Flickr30K Entities

SENTENCES = {
    "1000092795": [
        "[/EN#1/people Two young guys] with [/EN#2/bodyparts shaggy hair] look at [/EN#3/bodyparts their hands] "
        "while hanging out in [/EN#4/scene the yard] .",
        "[/EN#1/people Two young , White males] are outside near [/EN#5/other many bushes] .",
        "[/EN#1/people Two men] in [/EN#6/clothing green shirts] are standing in [/EN#4/scene a yard] .",
        "[/EN#7/people A man] in [/EN#8/clothing a blue shirt] standing in [/EN#4/scene a garden] .",
        "[/EN#1/people Two friends] enjoy [/EN#0/notvisual time] spent together .",
    ],
    "10002456": [
        "[/EN#12/people/bodyparts Several men] in [/EN#13/clothing hard hats] are operating "
        "[/EN#14/other a giant pulley system] .",
        "[/EN#12/people Workers] look down from [/EN#15/other up] on [/EN#16/other a piece of equipment] .",
        "[/EN#12/people Two men] working on [/EN#17/other a machine] wearing [/EN#13/clothing hard hats] .",
        "[/EN#12/people Four men] on top of [/EN#18/other a tall structure] .",
        "[/EN#12/people Three men] on [/EN#17/other a large rig] .",
    ],
}


@pytest.fixture
def f30k(tmp_path):
    sentences = tmp_path / "Flickr30kEntities" / "Sentences"
    sentences.mkdir(parents=True)
    for stem, lines in SENTENCES.items():
        (sentences / f"{stem}.txt").write_text("\n".join(lines) + "\n")
    manifest = tmp_path / "manifest.jsonl"
    write_manifest(manifest, [_record("f30k_10002456", "10002456.jpg"), _record("f30k_1000092795", "1000092795.jpg"),
                              _record("f30k_1007129816", "1007129816.jpg", "test")])
    return sentences, manifest


def test_entity_sentence_parsing():
    assert parse_entity_sentence(SENTENCES["10002456"][0]) == [(12, ("people", "bodyparts")), (13, ("clothing",)),
                                                              (14, ("other",))]
    assert parse_entity_sentence("A dog runs .") == []
    with pytest.raises(UserError, match=r"^f:3: not a Flickr30K Entities sentence"):
        parse_entity_sentence("[/EN#1/people A man with a hat .", "f:3")
    with pytest.raises(UserError, match=r"^f:1: unknown entity type 'robots'"):
        parse_entity_sentence("[/EN#1/robots A robot] .", "f:1")


HEADS = {"f30k_10002456": ["equipment", "hat", "machine", "man", "rig", "structure", "system", "worker"],
         "f30k_1000092795": ["bush", "friend", "garden", "guy", "hair", "hand", "male", "man", "shirt", "yard"]}


def test_f30k_entity_labels_end_to_end(run_cli, f30k, tmp_path):
    """The default reading: the head nouns of the phrases (lower case, singular), union over five sentences."""
    sentences, manifest = f30k
    out = tmp_path / "entity_labels.json"
    result = run_cli("pipeline", "labels", "f30k-entities", "--sentences", sentences, "--manifest", manifest,
                     "--out", out)
    assert "labels for 2 of 3 manifest images (17 labels; 0 images with none); 1 images not found" in result.output
    assert "labels: head nouns of the entity phrases" in result.output and "--f30k-labels types" in result.output
    # "Two young , White males" → male, "their hands" → hand, "a piece of equipment" → equipment; "up" and the
    # notvisual "time" give none.
    assert read_label_file(out) == HEADS
    attrs = read_label_attrs(out)
    assert attrs["source"] == "f30k-entities" and attrs["excluded_types"] == ["notvisual"]
    assert attrs["f30k_labels"] == "heads" and attrs["label_reading"].startswith("head nouns of the entity phrases")
    assert attrs["boxed_only"] is False
    assert attrs["vocabulary"] == sorted(set(HEADS["f30k_10002456"]) | set(HEADS["f30k_1000092795"]))


def test_f30k_types_reading_is_an_option(run_cli, f30k, tmp_path):
    sentences, manifest = f30k
    out = tmp_path / "entity_types.jsonl"
    result = run_cli("pipeline", "labels", "f30k-entities", "--sentences", sentences, "--manifest", manifest,
                     "--out", out, "--f30k-labels", "types")
    assert "labels for 2 of 3 manifest images (8 labels; 0 images with none); 1 images not found" in result.output
    assert "--f30k-labels heads" in result.output
    # Union over the five sentences; a phrase's several types all count; notvisual never does.
    assert read_label_file(out) == {"f30k_10002456": ["bodyparts", "clothing", "other", "people"],
                                    "f30k_1000092795": ["bodyparts", "clothing", "other", "people", "scene"]}
    attrs = read_label_attrs(out)
    assert attrs["f30k_labels"] == "types" and attrs["label_reading"].startswith("Flickr30K Entities' coarse")
    assert "notvisual" not in attrs["vocabulary"] and len(attrs["vocabulary"]) == 8
    code, stdout, err = run_cli.as_user("pipeline", "labels", "f30k-entities", "--sentences", sentences,
                                        "--manifest", manifest, "--out", out, "--f30k-labels", "objects")
    assert code == 2 and "'objects' is not one of 'heads', 'types'" in err
    with pytest.raises(UserError, match="unknown Flickr30K label reading 'objects'"):
        f30k_entity_labels([], sentences, reading="objects")


def test_f30k_annotations_keep_only_boxed_entities(run_cli, f30k, tmp_path):
    sentences, manifest = f30k
    annotations = sentences.parent / "Annotations"
    annotations.mkdir()

    def xml(boxed, scene):
        objects = "".join(f"<object><name>{c}</name><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>9</xmax>"
                          f"<ymax>9</ymax></bndbox></object>" for c in boxed)
        objects += "".join(f"<object><name>{c}</name><nobndbox>0</nobndbox><scene>1</scene></object>" for c in scene)
        return f"<annotation><size><width>500</width><height>333</height><depth>3</depth></size>{objects}</annotation>"

    (annotations / "1000092795.xml").write_text(xml([1, 7, 8], [4]))   # people, clothing boxed; the yard is scene
    (annotations / "10002456.xml").write_text(xml([12, 14], []))
    out = tmp_path / "boxed.json"
    run_cli("pipeline", "labels", "f30k-entities", "--sentences", sentences, "--annotations", annotations,
            "--manifest", manifest, "--out", out, "--f30k-labels", "types")
    assert read_label_file(out) == {"f30k_10002456": ["bodyparts", "other", "people"],
                                    "f30k_1000092795": ["clothing", "people"]}
    result = run_cli("pipeline", "labels", "f30k-entities", "--sentences", sentences, "--annotations", annotations,
                     "--manifest", manifest, "--out", out)
    assert "all entities" not in result.output
    # Chain 1 ("Two young guys", "… males", "Two men", "Two friends"), 7 ("A man"), 8 ("a blue shirt"); 12, 14.
    assert read_label_file(out) == {"f30k_10002456": ["man", "system", "worker"],
                                    "f30k_1000092795": ["friend", "guy", "male", "man", "shirt"]}
    attrs = read_label_attrs(out)
    assert attrs["f30k_labels"] == "heads" and attrs["boxed_only"] is True
    assert attrs["inputs"] == ["Sentences", "Annotations"] and "with a box" in attrs["join"]


@pytest.mark.parametrize("words, head", [
    ("A man", "man"), ("Two young , White males", "male"), ("A group of several young men", "man"),
    ("a woman 's arm", "arm"), ("The members of the soccer team", "team"), ("a crowd of people", "people"),
    ("a piece of machinery", "machinery"), ("the side of the road", "road"), ("one of the dogs", "dog"),
    ("A dog with a ball in its mouth", "dog"), ("A man wearing a hat", "man"), ("a black and white dog", "dog"),
    ("salt and pepper hair", "hair"), ("a little girl 's pink tutu", "tutu"), ("some sort of stew", "stew"),
    ("their hands", "hand"), ("black sunglasses", "sunglasses"), ("blue jeans", "jeans"), ("dresses", "dress"),
    ("two police officers", "officer"), ("firemen", "fireman"), ("children", "child"), ("puppies", "puppy"),
    ("hoodies", "hoodie"), ("leaves", "leaf"), ("sleeves", "sleeve"), ("benches", "bench"), ("horses", "horse"),
    ("buses", "bus"), ("shoes", "shoe"), ("grass", "grass"), ("a T-shirt", "t-shirt"), ("outdoors", "outdoors"),
    ("He", None), ("each other", None), ("Four", None), ("up", None), ("it", None), (",", None),
])
def test_phrase_head(words, head):
    assert phrase_head(words) == head


def test_phrase_head_without_lemma_and_singular():
    assert phrase_head("Two young men", lemma=False) == "men" and phrase_head("Two young men") == "man"
    assert [singular(w) for w in ("women", "ladies", "glasses", "boxes", "cacti", "movies", "tomatoes", "bus")] == [
        "woman", "lady", "glasses", "box", "cactus", "movie", "tomato", "bus"]


def test_entity_phrases_keep_words_and_labels_by_reading():
    line = ("[/EN#255543/people A bride] holds [/EN#255545/bodyparts/people a groom 's hand] at "
            "[/EN#255549/scene a formal reception] with [/EN#0/notvisual each other] .")
    phrases = entity_phrases(line)
    assert phrases == [EntityPhrase(255543, ("people",), "A bride"),
                       EntityPhrase(255545, ("bodyparts", "people"), "a groom 's hand"),
                       EntityPhrase(255549, ("scene",), "a formal reception"),
                       EntityPhrase(0, ("notvisual",), "each other")]
    assert parse_entity_sentence(line)[1] == (255545, ("bodyparts", "people"))
    assert entity_labels(phrases) == ["bride", "hand", "reception"]
    assert entity_labels(phrases, "types") == ["bodyparts", "people", "scene"]
    with pytest.raises(ValueError, match="reading must be one of heads, types"):
        entity_labels(phrases, "chains")


def _no_shared_fraction(labels: dict[str, list[str]]) -> float:
    sets = [set(v) for v in labels.values()]
    pairs = [(a, b) for i, a in enumerate(sets) for b in sets[i + 1:]]
    return sum(1 for a, b in pairs if not a & b) / len(pairs)


def test_generated_entities_files_heads_give_negatives_types_do_not(run_cli, tmp_path):
    """Entities-format files of 150 made-up images: both readings parse them; sharing no entity type is rare
    (JGCAR's intra-modal negatives), sharing no head noun common; --annotations drops unboxed (scene) chains."""
    folder = tmp_path / "Flickr30kEntities"
    stems = write_entities_files(folder, 150, seed=3)
    assert stems == write_entities_files(tmp_path / "again", 150, seed=3)     # deterministic
    text = (folder / "Sentences" / f"{stems[0]}.txt").read_text()
    assert len(text.splitlines()) == 5 and text.count("[/EN#") >= 5
    manifest = tmp_path / "manifest.jsonl"
    write_manifest(manifest, [_record(f"f30k_{s}", f"flickr30k-images/{s}.jpg") for s in stems])
    readings = {}
    for reading in ("heads", "types"):
        for boxed in (False, True):
            out = tmp_path / f"{reading}-{boxed}.json"
            extra = ["--annotations", folder / "Annotations"] if boxed else []
            run_cli("pipeline", "labels", "f30k-entities", "--sentences", folder / "Sentences", *extra,
                    "--manifest", manifest, "--out", out, "--f30k-labels", reading)
            readings[reading, boxed] = read_label_file(out)
            assert list(readings[reading, boxed]) == [f"f30k_{s}" for s in stems]
    heads, types = readings["heads", False], readings["types", False]
    assert all(set(v) <= {"people", "clothing", "bodyparts", "animals", "vehicles", "instruments", "scene", "other"}
               for v in types.values())
    assert len({x for v in heads.values() for x in v}) > 100
    assert _no_shared_fraction(types) < 0.08 < 0.4 < _no_shared_fraction(heads)
    assert _no_shared_fraction(readings["heads", True]) > _no_shared_fraction(heads)
    assert sum(map(len, readings["heads", True].values())) < sum(map(len, heads.values()))
    assert sum("scene" in v for v in readings["types", True].values()) < sum("scene" in v for v in types.values())


def test_bench_f30k_labels_prints_json_lines():
    bench = Path(__file__).resolve().parents[1] / "bench" / "f30k_labels.py"
    done = subprocess.run([sys.executable, str(bench), "--images", "60", "--batch", "20", "--batches", "3"],
                          capture_output=True, text=True, check=True, timeout=300)
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert rows[0]["reading"] == "dataset" and rows[0]["images"] == 60 and rows[-1]["reading"] == "done"
    by = {r["reading"]: r for r in rows[1:-1]}
    assert set(by) == {f"{r}{b}" for r in ("types", "heads", "heads-raw", "chain-heads", "heads-2sent")
                       for b in ("", "/boxed")}
    assert by["types"]["batch_negative_fraction"] < by["heads"]["batch_negative_fraction"]
    assert 0 <= by["heads/boxed"]["pairs_no_shared_label"] <= 1 and by["types"]["vocabulary"] <= 8


def test_f30k_errors_are_one_line(run_cli, f30k, tmp_path):
    sentences, manifest = f30k
    out = tmp_path / "labels.json"
    coco_manifest = tmp_path / "coco.jsonl"
    write_manifest(coco_manifest, [_record("coco_1", "val2014/COCO_val2014_000000000001.jpg")])
    code, stdout, err = run_cli.as_user("pipeline", "labels", "f30k-entities", "--sentences", sentences,
                                        "--manifest", coco_manifest, "--out", out)
    assert code == 1 and err == (f"error: none of the 1 images of {coco_manifest} has a sentence file in {sentences} "
                                 f"(looked for <file stem>.txt, e.g. {sentences / 'COCO_val2014_000000000001.txt'}); "
                                 "is it the Flickr30K Entities Sentences folder?\n")
    missing = tmp_path / "nowhere" / "Sentences"
    code, stdout, err = run_cli.as_user("pipeline", "labels", "f30k-entities", "--sentences", missing,
                                        "--manifest", manifest, "--out", out)
    assert code == 1 and err == (f"error: Flickr30K Entities Sentences folder not found (looked in {missing}); "
                                 "download annotations.zip from https://github.com/BryanPlummer/flickr30k_entities "
                                 "and unzip it (it holds Sentences/ and Annotations/)\n")
    (sentences / "10002456.txt").write_text("[/EN#12/people Several men in hard hats .\n")
    code, stdout, err = run_cli.as_user("pipeline", "labels", "f30k-entities", "--sentences", sentences,
                                        "--manifest", manifest, "--out", out)
    assert code == 1 and err.startswith(f"error: {sentences / '10002456.txt'}:1: not a Flickr30K Entities sentence")
    assert err.count("\n") == 1 and not out.exists()
    for stem in SENTENCES:   # caption files without any phrase: the wrong folder, not images without labels
        (sentences / f"{stem}.txt").write_text("Two men stand in a yard .\n")
    code, stdout, err = run_cli.as_user("pipeline", "labels", "f30k-entities", "--sentences", sentences,
                                        "--manifest", manifest, "--out", out)
    assert code == 1 and err == (f"error: no [/EN#…] phrase in any of the 2 sentence files read from {sentences}; "
                                 "is it the Sentences folder of Flickr30K Entities?\n")
