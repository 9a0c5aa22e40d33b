"""Image labels from the datasets' own annotations (COCO instances, Flickr30K Entities), joined to a manifest.

JGCAR's intra-modal labels; the readings, joins and their measurements: docs/models-jgcar.md ("Where the labels come
from")."""
from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterable, NamedTuple, Sequence

from retr.common.errors import MissingResourceError, UserError
from retr.manifests.schema import ManifestRecord

COCO_ANNOTATIONS_HOW = ("download annotations_trainval2014.zip from https://cocodataset.org/#download "
                        "(http://images.cocodataset.org/annotations/annotations_trainval2014.zip) and unzip it")
F30K_ENTITIES_HOW = ("download annotations.zip from https://github.com/BryanPlummer/flickr30k_entities and unzip "
                     "it (it holds Sentences/ and Annotations/)")

#: Flickr30K Entities' phrase types (the coarse categories of the paper; ``notvisual`` marks unannotated ones).
F30K_TYPES = ("people", "clothing", "bodyparts", "animals", "vehicles", "instruments", "scene", "other", "notvisual")
#: Types that are never labels (docs/models-jgcar.md).
F30K_NOT_LABELS = ("notvisual",)

_COCO_KEEP = frozenset({"images", "annotations", "categories", "id", "file_name", "image_id", "category_id",
                        "name"})
_COCO_ID = re.compile(r"coco_(\d+)")
_PHRASE = re.compile(r"\[/EN#(\d+)((?:/[A-Za-z]+)+) ([^\[\]]*)\]")


@dataclass
class LabelJoin:
    """Labels of the manifest images a reader could join, and those it could not."""

    labels: dict[str, list[str]] = field(default_factory=dict)  #: image id → sorted labels, manifest order
    unmatched: list[ManifestRecord] = field(default_factory=list)  #: records with no annotation entry
    vocabulary: list[str] = field(default_factory=list)  #: every label the annotation files define/use, sorted
    join: str = ""  #: how records were joined (recorded in the file's attributes)

    def summary(self, total: int) -> str:
        empty = sum(1 for v in self.labels.values() if not v)
        line = (f"labels for {len(self.labels)} of {total} manifest images ({len(self.vocabulary)} labels; "
                f"{empty} images with none)")
        if self.unmatched:
            first = self.unmatched[0]
            line += (f"; {len(self.unmatched)} images not found in the annotations, left out "
                     f"(first: {first.id} {first.path})")
        return line


# --------------------------------------------------------------------------------------------------- COCO

def _keep_coco_fields(pairs: list[tuple[str, object]]) -> dict:
    return {key: value for key, value in pairs if key in _COCO_KEEP}


@dataclass
class CocoInstances:
    """What the join needs from one or more instance files."""

    by_file: dict[str, int] = field(default_factory=dict)  #: file_name → image id
    categories: dict[int, set[int]] = field(default_factory=dict)  #: image id → category ids
    names: dict[int, str] = field(default_factory=dict)  #: category id → name
    files: list[str] = field(default_factory=list)


def read_coco_instances(paths: Sequence[str | os.PathLike]) -> CocoInstances:
    """Images, their category ids and the category names of COCO instance files (several merge)."""
    if not paths:
        raise UserError("no COCO instance annotation file given")
    out = CocoInstances()
    for path in map(Path, paths):
        if not path.is_file():
            raise MissingResourceError(f"COCO instance annotations {path.name}", str(path.parent),
                                       COCO_ANNOTATIONS_HOW)
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle, object_pairs_hook=_keep_coco_fields)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        except UnicodeDecodeError:
            raise UserError(f"{path}: not a UTF-8 text file") from None
        _merge_coco(out, data, path)
        out.files.append(path.name)
        del data
    return out


def _merge_coco(out: CocoInstances, data: object, path: Path) -> None:
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a COCO instances file (expected a JSON object)")
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            hint = " — a captions file? give instances_*.json" if key == "categories" else ""
            raise UserError(f"{path}: not a COCO instances file (no {key!r} list){hint}")
    try:
        for category in data["categories"]:
            cid, name = int(category["id"]), str(category["name"])
            if out.names.setdefault(cid, name) != name:
                raise UserError(f"{path}: category {cid} is {name!r} here but {out.names[cid]!r} in "
                                f"{', '.join(out.files)}")
        for image in data["images"]:
            image_id, name = int(image["id"]), str(image["file_name"])
            if out.by_file.setdefault(name, image_id) != image_id:
                raise UserError(f"{path}: file {name} is image {image_id} here but {out.by_file[name]} in "
                                f"{', '.join(out.files)}")
            out.categories.setdefault(image_id, set())
        for n, annotation in enumerate(data["annotations"]):
            image_id, cid = int(annotation["image_id"]), int(annotation["category_id"])
            if cid not in out.names:
                raise UserError(f"{path}: annotations[{n}] has category_id {cid}, which 'categories' does not list")
            if image_id not in out.categories:
                raise UserError(f"{path}: annotations[{n}] is for image {image_id}, which 'images' does not list")
            out.categories[image_id].add(cid)
    except (KeyError, TypeError, ValueError) as exc:
        detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise UserError(f"{path}: not a COCO instances file ({detail})") from None


def coco_instance_labels(records: Iterable[ManifestRecord], instances: CocoInstances) -> LabelJoin:
    """Each record's sorted COCO category names, joined by file name, else by a ``coco_<id>`` id."""
    result = LabelJoin(vocabulary=sorted(set(instances.names.values())),
                       join="manifest path's file name = COCO file_name, else manifest id coco_<n> = COCO image id")
    for record in records:
        by_name = instances.by_file.get(PurePosixPath(record.path).name)
        match = _COCO_ID.fullmatch(record.id)
        by_id = int(match.group(1)) if match and int(match.group(1)) in instances.categories else None
        if by_name is not None and match and int(match.group(1)) != by_name:
            raise UserError(f"manifest image {record.id} ({record.path}) is COCO image {by_name} by its file name "
                            f"but {match.group(1)} by its id; the manifest and the instance files disagree")
        image_id = by_name if by_name is not None else by_id
        if image_id is None:
            result.unmatched.append(record)
            continue
        result.labels[record.id] = sorted({instances.names[c] for c in instances.categories[image_id]})
    return result


# ------------------------------------------------------------------------------------ Flickr30K Entities

class EntityPhrase(NamedTuple):
    """One ``[/EN#<chain>/<type>… words]`` phrase of a Flickr30K Entities sentence."""

    chain: int                      #: coreference chain id (0: the null chain of ``notvisual`` phrases)
    types: tuple[str, ...]          #: its entity types (``/people/bodyparts`` → two)
    words: str                      #: the phrase's words as written (tokenised: ``a man 's arm``)


def entity_phrases(line: str, where: str = "") -> list[EntityPhrase]:
    """Every phrase of one Flickr30K Entities sentence, in order, as :class:`EntityPhrase`.

    ``[/EN#18/people A man] with …`` → ``[EntityPhrase(18, ("people",), "A man"), …]``; a malformed phrase or
    unknown type raises :class:`UserError` prefixed ``where``."""
    phrases = [EntityPhrase(int(m.group(1)), tuple(m.group(2)[1:].split("/")), m.group(3))
               for m in _PHRASE.finditer(line)]
    if len(phrases) != line.count("[/EN#"):
        raise UserError(f"{where}: not a Flickr30K Entities sentence (expected phrases like "
                        f"'[/EN#18/people A man]'): {line.strip()[:80]!r}")
    for phrase in phrases:
        unknown = [t for t in phrase.types if t not in F30K_TYPES]
        if unknown:
            raise UserError(f"{where}: unknown entity type {unknown[0]!r} (Flickr30K Entities has "
                            f"{', '.join(F30K_TYPES)})")
    return phrases


def parse_entity_sentence(line: str, where: str = "") -> list[tuple[int, tuple[str, ...]]]:
    """``[(chain id, types)]`` of every phrase of one Flickr30K Entities sentence (:func:`entity_phrases`)."""
    return [(p.chain, p.types) for p in entity_phrases(line, where)]


# Head nouns ------------------------------------------------------------------------------------------------

#: Words that end a phrase's first noun group: its head is the last word before one of them. Commas and ``and``
#: do not: inside Entities' (mostly base noun) phrases they join adjectives or nouns of one group ("a tall ,
#: thin man", "a black and white dog").
_HEAD_STOP = frozenset("""
of with in on at from for to but while who whom whose that which where wearing holding near by under behind
beside next into onto over through like as than about around across along against inside outside between during
without above below beneath toward towards upon among ; : ( ) --
""".split())
#: Nouns that name a quantity, collection or part of what follows ``of``: the head is then taken after ``of``
#: ("a group of young men" → men, "a piece of equipment" → equipment, "the side of the road" → road).
_HEAD_TRANSPARENT = frozenset("""
group groups couple pair pairs bunch number numbers lot lots crowd crowds team teams herd flock pack set sets pile
piles stack stacks row rows line lines kind kinds sort sorts type types piece pieces part parts variety handful
dozen dozens hundreds thousands collection array troop gang swarm school cluster mass sea member members rest
majority few several many some all both each most one two three four five six seven eight nine ten front side
sides top edge edges middle bottom end corner half
""".split())
#: Heads that are no label: pronouns, quantifiers, numerals, adverbs written as phrases.
_HEAD_NOT_LABELS = frozenset("""
he she it they them him her his hers its their theirs we us our you your i me my one ones someone somebody
something anyone anybody anything everyone everybody everything another other others each both all either this
that these those there here up down who what which some many several few lot lots none itself himself herself
themselves yourself two three four five six seven eight nine ten eleven twelve dozen hundred thousand
""".split())

#: Irregular plurals (and ``-ves``/``-oes``/``-ches`` plurals the rules below would get wrong).
_IRREGULAR_PLURALS = {
    "men": "man", "women": "woman", "children": "child", "feet": "foot", "teeth": "tooth", "geese": "goose",
    "mice": "mouse", "lice": "louse", "oxen": "ox", "cacti": "cactus", "fungi": "fungus", "persons": "person",
    "leaves": "leaf", "knives": "knife", "wives": "wife", "lives": "life", "wolves": "wolf", "shelves": "shelf",
    "halves": "half", "calves": "calf", "scarves": "scarf", "loaves": "loaf", "thieves": "thief", "elves": "elf",
    "hooves": "hoof", "buses": "bus", "gases": "gas", "potatoes": "potato", "tomatoes": "tomato",
    "heroes": "hero", "mosquitoes": "mosquito", "volcanoes": "volcano", "dominoes": "domino", "echoes": "echo",
    "tornadoes": "tornado", "mustaches": "mustache", "moustaches": "moustache", "niches": "niche",
    "headaches": "headache", "avalanches": "avalanche", "quiches": "quiche", "cliches": "cliche",
    "axes": "axe", "dice": "die",
}
#: Nouns whose ``-s`` is no plural (or whose plural is the usual name: jeans, glasses, stairs).
_INVARIANT_NOUNS = frozenset("""
people police cattle sheep fish deer series species news glasses sunglasses eyeglasses goggles jeans pants shorts
trousers tights leggings overalls pajamas pyjamas clothes scissors binoculars headphones earphones stairs trunks
briefs bus gas dress grass glass chess tennis canvas lens physics athletics gymnastics acrobatics aerobics
mathematics electronics graphics politics economics outdoors indoors texas christmas kansas paris
""".split())
#: ``-ies`` plurals of ``-ie`` nouns (the rule makes ``-ies`` → ``-y``).
_IE_NOUNS = frozenset("""
movies cookies hoodies brownies zombies goalies selfies rookies beanies hippies bowties neckties veggies smoothies
pixies prairies calories aussies genies collies boogies
""".split())
_MAN_NOT_PLURAL = frozenset({"abdomen", "specimen", "stamen", "semen", "ramen", "omen"})


def singular(word: str) -> str:
    """The singular of a lower-case English noun, by rule (no dictionary): irregular plurals and invariant nouns
    are listed; otherwise ``-men`` → ``-man``, ``-ies`` → ``-y``, ``-sses/-shes/-ches/-xes/-zzes`` lose ``es``,
    and a final ``s`` goes unless the word ends in ``ss``, ``us``, ``is`` or ``ics``."""
    if word in _INVARIANT_NOUNS:
        return word
    if word in _IRREGULAR_PLURALS:
        return _IRREGULAR_PLURALS[word]
    if word.endswith("men") and len(word) > 4 and word not in _MAN_NOT_PLURAL:
        return word[:-3] + "man"                        # firemen, policemen, fishermen
    if word.endswith("ies") and len(word) > 4:
        return word[:-1] if word in _IE_NOUNS else word[:-3] + "y"
    if word.endswith(("sses", "shes", "ches", "xes", "zzes")):
        return word[:-2]
    if word.endswith("s") and len(word) > 3 and not word.endswith(("ss", "us", "is", "ics", "'s")):
        return word[:-1]
    return word


def phrase_head(words: str, lemma: bool = True) -> str | None:
    """The head noun of a Flickr30K Entities phrase, lower case (singular with ``lemma``); None if it names nothing.

    "A group of young men" → man, "a man 's arm" → arm (rules: docs/models-jgcar.md, "Head nouns")."""
    tokens = [t for t in words.lower().split() if t]
    start = 0
    while True:
        end = start
        while end < len(tokens) and (end == start or tokens[end] not in _HEAD_STOP):
            end += 1
        group = [t for t in tokens[start:end] if any(c.isalpha() for c in t) and t != "'s"]
        if (end < len(tokens) - 1 and tokens[end] == "of" and
                (not group or group[-1] in _HEAD_TRANSPARENT)):
            start = end + 1                             # "a group of X", "the side of X": read X
            continue
        break
    if not group:
        return None
    head = group[-1].strip("'\".,;:!?")
    if not head or head in _HEAD_NOT_LABELS or not any(c.isalpha() for c in head):
        return None
    return singular(head) if lemma else head


#: The label readings of ``retr-pipeline labels f30k-entities --f30k-labels`` (the first is the default).
F30K_READINGS = ("heads", "types")
F30K_READING_DESCRIPTIONS = {
    "heads": "head nouns of the entity phrases (lower case, singular), notvisual phrases left out",
    "types": "Flickr30K Entities' coarse entity types (people, clothing, bodyparts, animals, vehicles, "
             "instruments, scene, other), notvisual left out",
}


def entity_labels(phrases: Iterable[EntityPhrase], reading: str = "heads") -> list[str]:
    """The sorted labels of one image's phrases under ``reading`` (:data:`F30K_READINGS`); ``notvisual``
    phrases never give one."""
    if reading not in F30K_READINGS:
        raise ValueError(f"reading must be one of {', '.join(F30K_READINGS)}, not {reading!r}")
    visible = [p for p in phrases if not any(t in F30K_NOT_LABELS for t in p.types)]
    if reading == "types":
        return sorted({t for p in visible for t in p.types})
    return sorted({h for p in visible if (h := phrase_head(p.words)) is not None})


def read_entity_sentences(path: Path) -> list[EntityPhrase]:
    """Every phrase of one ``Sentences/<image id>.txt`` (five sentences), in order."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a UTF-8 text file") from None
    return [p for n, line in enumerate(lines, 1) if line.strip() for p in entity_phrases(line, f"{path}:{n}")]


def boxed_chains(path: Path) -> set[int]:
    """Chain ids with at least one bounding box in one ``Annotations/<image id>.xml``."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        raise UserError(f"{path}: not valid XML ({exc})") from None
    boxed = set()
    for obj in root.iter("object"):
        if obj.find("bndbox") is None:
            continue
        for name in obj.findall("name"):
            try:
                boxed.add(int((name.text or "").strip()))
            except ValueError:
                raise UserError(f"{path}: object name {name.text!r} is not a chain id") from None
    return boxed


def f30k_entity_labels(records: Iterable[ManifestRecord], sentences: str | os.PathLike,
                       annotations: str | os.PathLike | None = None, reading: str = "heads") -> LabelJoin:
    """Each record's labels (``reading``: head nouns or entity types, union over its sentences), joined by stem.

    ``annotations``: the ``Annotations`` folder; when given, only phrases of chains with a bounding box count."""
    if reading not in F30K_READINGS:
        raise UserError(f"unknown Flickr30K label reading {reading!r} (one of {', '.join(F30K_READINGS)})")
    sentences = Path(sentences)
    if not sentences.is_dir():
        raise MissingResourceError("Flickr30K Entities Sentences folder", str(sentences), F30K_ENTITIES_HOW)
    if annotations is not None and not Path(annotations).is_dir():
        raise MissingResourceError("Flickr30K Entities Annotations folder", str(annotations), F30K_ENTITIES_HOW)
    what = "head nouns" if reading == "heads" else "types"
    result = LabelJoin(vocabulary=[t for t in F30K_TYPES if t not in F30K_NOT_LABELS] if reading == "types" else [],
                       join="manifest path's file stem = Sentences/<stem>.txt"
                            + (f" ({what} of chains with a box in Annotations/<stem>.xml)" if annotations else ""))
    any_phrase = False
    for record in records:
        stem = PurePosixPath(record.path).stem
        path = sentences / f"{stem}.txt"
        if not path.is_file():
            result.unmatched.append(record)
            continue
        phrases = read_entity_sentences(path)
        any_phrase = any_phrase or bool(phrases)
        if annotations is not None:
            xml = Path(annotations) / f"{stem}.xml"
            if not xml.is_file():
                raise UserError(f"{xml} does not exist, but {path} does (is {annotations} the Annotations folder "
                                f"of the same release?)")
            boxed = boxed_chains(xml)
            phrases = [p for p in phrases if p.chain in boxed]
        result.labels[record.id] = entity_labels(phrases, reading)
    if result.labels and not any_phrase:
        raise UserError(f"no [/EN#…] phrase in any of the {len(result.labels)} sentence files read from {sentences}; "
                        f"is it the Sentences folder of Flickr30K Entities?")
    if reading == "heads":
        result.vocabulary = sorted({x for v in result.labels.values() for x in v})
    return result
