"""The synthetic dataset generator (`retr-pipeline synth`): files, determinism, pixels ↔ captions, gold parses.

The pixel checks read the decoded JPEGs and the caption text only (a regex below), never the generator's
scene records, so a caption that does not describe its image fails here.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from retr.manifests.schema import read_manifest
from retr.manifests.synthetic import (MAX_SCENES, build_caption, generate_synthetic, split_assignment,
                                      ShapeObject)

# Fill colours as the issue fixes them (the test's own copy: a changed palette must be a deliberate change).
PALETTE = {
    "red": (215, 35, 35), "green": (35, 160, 60), "blue": (40, 80, 215),
    "yellow": (240, 215, 40), "purple": (135, 55, 175), "orange": (245, 135, 25),
}
CAPTION_RE = re.compile(
    r"^(?:there is |an image of )?a (small|large) (\w+) (\w+) (?:is placed |is |sits |that is )?"
    r"(to the left of|to the right of|above|below) a (small|large) (\w+) (\w+)$")
N_IMAGES = 40
SEED = 7


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "data"
    summary = generate_synthetic(out, num_images=N_IMAGES, seed=SEED)
    assert summary.num_images == N_IMAGES and summary.num_captions == 5 * N_IMAGES
    return out


def parse_caption(caption: str) -> tuple[tuple[str, str, str], str, tuple[str, str, str]]:
    """(subject (size, colour, shape), relation word, landmark (size, colour, shape)) from the text alone."""
    match = CAPTION_RE.match(caption)
    assert match, f"caption outside the grammar: {caption!r}"
    g = match.groups()
    relation = {"to the left of": "left", "to the right of": "right"}.get(g[3], g[3])
    return (g[0], g[1], g[2]), relation, (g[4], g[5], g[6])


def describe_pixels(path: Path) -> dict[str, dict]:
    """Objects found in an image by colour: {colour: {size, shape, centroid (x, y)}}."""
    pixels = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32)
    found = {}
    for colour, rgb in PALETTE.items():
        mask = np.linalg.norm(pixels - np.array(rgb, dtype=np.float32), axis=-1) < 40
        if mask.sum() < 100:
            continue
        ys, xs = np.nonzero(mask)
        width, height = xs.max() - xs.min() + 1, ys.max() - ys.min() + 1
        fill, aspect = mask.sum() / (width * height), width / height
        if fill > 0.9:
            shape = "square"
        elif fill > 0.65:
            shape = "circle"
        elif fill < 0.43:
            shape = "star"
        else:
            shape = "diamond" if aspect < 0.9 else "triangle"
        size = "small" if max(width, height) / 2 < 23 else "large"
        found[colour] = {"size": size, "shape": shape, "centroid": (xs.mean(), ys.mean())}
    return found


def caption_holds(caption: str, seen: dict[str, dict]) -> bool:
    """Whether the objects found in an image make ``caption`` true (both objects and the relation)."""
    subject, relation, landmark = parse_caption(caption)
    for size, colour, shape in (subject, landmark):
        if colour not in seen or (seen[colour]["size"], seen[colour]["shape"]) != (size, shape):
            return False
    (sx, sy), (lx, ly) = seen[subject[1]]["centroid"], seen[landmark[1]]["centroid"]
    dx, dy = lx - sx, ly - sy  # landmark minus subject
    return {"left": dx > abs(dy), "right": -dx > abs(dy), "above": dy > abs(dx), "below": -dy > abs(dx)}[relation]


# ------------------------------------------------------------------------------------ files, manifest

def test_manifest_images_and_splits(dataset):
    records = read_manifest(dataset / "manifest.jsonl")
    assert [r.id for r in records] == [f"synth_{i:05d}" for i in range(N_IMAGES)]
    assert {r.split for r in records} == {"train", "val", "test"}
    assert sum(r.split == "test" for r in records) == sum(r.split == "val" for r in records) == 4
    for r in records:
        assert r.path == f"images/{r.id}.jpg"
        assert len(r.captions) == 5 and len(set(r.captions)) == 5
        for caption in r.captions:
            assert caption == caption.lower().strip() and not caption.endswith(".") and "  " not in caption
        with Image.open(dataset / r.path) as image:
            assert image.format == "JPEG" and image.mode == "RGB" and image.size == (224, 224)
    assert len((dataset / "scenes.jsonl").read_text().splitlines()) == N_IMAGES
    assert not list(dataset.rglob("*.partial"))


def test_split_sizes():
    for n, expected_eval in [(3, 1), (12, 1), (40, 4), (100, 10), (1000, 100)]:
        splits = split_assignment(n, seed=0)
        assert splits.count("test") == splits.count("val") == expected_eval
        assert splits.count("train") == n - 2 * expected_eval
    assert split_assignment(100, seed=0) == split_assignment(100, seed=0) != split_assignment(100, seed=1)


def test_determinism(tmp_path):
    def files(folder: Path) -> dict[str, bytes]:
        return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}

    generate_synthetic(tmp_path / "a", num_images=30, seed=3)
    generate_synthetic(tmp_path / "b", num_images=30, seed=3)
    generate_synthetic(tmp_path / "c", num_images=30, seed=4)
    a, b, c = files(tmp_path / "a"), files(tmp_path / "b"), files(tmp_path / "c")
    assert len(a) == 30 + 3 and a == b
    for name in ("manifest.jsonl", "captions.conllu", "scenes.jsonl", "images/synth_00000.jpg"):
        assert a[name] != c[name], name

    # a re-run over an existing folder with fewer images rewrites it to what a fresh run gives
    generate_synthetic(tmp_path / "a", num_images=20, seed=3)
    generate_synthetic(tmp_path / "d", num_images=20, seed=3)
    assert files(tmp_path / "a") == files(tmp_path / "d")


def test_too_many_or_too_few_images(tmp_path):
    with pytest.raises(ValueError, match=f"^num_images {MAX_SCENES + 1} is more than the {MAX_SCENES} distinct scenes"):
        generate_synthetic(tmp_path / "x", num_images=MAX_SCENES + 1)
    with pytest.raises(ValueError, match="^num_images must be at least 3"):
        generate_synthetic(tmp_path / "x", num_images=2)
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------- captions against the pixels

def test_captions_are_true_of_their_image_pixels(dataset):
    records = read_manifest(dataset / "manifest.jsonl")
    for r in records:
        seen = describe_pixels(dataset / r.path)
        assert len(seen) == 2, (r.id, sorted(seen))   # two objects of different colours, no stray colour
        for caption in r.captions:
            assert caption_holds(caption, seen), (r.id, caption, seen)


def test_every_caption_identifies_exactly_its_image(dataset):
    """Unambiguity: no caption is shared, and from pixels alone each caption matches only its own image."""
    records = read_manifest(dataset / "manifest.jsonl")
    all_captions = [c for r in records for c in r.captions]
    assert len(all_captions) == len(set(all_captions))
    seen = {r.id: describe_pixels(dataset / r.path) for r in records}
    for r in records:
        for caption in r.captions:
            matches = [image_id for image_id, found in seen.items() if caption_holds(caption, found)]
            assert matches == [r.id], (caption, matches)


def test_relation_variety(dataset):
    relations = {parse_caption(c)[1] for r in read_manifest(dataset / "manifest.jsonl") for c in r.captions}
    assert relations == {"left", "right", "above", "below"}


# ---------------------------------------------------------------------------------------- CoNLL-U

def test_conllu_parses_with_stanza(dataset):
    from stanza.utils.conll import CoNLL

    records = read_manifest(dataset / "manifest.jsonl")
    doc = CoNLL.conll2doc(input_str=(dataset / "captions.conllu").read_text(encoding="utf-8"))
    expected = [(f"{r.id}#{k}", c) for r in records for k, c in enumerate(r.captions)]
    assert len(doc.sentences) == len(expected)
    for sentence, (sent_id, caption) in zip(doc.sentences, expected):
        assert sentence.sent_id == sent_id
        assert sentence.text == caption
        words = [w.text for w in sentence.words]
        assert words == caption.split()
        heads = [w.head for w in sentence.words]
        assert sum(h == 0 for h in heads) == 1 and all(0 <= h <= len(words) for h in heads)
        assert [w.deprel for w in sentence.words if w.head == 0] == ["root"]
        tree = sentence.constituency
        assert tree is not None and tree.label == "ROOT"
        assert list(tree.leaf_labels()) == words
        # preterminals are the XPOS column
        assert [t.label for t in tree.yield_preterminals()] == [w.xpos for w in sentence.words]
        # the dependency graph is a tree: following heads from any word reaches the root without a cycle
        for start in range(1, len(words) + 1):
            node, steps = start, 0
            while node != 0:
                node, steps = heads[node - 1], steps + 1
                assert steps <= len(words)


def _deps(parse) -> dict[str, tuple[str, str]]:
    """word → (deprel, head word) for a caption whose words are all distinct."""
    forms = [t.form for t in parse.tokens]
    return {t.form: (t.deprel, forms[t.head - 1] if t.head else "ROOT") for t in parse.tokens}


SMALL_RED_CIRCLE = ShapeObject("small", "red", "circle")
LARGE_BLUE_SQUARE = ShapeObject("large", "blue", "square")


def test_gold_parse_of_the_bare_noun_phrase():
    parse = build_caption("np", SMALL_RED_CIRCLE, "left", LARGE_BLUE_SQUARE)
    assert parse.text == "a small red circle to the left of a large blue square"
    assert parse.constituency == (
        "(ROOT (NP (NP (DT a) (JJ small) (JJ red) (NN circle)) (PP (IN to) (NP (NP (DT the) (NN left)) "
        "(PP (IN of) (NP (DT a) (JJ large) (JJ blue) (NN square)))))))")
    deps = _deps(parse)
    assert deps["circle"] == ("root", "ROOT")
    assert deps["small"] == deps["red"] == ("amod", "circle")
    assert deps["left"] == ("nmod", "circle") and deps["to"] == ("case", "left") and deps["the"] == ("det", "left")
    assert deps["square"] == ("nmod", "left") and deps["of"] == ("case", "square")
    assert deps["large"] == ("amod", "square")


def test_gold_parses_of_the_clausal_templates():
    passive = build_caption("passive", SMALL_RED_CIRCLE, "below", LARGE_BLUE_SQUARE)
    assert passive.text == "a small red circle is placed below a large blue square"
    deps = _deps(passive)
    assert deps["placed"] == ("root", "ROOT") and deps["is"] == ("aux:pass", "placed")
    assert deps["circle"] == ("nsubj:pass", "placed") and deps["square"] == ("obl", "placed")
    assert deps["below"] == ("case", "square")
    rows = {t.form: t for t in passive.tokens}
    assert (rows["placed"].upos, rows["placed"].xpos, rows["placed"].lemma) == ("VERB", "VBN", "place")
    assert (rows["is"].upos, rows["is"].lemma) == ("AUX", "be")

    copula = _deps(build_caption("copula", LARGE_BLUE_SQUARE, "right", SMALL_RED_CIRCLE))
    assert copula["right"] == ("root", "ROOT") and copula["is"] == ("cop", "right")
    assert copula["square"] == ("nsubj", "right") and copula["circle"] == ("nmod", "right")

    there = build_caption("there", SMALL_RED_CIRCLE, "above", LARGE_BLUE_SQUARE)
    assert there.text == "there is a small red circle above a large blue square"
    deps = _deps(there)
    assert deps["is"] == ("root", "ROOT") and deps["there"] == ("expl", "is")
    assert deps["circle"] == ("nsubj", "is") and deps["square"] == ("nmod", "circle")

    sits = build_caption("sits", SMALL_RED_CIRCLE, "above", LARGE_BLUE_SQUARE)
    assert _deps(sits)["square"] == ("obl", "sits") and sits.tokens[4].lemma == "sit"

    relcl = _deps(build_caption("relcl", SMALL_RED_CIRCLE, "above", LARGE_BLUE_SQUARE))
    assert relcl["circle"] == ("root", "ROOT") and relcl["square"] == ("acl:relcl", "circle")
    assert relcl["that"] == ("nsubj", "square") and relcl["is"] == ("cop", "square")

    image = _deps(build_caption("image", SMALL_RED_CIRCLE, "left", LARGE_BLUE_SQUARE))
    assert image["image"] == ("root", "ROOT") and image["an"] == ("det", "image")
    assert image["circle"] == ("nmod", "image") and image["left"] == ("nmod", "circle")


# ------------------------------------------------------------------------------------------------ CLI

def test_cli_writes_dataset_and_prints_one_line(tmp_path, run_cli):
    result = run_cli("pipeline", "synth", "--out", tmp_path / "s", "--images", "20", "--seed", "1", "--quiet")
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "20 images" in lines[0] and "100 captions" in lines[0]
    assert len(read_manifest(tmp_path / "s" / "manifest.jsonl")) == 20


def test_cli_help_has_example(run_cli):
    result = run_cli("pipeline", "synth", "--help")
    assert "Example:" in result.output
    assert "    retr-pipeline synth --out data/synthetic --images 240 --seed 0\n" in result.output


def test_cli_too_many_images_is_one_error_line(tmp_path, run_cli):
    code, _, err = run_cli.as_user("pipeline", "synth", "--out", tmp_path / "s", "--images", MAX_SCENES + 1)
    assert code != 0
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and str(MAX_SCENES) in err
    assert "Traceback" not in err
