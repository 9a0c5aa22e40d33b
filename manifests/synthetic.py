"""The synthetic dataset: coloured-shape scenes, five unambiguous captions each, and their gold parses.

Files, scenes, rendering, caption templates, parse conventions and determinism: docs/extraction.md ("The synthetic
dataset")."""
from __future__ import annotations

import io
import json
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
from PIL import Image, ImageDraw

from retr.common.atomic import atomic_file, atomic_text
from retr.common.errors import ParameterError, UserError
from retr.manifests.schema import ManifestRecord, write_manifest
from retr.store.conllu import ConlluRow

IMAGE_SIZE = 224
SIZES = ("small", "large")
#: Colour name → fill RGB. Pairwise distances are ≥ 80 and every colour is ≥ 100 from any background gray.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35),
    "green": (35, 160, 60),
    "blue": (40, 80, 215),
    "yellow": (240, 215, 40),
    "purple": (135, 55, 175),
    "orange": (245, 135, 25),
}
SHAPES = ("circle", "square", "triangle", "star", "diamond")
RELATIONS = ("left", "above")
#: Radius ranges in pixels (inclusive) per size word.
RADIUS_RANGE = {"small": (14, 20), "large": (30, 40)}
MARGIN = 6          # px between an object's circumscribed circle and the border
GAP = 10            # px between the two objects' circumscribed circles
DOMINANCE = 0.35    # the off-axis centre offset is at most this fraction of the on-axis offset
NOISE = 4           # background/object noise amplitude (uniform integers in [-NOISE, NOISE])
CAPTIONS_PER_IMAGE = 5
ID_PREFIX = "synth_"
#: the files :func:`generate_synthetic` writes into its folder (besides ``images/``)
MANIFEST, CONLLU, SCENES = "manifest.jsonl", "captions.conllu", "scenes.jsonl"

MAX_SCENES = len(SIZES) * len(COLOURS) * len(SHAPES) * (len(SIZES) * (len(COLOURS) - 1) * len(SHAPES)) \
    * len(RELATIONS)


# --------------------------------------------------------------------------------------------- scenes

@dataclass(frozen=True)
class ShapeObject:
    """What a caption says about one object."""

    size: str
    colour: str
    shape: str

    def words(self) -> tuple[str, str, str]:
        return (self.size, self.colour, self.shape)


@dataclass(frozen=True)
class PlacedObject:
    """An object with its place: ``centre`` (x, y) and circumscribed ``radius``, in pixels."""

    object: ShapeObject
    centre: tuple[int, int]
    radius: int


@dataclass(frozen=True)
class Scene:
    """Two objects: ``first`` is to the left of (``relation="left"``) or above (``"above"``) ``second``."""

    first: PlacedObject
    relation: str
    second: PlacedObject
    background: int = 170

    def to_json(self, image_id: str) -> str:
        def obj(p: PlacedObject) -> dict:
            o = p.object
            return {"size": o.size, "colour": o.colour, "shape": o.shape, "centre": list(p.centre),
                    "radius": p.radius}
        return json.dumps({"id": image_id, "relation": self.relation,
                           "objects": [obj(self.first), obj(self.second)]})


def all_scene_keys() -> list[tuple[ShapeObject, str, ShapeObject]]:
    """Every distinct (A, relation, B) in a fixed order; ``len(...) == MAX_SCENES``."""
    objects = [ShapeObject(s, c, h) for s in SIZES for c in COLOURS for h in SHAPES]
    return [(a, rel, b) for a in objects for b in objects if a.colour != b.colour for rel in RELATIONS]


def place_scene(key: tuple[ShapeObject, str, ShapeObject], rng: random.Random) -> Scene:
    """Draw radii, centres and background gray for a scene key so that the relation is clear (docs/extraction.md)."""
    a, relation, b = key
    ra = rng.randint(*RADIUS_RANGE[a.size])
    rb = rng.randint(*RADIUS_RANGE[b.size])
    background = rng.randint(140, 200)
    lo = ra + rb + GAP
    hi = IMAGE_SIZE - 2 * MARGIN - ra - rb
    for _ in range(10_000):
        d = rng.randint(lo, hi)                                   # on-axis offset, B minus A
        pa = rng.randint(MARGIN + ra, IMAGE_SIZE - MARGIN - rb - d)
        qa = rng.randint(MARGIN + ra, IMAGE_SIZE - MARGIN - ra)   # off-axis coordinate of A
        limit = int(DOMINANCE * d)
        qb = qa + rng.randint(-limit, limit)
        if not MARGIN + rb <= qb <= IMAGE_SIZE - MARGIN - rb:
            continue
        if relation == "left":
            ca, cb = (pa, qa), (pa + d, qb)
        else:
            ca, cb = (qa, pa), (qb, pa + d)
        return Scene(PlacedObject(a, ca, ra), relation, PlacedObject(b, cb, rb), background)
    raise RuntimeError(f"could not place scene {key}")  # unreachable for the constants above


# ------------------------------------------------------------------------------------------ rendering

def shape_polygon(shape: str, centre: tuple[float, float], radius: float) -> list[tuple[float, float]] | None:
    """Vertices (x, y) of a polygonal shape, or ``None`` for the circle."""
    cx, cy = centre
    r = radius

    def ring(radii: Sequence[float], start_deg: float = -90.0) -> list[tuple[float, float]]:
        n = len(radii)
        return [(cx + rr * math.cos(math.radians(start_deg + 360.0 * k / n)),
                 cy + rr * math.sin(math.radians(start_deg + 360.0 * k / n))) for k, rr in enumerate(radii)]

    if shape == "circle":
        return None
    if shape == "square":
        h = 0.85 * r
        return [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    if shape == "triangle":
        return ring([r, r, r])
    if shape == "star":
        return ring([r, 0.4 * r] * 5)
    if shape == "diamond":
        return [(cx, cy - r), (cx + 0.7 * r, cy), (cx, cy + r), (cx - 0.7 * r, cy)]
    raise ValueError(f"unknown shape {shape!r}")


def render_scene(scene: Scene, noise_rng: np.random.Generator | None = None) -> Image.Image:
    """The scene as a 224×224 RGB image; ``noise_rng`` adds uniform integer noise in [-4, 4] (none if None)."""
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (scene.background,) * 3)
    draw = ImageDraw.Draw(image)
    for placed in (scene.first, scene.second):
        fill = COLOURS[placed.object.colour]
        polygon = shape_polygon(placed.object.shape, placed.centre, placed.radius)
        if polygon is None:
            cx, cy = placed.centre
            r = placed.radius
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
        else:
            draw.polygon(polygon, fill=fill)
    if noise_rng is None:
        return image
    pixels = np.asarray(image, dtype=np.int16)
    pixels = pixels + noise_rng.integers(-NOISE, NOISE + 1, size=pixels.shape, dtype=np.int16)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def encode_jpeg(image: Image.Image) -> bytes:
    """JPEG bytes (quality 95, 4:4:4 so colours do not bleed across object borders)."""
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95, subsampling=0)
    return buffer.getvalue()


# ----------------------------------------------------------------------------- captions and parses

@dataclass(frozen=True)
class Word:
    """A leaf: the token and its CoNLL-U columns (FEATS ``"_"`` when empty)."""

    form: str
    lemma: str
    upos: str
    xpos: str
    feats: str = "_"


@dataclass(frozen=True)
class Phrase:
    """A constituent: ``children`` are ``(deprel, node)`` pairs, exactly one with deprel ``"head"``."""

    label: str
    children: tuple[tuple[str, "Phrase | Word"], ...]

    def __post_init__(self) -> None:
        if sum(1 for rel, _ in self.children if rel == "head") != 1:
            raise ValueError(f"{self.label} phrase needs exactly one head child")


@dataclass(frozen=True)
class ParsedCaption:
    """A caption with its gold parse: ``tokens`` (CoNLL-U rows) and ``constituency`` (``(ROOT …)``)."""

    text: str
    template: str
    tokens: tuple[ConlluRow, ...]
    constituency: str


_FIN = "Mood=Ind|Number=Sing|Person=3|Tense=Pres|VerbForm=Fin"


def _det(form: str) -> Word:
    definite = "Def" if form == "the" else "Ind"
    return Word(form, "a" if form == "an" else form, "DET", "DT", f"Definite={definite}|PronType=Art")


def _adj(form: str) -> Word:
    return Word(form, form, "ADJ", "JJ", "Degree=Pos")


def _noun(form: str) -> Word:
    return Word(form, form, "NOUN", "NN", "Number=Sing")


def _adp(form: str) -> Word:
    return Word(form, form, "ADP", "IN")


def _is(upos: str) -> Word:
    return Word("is", "be", upos, "VBZ", _FIN)


def _head(node: Phrase | Word) -> tuple[str, Phrase | Word]:
    return ("head", node)


def noun_phrase(obj: ShapeObject) -> Phrase:
    """``(NP (DT a) (JJ small) (JJ red) (NN circle))``."""
    return Phrase("NP", (("det", _det("a")), ("amod", _adj(obj.size)), ("amod", _adj(obj.colour)),
                         _head(_noun(obj.shape))))


def relation_phrase(relation: str, landmark: ShapeObject) -> Phrase:
    """The PP "to the left of X" / "to the right of X" (head: left/right) or "above X" / "below X" (head: X)."""
    landmark_np = noun_phrase(landmark)
    if relation in ("left", "right"):
        side = Phrase("NP", (("det", _det("the")), _head(_noun(relation))))
        of_pp = Phrase("PP", (("case", _adp("of")), _head(landmark_np)))
        return Phrase("PP", (("case", _adp("to")), _head(Phrase("NP", (_head(side), ("nmod", of_pp))))))
    if relation in ("above", "below"):
        return Phrase("PP", (("case", _adp(relation)), _head(landmark_np)))
    raise ValueError(f"unknown relation {relation!r}")


def _np_with_pp(subject: Phrase, pp: Phrase) -> Phrase:
    return Phrase("NP", (_head(subject), ("nmod", pp)))


def _template_np(subject: Phrase, pp: Phrase) -> Phrase:
    return _np_with_pp(subject, pp)


def _template_there(subject: Phrase, pp: Phrase) -> Phrase:
    there = Phrase("NP", (_head(Word("there", "there", "PRON", "EX")),))
    return Phrase("S", (("expl", there),
                        _head(Phrase("VP", (_head(_is("VERB")), ("nsubj", _np_with_pp(subject, pp)))))))


def _template_copula(subject: Phrase, pp: Phrase) -> Phrase:
    return Phrase("S", (("nsubj", subject), _head(Phrase("VP", (("cop", _is("AUX")), _head(pp))))))


def _template_sits(subject: Phrase, pp: Phrase) -> Phrase:
    sits = Word("sits", "sit", "VERB", "VBZ", _FIN)
    return Phrase("S", (("nsubj", subject), _head(Phrase("VP", (_head(sits), ("obl", pp))))))


def _template_passive(subject: Phrase, pp: Phrase) -> Phrase:
    placed = Word("placed", "place", "VERB", "VBN", "Tense=Past|VerbForm=Part|Voice=Pass")
    inner = Phrase("VP", (_head(placed), ("obl", pp)))
    return Phrase("S", (("nsubj:pass", subject), _head(Phrase("VP", (("aux:pass", _is("AUX")), _head(inner))))))


def _template_relcl(subject: Phrase, pp: Phrase) -> Phrase:
    that = Phrase("WHNP", (_head(Word("that", "that", "PRON", "WDT", "PronType=Rel")),))
    clause = Phrase("S", (_head(Phrase("VP", (("cop", _is("AUX")), _head(pp)))),))
    return Phrase("NP", (_head(subject), ("acl:relcl", Phrase("SBAR", (("nsubj", that), _head(clause))))))


def _template_image(subject: Phrase, pp: Phrase) -> Phrase:
    image = Phrase("NP", (("det", _det("an")), _head(_noun("image"))))
    of_pp = Phrase("PP", (("case", _adp("of")), _head(_np_with_pp(subject, pp))))
    return Phrase("NP", (_head(image), ("nmod", of_pp)))


#: Template name → builder(subject NP, relation PP) → the caption's top constituent (below ROOT).
TEMPLATES: dict[str, Callable[[Phrase, Phrase], Phrase]] = {
    "np": _template_np,
    "there": _template_there,
    "copula": _template_copula,
    "sits": _template_sits,
    "passive": _template_passive,
    "relcl": _template_relcl,
    "image": _template_image,
}
INVERSE = {"left": "right", "right": "left", "above": "below", "below": "above"}


def _leaves(node: Phrase | Word) -> Iterator[Word]:
    if isinstance(node, Word):
        yield node
    else:
        for _, child in node.children:
            yield from _leaves(child)


def bracket(node: Phrase | Word) -> str:
    """Penn-Treebank bracketing of a node: ``(NP (DT a) (NN circle))``."""
    if isinstance(node, Word):
        return f"({node.xpos} {node.form})"
    return f"({node.label} " + " ".join(bracket(child) for _, child in node.children) + ")"


def parse_tree(top: Phrase, template: str = "") -> ParsedCaption:
    """Read the caption text, dependency rows and ``(ROOT …)`` bracket off one phrase-structure tree."""
    words = list(_leaves(top))
    index = {id(w): i + 1 for i, w in enumerate(words)}  # Word objects are distinct instances per leaf
    if len(index) != len(words):
        raise ValueError("a Word instance occurs twice in the tree")
    attach: dict[int, tuple[int, str]] = {}

    def lexical_head(node: Phrase | Word) -> int:
        if isinstance(node, Word):
            return index[id(node)]
        heads = [(rel, lexical_head(child)) for rel, child in node.children]
        head = next(h for rel, h in heads if rel == "head")
        for rel, h in heads:
            if rel != "head":
                attach[h] = (head, rel)
        return head

    attach[lexical_head(top)] = (0, "root")
    tokens = tuple(ConlluRow(i, w.form, w.lemma, w.upos, w.xpos, w.feats, *attach[i])
                   for i, w in enumerate(words, start=1))
    text = " ".join(w.form for w in words)
    return ParsedCaption(text, template, tokens, f"(ROOT {bracket(top)})")


def build_caption(template: str, subject: ShapeObject, relation: str, landmark: ShapeObject) -> ParsedCaption:
    """One caption: ``subject`` is ``relation`` (left/right/above/below) of ``landmark``, in ``template``."""
    top = TEMPLATES[template](noun_phrase(subject), relation_phrase(relation, landmark))
    return parse_tree(top, template)


def caption_parses(scene: Scene, rng: random.Random, count: int = CAPTIONS_PER_IMAGE) -> list[ParsedCaption]:
    """``count`` captions of ``scene`` from distinct templates, each randomly stated from either object's side."""
    if not 1 <= count <= len(TEMPLATES):
        raise ValueError(f"count must be in 1..{len(TEMPLATES)}")
    a, b = scene.first.object, scene.second.object
    relation = scene.relation
    parses = []
    for template in rng.sample(sorted(TEMPLATES), count):
        if rng.random() < 0.5:
            parses.append(build_caption(template, a, relation, b))
        else:
            parses.append(build_caption(template, b, INVERSE[relation], a))
    return parses


def conllu_block(sent_id: str, parse: ParsedCaption) -> str:
    """One CoNLL-U sentence (comments, rows, blank line)."""
    lines = [f"# sent_id = {sent_id}", f"# text = {parse.text}", f"# constituency = {parse.constituency}"]
    lines += [token.line() for token in parse.tokens]
    return "\n".join(lines) + "\n\n"


def write_conllu(path: str | os.PathLike, sentences: Sequence[tuple[str, ParsedCaption]]) -> int:
    """Write ``(sent_id, parse)`` pairs as CoNLL-U (through a temporary file renamed at the end)."""
    with atomic_file(path) as partial, open(partial, "w", encoding="utf-8", newline="\n") as handle:
        for sent_id, parse in sentences:
            handle.write(conllu_block(sent_id, parse))
    return len(sentences)


# ------------------------------------------------------------------------------------------ dataset

@dataclass(frozen=True)
class SyntheticSummary:
    """What :func:`generate_synthetic` wrote."""

    out_dir: Path
    num_images: int
    num_captions: int
    split_counts: dict[str, int] = field(default_factory=dict)


def image_id(index: int) -> str:
    """``synth_00042``."""
    return f"{ID_PREFIX}{index:05d}"


def split_assignment(num_images: int, seed: int) -> list[str]:
    """The split of each image: ``max(1, round(N / 10))`` test and val images, chosen by a seeded shuffle."""
    num_eval = max(1, round(num_images / 10))
    order = list(range(num_images))
    random.Random(f"retr-synth:{seed}:splits").shuffle(order)
    splits = ["train"] * num_images
    for i in order[:num_eval]:
        splits[i] = "test"
    for i in order[num_eval:2 * num_eval]:
        splits[i] = "val"
    return splits


def check_num_images(num_images: int) -> None:
    """Raise a :class:`~retr.common.errors.ParameterError` unless ``3 <= num_images <= MAX_SCENES``."""
    if num_images < 3:
        raise ParameterError(f"num_images must be at least 3 (one each for train, val and test), got {num_images}",
                             "num_images")
    if num_images > MAX_SCENES:
        raise ParameterError(f"num_images {num_images} is more than the {MAX_SCENES} distinct scenes the synthetic "
                             f"generator can make (every scene appears once so that each caption matches one "
                             f"image); use num_images {MAX_SCENES} or fewer", "num_images")


def iter_scenes(num_images: int, seed: int) -> Iterator[tuple[str, Scene, list[ParsedCaption], np.random.Generator]]:
    """``(id, scene, captions, noise generator)`` for images 0 … N-1, deterministic for ``seed``."""
    keys = all_scene_keys()
    random.Random(f"retr-synth:{seed}:scenes").shuffle(keys)
    for i in range(num_images):
        rng = random.Random(f"retr-synth:{seed}:image:{i}")
        scene = place_scene(keys[i], rng)
        parses = caption_parses(scene, rng)
        noise = np.random.default_rng([abs(seed), int(seed < 0), i])
        yield image_id(i), scene, parses, noise


def generate_synthetic(out_dir: str | os.PathLike, num_images: int = 1000, seed: int = 0,
                       progress: Callable[[Iterator], Iterator] | None = None) -> SyntheticSummary:
    """Write the synthetic dataset of ``num_images`` images into ``out_dir``; ``progress`` wraps the per-image iterator."""
    check_num_images(num_images)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output folder {out_dir} exists and is not a folder")
    images_dir = out_dir / "images"
    images_dir.mkdir(parents=True, exist_ok=True)

    splits = split_assignment(num_images, seed)
    records: list[ManifestRecord] = []
    sentences: list[tuple[str, ParsedCaption]] = []
    scene_lines: list[str] = []
    items: Iterator = iter_scenes(num_images, seed)
    if progress is not None:
        items = progress(items)
    for (sid, scene, parses, noise), split in zip(items, splits):
        rel_path = f"images/{sid}.jpg"
        (out_dir / rel_path).write_bytes(encode_jpeg(render_scene(scene, noise)))
        records.append(ManifestRecord(sid, rel_path, split, tuple(p.text for p in parses)))
        sentences.extend((f"{sid}#{k}", p) for k, p in enumerate(parses))
        scene_lines.append(scene.to_json(sid))

    wanted = {f"{r.id}.jpg" for r in records}
    for stale in images_dir.glob(f"{ID_PREFIX}*.jpg"):
        if stale.name not in wanted:
            stale.unlink()

    with atomic_text(out_dir / SCENES) as handle:
        handle.write("\n".join(scene_lines) + "\n")
    write_conllu(out_dir / CONLLU, sentences)
    write_manifest(out_dir / MANIFEST, records)  # last: a complete manifest means a complete dataset

    counts = {s: splits.count(s) for s in ("train", "val", "test")}
    return SyntheticSummary(out_dir, num_images, len(sentences), counts)
