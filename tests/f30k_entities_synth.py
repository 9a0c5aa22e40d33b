"""Flickr30K Entities-format annotation files made up here: ``Sentences/<id>.txt`` and ``Annotations/<id>.xml``.

The label readings of ``retr-pipeline labels f30k-entities`` are measured (``bench/f30k_labels.py``) and tested on
files in the release's own format when the release itself (``annotations.zip`` of Flickr30K Entities, not
downloadable by retr) is not at hand. :func:`write_entities_files` writes ``n`` images' files:

* **Entities.** Each image draws coreference chains per type (:data:`TYPE_PLAN`): people in 85 % of the images
  (1 + Poisson(1.1) chains), clothing in 65 % of those, bodyparts 30 %, animals 12 %, vehicles 13 %,
  instruments 5 %, a scene in 80 % (1 + Poisson(0.5)), other objects in 85 % (1 + Poisson(2.5)) — about 5.4
  chains and 13 phrases a picture (the release: 244k chains over 31,783 images, about 7.7; ``extra_chains``
  makes busier pictures). A chain's kind is drawn from its type's list (:data:`KINDS`, most frequent first;
  "other" and "scene" with a tail of a few hundred rarer nouns) by a Zipf law per type, the first kinds of
  people and clothing by set shares (:data:`TOP_SHARES`: man 34 % of people chains, woman 18 %, shirt 25 % of
  clothing). Measured on 3,000 images: "man" is a head in 42 % of the pictures, "people" 25 %, "woman" 23 %,
  "shirt" and "street" 15 % (in the release's captions, by the usual word counts, "man" is in about a quarter of
  the captions, "woman" and "shirt" about a tenth). A people chain is plural ("two men", "a group of young
  women") one time in three.
* **Sentences.** Five per image. Each names the main people (or animal) chain as its subject, then, each with
  its own probability, clothing ("in a red shirt", "wearing …"), a body part, another person, an object, a
  vehicle or an instrument after a verb (and an object near it), the scene ("on a city street") and now and
  then a ``notvisual`` phrase with the null chain 0 ("in the background", "each other"). A mention's head is the
  chain's own noun 85 % of the time, else one of its synonyms ("guy", "male", "person" for a man; "bicycle" for
  a bike; "kids" for children), and a plural people chain is "people" one time in five; determiners, numerals,
  colours and ages vary; a body part is sometimes a possessive typed ``/bodyparts/people`` ("a man 's hand").
* **Annotations.** ``<annotation><filename/><size/><object>…`` as released: a boxed chain has one
  ``<object><name>chain</name><bndbox>…`` per box (2–4 for a plural people chain); a chain without a box has
  ``<nobndbox>1</nobndbox>`` and ``<scene>1</scene>`` for scenes. People, animals, vehicles and instruments get
  boxes 95–97 % of the time, clothing 92 %, body parts 85 %, other objects 75 %, scenes 10 %.

It is a stand-in: the marginal frequencies are set by hand from the release's published totals and the usual
word counts of Flickr30K captions, not fitted to the files. Deterministic for a given seed.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

#: type → kinds, most frequent first: (canonical noun, plural, synonyms used by some mentions).
KINDS: dict[str, list[tuple[str, str, tuple[str, ...]]]] = {
    "people": [
        ("man", "men", ("guy", "male", "person", "gentleman")), ("woman", "women", ("lady", "female", "person")),
        ("person", "people", ("individual",)), ("boy", "boys", ("child", "kid")),
        ("girl", "girls", ("child", "kid")), ("child", "children", ("kid", "toddler")),
        ("player", "players", ("athlete", "man")), ("worker", "workers", ("man", "laborer")),
        ("crowd", "crowds", ("spectators", "audience", "people")), ("biker", "bikers", ("cyclist", "rider")),
        ("baby", "babies", ("infant", "toddler")), ("musician", "musicians", ("guitarist", "performer", "band")),
        ("couple", "couples", ("people",)), ("dancer", "dancers", ("performer", "woman")),
        ("skateboarder", "skateboarders", ("skater", "boy")), ("student", "students", ("kid", "teenager")),
        ("vendor", "vendors", ("man", "seller")), ("climber", "climbers", ("man", "person")),
        ("officer", "officers", ("policeman", "cop")), ("family", "families", ("people",)),
        ("surfer", "surfers", ("man",)), ("runner", "runners", ("athlete",)), ("skier", "skiers", ("person",)),
        ("tourist", "tourists", ("people",)), ("cowboy", "cowboys", ("rider", "man")),
        ("swimmer", "swimmers", ("person", "kid")), ("soldier", "soldiers", ("man",)),
        ("bride", "brides", ("woman",)), ("cook", "cooks", ("chef", "man")), ("teenager", "teenagers", ("teen",)),
        ("fan", "fans", ("people",)), ("team", "teams", ("players",)), ("artist", "artists", ("painter",)),
        ("doctor", "doctors", ("man",)), ("clown", "clowns", ("performer",)), ("wrestler", "wrestlers", ("man",)),
    ],
    "clothing": [
        ("shirt", "shirts", ("t-shirt", "top")), ("jacket", "jackets", ("coat",)), ("hat", "hats", ("cap",)),
        ("dress", "dresses", ()), ("helmet", "helmets", ()), ("jeans", "jeans", ("pants",)),
        ("uniform", "uniforms", ("outfit",)), ("shorts", "shorts", ()), ("coat", "coats", ("jacket",)),
        ("outfit", "outfits", ("clothes",)), ("sunglasses", "sunglasses", ("glasses",)), ("pants", "pants", ()),
        ("costume", "costumes", ("outfit",)), ("backpack", "backpacks", ("bag",)), ("sweater", "sweaters", ()),
        ("vest", "vests", ()), ("suit", "suits", ()), ("jersey", "jerseys", ("shirt",)), ("skirt", "skirts", ()),
        ("glasses", "glasses", ()), ("hoodie", "hoodies", ("sweatshirt",)), ("apron", "aprons", ()),
        ("boots", "boots", ("shoes",)), ("scarf", "scarves", ()), ("bikini", "bikinis", ("swimsuit",)),
        ("gloves", "gloves", ()), ("tank top", "tank tops", ("top",)), ("shoes", "shoes", ()), ("tie", "ties", ()),
        ("goggles", "goggles", ()), ("wetsuit", "wetsuits", ()), ("bandanna", "bandannas", ()),
    ],
    "bodyparts": [
        ("hair", "hair", ()), ("hand", "hands", ()), ("arm", "arms", ()), ("face", "faces", ()),
        ("head", "heads", ()), ("mouth", "mouths", ()), ("beard", "beards", ()), ("leg", "legs", ()),
        ("foot", "feet", ()), ("shoulder", "shoulders", ()), ("back", "backs", ()), ("eye", "eyes", ()),
        ("finger", "fingers", ()), ("tongue", "tongues", ()), ("knee", "knees", ()), ("tattoo", "tattoos", ()),
    ],
    "animals": [
        ("dog", "dogs", ("puppy", "animal")), ("horse", "horses", ("pony",)), ("bird", "birds", ()),
        ("cow", "cows", ("cattle",)), ("cat", "cats", ("kitten",)), ("bull", "bulls", ("animal",)),
        ("sheep", "sheep", ()), ("camel", "camels", ()), ("goat", "goats", ()), ("duck", "ducks", ("bird",)),
        ("elephant", "elephants", ()), ("fish", "fish", ()), ("pig", "pigs", ()), ("chicken", "chickens", ()),
        ("monkey", "monkeys", ()), ("deer", "deer", ()),
    ],
    "vehicles": [
        ("bike", "bikes", ("bicycle",)), ("car", "cars", ("vehicle",)), ("boat", "boats", ()),
        ("motorcycle", "motorcycles", ("motorbike", "bike")), ("truck", "trucks", ("vehicle",)), ("bus", "buses", ()),
        ("train", "trains", ()), ("cart", "carts", ()), ("wheelchair", "wheelchairs", ()),
        ("kayak", "kayaks", ("boat",)),
        ("canoe", "canoes", ("boat",)), ("scooter", "scooters", ()), ("tractor", "tractors", ()), ("van", "vans", ()),
        ("raft", "rafts", ()), ("airplane", "airplanes", ("plane",)), ("sled", "sleds", ()), ("taxi", "taxis", ()),
    ],
    "instruments": [
        ("guitar", "guitars", ()), ("drum", "drums", ()), ("piano", "pianos", ("keyboard",)),
        ("violin", "violins", ()), ("saxophone", "saxophones", ("sax",)), ("trumpet", "trumpets", ("horn",)),
        ("accordion", "accordions", ()), ("flute", "flutes", ()), ("cello", "cellos", ()), ("bass", "basses", ()),
        ("banjo", "banjos", ()), ("harmonica", "harmonicas", ()),
    ],
    "scene": [
        ("street", "streets", ("road", "city street")), ("field", "fields", ("grass",)),
        ("water", "water", ("lake", "river")), ("beach", "beaches", ("shore",)), ("stage", "stages", ()),
        ("park", "parks", ()), ("city", "cities", ()), ("snow", "snow", ()), ("sidewalk", "sidewalks", ()),
        ("area", "areas", ()), ("room", "rooms", ()), ("ocean", "oceans", ("sea",)), ("building", "buildings", ()),
        ("market", "markets", ()), ("pool", "pools", ()), ("outdoors", "outdoors", ("outside",)),
        ("restaurant", "restaurants", ()), ("track", "tracks", ()), ("mountain", "mountains", ()),
        ("crowd", "crowds", ()), ("yard", "yards", ()), ("court", "courts", ()), ("stadium", "stadiums", ()),
        ("kitchen", "kitchens", ()), ("forest", "forests", ("woods",)), ("hill", "hills", ()),
        ("desert", "deserts", ()), ("store", "stores", ("shop",)), ("church", "churches", ()),
        ("parade", "parades", ()), ("festival", "festivals", ()), ("event", "events", ()),
    ],
    "other": [
        ("ball", "balls", ()), ("building", "buildings", ()), ("sign", "signs", ()), ("table", "tables", ()),
        ("tree", "trees", ()), ("wall", "walls", ()), ("camera", "cameras", ()), ("rock", "rocks", ()),
        ("water", "water", ()), ("food", "food", ()), ("microphone", "microphones", ("mic",)),
        ("flag", "flags", ()), ("umbrella", "umbrellas", ()), ("bench", "benches", ()),
        ("skateboard", "skateboards", ("board",)), ("window", "windows", ()), ("fence", "fences", ()),
        ("chair", "chairs", ()), ("picture", "pictures", ("photo",)), ("wave", "waves", ()), ("bag", "bags", ()),
        ("cup", "cups", ()), ("toy", "toys", ()), ("book", "books", ()), ("phone", "phones", ("cellphone",)),
        ("rope", "ropes", ()), ("net", "nets", ()), ("frisbee", "frisbees", ()), ("stick", "sticks", ()),
        ("game", "games", ()), ("trick", "tricks", ("jump",)), ("stairs", "stairs", ("steps",)),
        ("door", "doors", ()), ("bucket", "buckets", ()), ("box", "boxes", ()), ("surfboard", "surfboards", ()),
        ("kite", "kites", ()), ("pole", "poles", ()), ("basket", "baskets", ()), ("flower", "flowers", ()),
        ("machine", "machines", ()), ("tent", "tents", ()), ("bottle", "bottles", ()), ("paper", "papers", ()),
        ("grass", "grass", ()), ("sand", "sand", ()), ("dirt", "dirt", ()), ("race", "races", ()),
        ("dance", "dances", ()), ("performance", "performances", ()), ("sculpture", "sculptures", ("statue",)),
        ("painting", "paintings", ()), ("bowl", "bowls", ()), ("cake", "cakes", ()), ("newspaper", "newspapers", ()),
        ("ladder", "ladders", ()), ("shovel", "shovels", ()), ("laptop", "laptops", ("computer",)),
        ("tire", "tires", ()), ("goal", "goals", ()), ("pumpkin", "pumpkins", ()), ("banner", "banners", ()),
    ],
}
#: Rarer "other" objects and scenes: the release names thousands of things once or twice.
_OTHER_TAIL = """
sky tire hose log pipe crate wheel statue fountain mirror lamp bed couch desk shelf counter plate tray pot pan
knife fork spoon glass mug bottle jar can candle cigarette drink beer wine coffee soda pizza sandwich bread fruit
apple banana orange vegetable corn rice meat fish net hoop racket bat glove puck stick club cone hurdle rail ramp
bridge tower arch column gate post pole wire cable sail mast oar anchor paddle helmet mask poster map menu screen
monitor television radio speaker amplifier cord light lantern torch fire smoke flame cloud rainbow sun moon star
balloon kite bubble confetti ribbon trophy medal card dice chess puzzle doll teddy blanket pillow towel rug carpet
curtain tarp tent hammock swing slide seesaw sandbox shovel rake broom mop bucket barrel keg wagon wheelbarrow
ladder scaffold crane drill hammer saw nail brick stone pebble shell log branch leaf bush plant vine cactus
""".split()
_SCENE_TAIL = """
alley plaza square courtyard garden lawn meadow pasture farm barn ranch village town downtown intersection
crosswalk highway bridge tunnel station subway airport harbor dock pier marina lake river creek stream waterfall
cliff canyon valley trail path woods jungle swamp cave shore coast bay lagoon island hallway classroom office
gym arena rink pool bar pub cafe diner bakery mall shop gallery museum library theater hall auditorium temple
""".split()
for _word in _OTHER_TAIL:
    KINDS["other"].append((_word, _word + "s", ()))
for _word in _SCENE_TAIL:
    KINDS["scene"].append((_word, _word + "s", ()))
del _word

#: type → (probability that an image has chains of it, Poisson mean of the chains beyond the first,
#: probability that a chain gets a box, probability that one sentence mentions a chain of it, Zipf exponent)
TYPE_PLAN: dict[str, tuple[float, float, float, float, float]] = {
    "people": (0.85, 1.1, 0.97, 0.8, 1.1), "clothing": (0.65, 1.2, 0.92, 0.45, 1.2),
    "bodyparts": (0.30, 0.3, 0.85, 0.35, 1.1), "animals": (0.12, 0.2, 0.97, 0.85, 1.4),
    "vehicles": (0.13, 0.2, 0.95, 0.65, 1.1), "instruments": (0.05, 0.2, 0.95, 0.7, 1.1),
    "scene": (0.80, 0.5, 0.10, 0.6, 0.9), "other": (0.85, 2.5, 0.75, 0.45, 0.5),
}
#: how often a mention uses one of the chain's synonyms instead of its own noun
SYNONYM_RATE = 0.15
_COLOURS = ("red", "blue", "black", "white", "green", "yellow", "orange", "pink", "gray", "brown", "purple", "dark")
_AGES = ("young", "older", "little", "elderly", "tall", "smiling", "blond", "Asian", "bearded", "happy")
_COUNTS = ("two", "three", "several", "four", "many", "some")
_NOTVISUAL = ("in [/EN#0/notvisual the background]", "with [/EN#0/notvisual each other]",
              "for [/EN#0/notvisual the camera]", "at [/EN#0/notvisual night]", "during [/EN#0/notvisual the day]")
_VERBS = {"other": ("holding", "looking at", "carrying", "standing next to", "sitting on", "playing with",
                    "throwing", "pointing at"),
          "vehicles": ("riding", "driving", "sitting in", "pushing", "on"),
          "instruments": ("playing", "holding", "practicing on"),
          "animals": ("walking", "petting", "riding", "feeding")}
_SCENE_PREPS = ("in", "on", "at", "near", "outside", "in front of")


#: type → the shares of its first kinds, where a Zipf law is too flat at the top (men are described about twice
#: as often as women; "shirt" leads clothing by far); the rest of the type follows its Zipf law.
TOP_SHARES: dict[str, tuple[float, ...]] = {"people": (0.34, 0.18, 0.08, 0.07, 0.07), "clothing": (0.25, 0.08)}


def _weights(etype: str) -> np.ndarray:
    n, exponent = len(KINDS[etype]), TYPE_PLAN[etype][4]
    weights = 1.0 / np.arange(1, n + 1) ** exponent
    top = TOP_SHARES.get(etype, ())
    weights = weights / weights.sum()
    if top:
        rest = weights[len(top):]
        weights = np.concatenate([np.array(top), rest / rest.sum() * (1.0 - sum(top))])
    return weights


def _zipf(rng: np.random.Generator, etype: str) -> int:
    weights = _weights(etype)
    return int(rng.choice(len(weights), p=weights))


class _Chain:
    def __init__(self, cid: int, etype: str, kind: tuple[str, str, tuple[str, ...]], plural: bool, boxed: bool):
        self.cid, self.etype, self.kind, self.plural, self.boxed = cid, etype, kind, plural, boxed

    def noun(self, rng: np.random.Generator) -> str:
        singular, plural, synonyms = self.kind
        if self.plural and self.etype == "people" and rng.random() < 0.2:
            return "people"
        if synonyms and rng.random() < SYNONYM_RATE:
            word = synonyms[min(int(rng.geometric(0.5)) - 1, len(synonyms) - 1)]   # the first synonym most often
            if self.plural and self.etype == "people" and word not in ("people", "audience", "band", "spectators"):
                word = {"person": "people", "child": "children", "man": "men", "woman": "women"}.get(word, word + "s")
            return word
        return plural if self.plural else singular

    def phrase(self, rng: np.random.Generator, subject: bool = False, owner: "_Chain | None" = None) -> str:
        noun = self.noun(rng)
        words: list[str] = []
        if self.etype == "people":
            if self.plural:
                r = rng.random()
                if r < 0.3:
                    words = ["a group of"]
                elif r < 0.75:
                    words = [_COUNTS[int(rng.integers(len(_COUNTS)))]]
                if rng.random() < 0.35:
                    words.append(_AGES[int(rng.integers(len(_AGES)))])
            else:
                words = ["a"] if rng.random() < 0.75 else ["the"]
                if rng.random() < 0.45:
                    words.append(_AGES[int(rng.integers(len(_AGES)))])
        elif self.etype == "bodyparts":
            if owner is not None and rng.random() < 0.3:
                types = "/bodyparts/people"
                owner_noun = owner.noun(rng)
                return f"[/EN#{self.cid}{types} a {owner_noun} 's {noun}]"
            own = owner.kind[0] if owner is not None else ""
            words = ["their" if owner is not None and owner.plural else
                     "her" if own in ("woman", "girl", "bride", "dancer") else
                     "his" if own in ("man", "boy", "player", "worker", "cowboy", "soldier") else
                     ("his", "her", "a")[int(rng.integers(3))]]
            if rng.random() < 0.4:
                words.append(("long", "dark", "curly", "raised", "open", "blond")[int(rng.integers(6))])
        else:
            words = [("a", "the", "a")[int(rng.integers(3))]]
            if self.plural:
                words = [("some", "two", "many", "")[int(rng.integers(4))]]
            if self.etype in ("clothing", "vehicles", "other") and rng.random() < 0.5:
                words.append(_COLOURS[int(rng.integers(len(_COLOURS)))])
        words = [w for w in words if w] + [noun]
        if words[0].lower() == "a" and words[1][0].lower() in "aeiou":
            words[0] += "n"
        if subject:
            words[0] = words[0][0].upper() + words[0][1:]
        return f"[/EN#{self.cid}/{self.etype} {' '.join(words)}]"


def _image(rng: np.random.Generator, next_chain: int, extra_chains: float) -> tuple[list[_Chain], int]:
    chains: list[_Chain] = []
    has_people = False
    for etype, (p_has, extra, p_box, _, _) in TYPE_PLAN.items():
        if etype == "clothing" and not has_people:
            continue
        if etype == "bodyparts" and not has_people:
            continue
        if rng.random() >= p_has:
            continue
        has_people = has_people or etype == "people"
        used: set[int] = set()
        for _ in range(1 + int(rng.poisson(extra * extra_chains))):
            k = _zipf(rng, etype)
            if k in used:
                continue
            used.add(k)
            plural = etype == "people" and rng.random() < 1 / 3 or etype == "other" and rng.random() < 0.2
            chains.append(_Chain(next_chain, etype, KINDS[etype][k], plural, bool(rng.random() < p_box)))
            next_chain += 1
    return chains, next_chain


def _sentence(rng: np.random.Generator, chains: list[_Chain]) -> str:
    by_type: dict[str, list[_Chain]] = {}
    for c in chains:
        by_type.setdefault(c.etype, []).append(c)

    def mentioned(etype: str) -> _Chain | None:
        pool = by_type.get(etype, [])
        if pool and rng.random() < TYPE_PLAN[etype][3]:
            return pool[int(rng.integers(len(pool)))]
        return None

    def pick(etype: str) -> _Chain | None:
        pool = by_type.get(etype, [])
        return pool[int(rng.integers(len(pool)))] if pool else None

    people = by_type.get("people", [])
    subject = people[0] if people and rng.random() < 0.9 else pick("animals") or pick("vehicles") or pick("other")
    parts = []
    if subject is None:
        scene = pick("scene")
        return (f"[/EN#0/notvisual There] is {scene.phrase(rng)} ." if scene is not None
                else "[/EN#0/notvisual Something] is happening .")
    parts.append(subject.phrase(rng, subject=True))
    if subject.etype == "people":
        cloth = mentioned("clothing")
        if cloth is not None:
            parts.append(("in", "wearing", "dressed in")[int(rng.integers(3))] + " " + cloth.phrase(rng))
        body = mentioned("bodyparts")
        if body is not None:
            parts.append("with " + body.phrase(rng, owner=subject))
        second = [c for c in people[1:]]
        if second and rng.random() < 0.35:
            parts.append("and " + second[int(rng.integers(len(second)))].phrase(rng))
    parts.append(("is", "are")[subject.plural])
    if subject.etype not in ("people", "animals"):
        obj = mentioned("other")
        if obj is not None and obj is not subject:
            parts.append(("on", "next to", "near", "in front of")[int(rng.integers(4))] + " " + obj.phrase(rng))
        else:
            parts.append(("parked", "shown", "visible", "standing")[int(rng.integers(4))])
        scene = mentioned("scene")
        if scene is not None:
            parts.append("in " + scene.phrase(rng))
        return " ".join(parts) + " ."
    for etype in ("instruments", "vehicles", "animals", "other"):
        obj = mentioned(etype)
        if obj is not None and obj is not subject:
            verbs = _VERBS[etype]
            parts.append(verbs[int(rng.integers(len(verbs)))] + " " + obj.phrase(rng))
            near = mentioned("other")
            if near is not None and near is not obj:
                parts.append(("near", "by", "beside", "under")[int(rng.integers(4))] + " " + near.phrase(rng))
            break
    else:
        parts.append(("standing", "smiling", "walking", "sitting", "posing", "waiting")[int(rng.integers(6))])
    scene = mentioned("scene")
    if scene is not None:
        parts.append(_SCENE_PREPS[int(rng.integers(len(_SCENE_PREPS)))] + " " + scene.phrase(rng))
    if rng.random() < 0.1:
        parts.append(_NOTVISUAL[int(rng.integers(len(_NOTVISUAL)))])
    return " ".join(parts) + " ."


def _annotation_xml(stem: str, rng: np.random.Generator, chains: list[_Chain]) -> str:
    width, height = 500, int(rng.choice((333, 375, 281, 500)))
    objects = []
    for c in chains:
        if c.boxed:
            for _ in range(int(rng.integers(2, 5)) if c.plural else 1):
                x1, y1 = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
                x2, y2 = int(rng.integers(x1 + 10, width)), int(rng.integers(y1 + 10, height))
                objects.append(f"\t<object>\n\t\t<name>{c.cid}</name>\n\t\t<bndbox>\n\t\t\t<xmin>{x1}</xmin>\n"
                               f"\t\t\t<ymin>{y1}</ymin>\n\t\t\t<xmax>{x2}</xmax>\n\t\t\t<ymax>{y2}</ymax>\n"
                               f"\t\t</bndbox>\n\t</object>\n")
        else:
            scene = int(c.etype == "scene")
            objects.append(f"\t<object>\n\t\t<name>{c.cid}</name>\n\t\t<nobndbox>1</nobndbox>\n"
                           f"\t\t<scene>{scene}</scene>\n\t</object>\n")
    return (f"<annotation>\n\t<filename>{stem}.jpg</filename>\n\t<size>\n\t\t<width>{width}</width>\n"
            f"\t\t<height>{height}</height>\n\t\t<depth>3</depth>\n\t</size>\n"
            + "".join(objects) + "</annotation>\n")


def write_entities_files(folder: str | os.PathLike, n: int, seed: int = 0, extra_chains: float = 1.0) -> list[str]:
    """Write ``folder/Sentences/<stem>.txt`` and ``folder/Annotations/<stem>.xml`` for ``n`` images; returns the
    stems (Flickr-like numbers), in order. ``extra_chains`` scales the mean number of chains of a type beyond the
    first (:data:`TYPE_PLAN`): above 1, busier pictures."""
    folder = Path(folder)
    (folder / "Sentences").mkdir(parents=True, exist_ok=True)
    (folder / "Annotations").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    stems, next_chain = [], 1
    taken: set[int] = set()
    while len(stems) < n:
        number = int(rng.integers(10**6, 10**10))
        if number in taken:
            continue
        taken.add(number)
        stem = str(number)
        chains, next_chain = _image(rng, next_chain, extra_chains)
        if not chains:
            continue
        sentences = [_sentence(rng, chains) for _ in range(5)]
        (folder / "Sentences" / f"{stem}.txt").write_text("\n".join(sentences) + "\n", encoding="utf-8")
        (folder / "Annotations" / f"{stem}.xml").write_text(_annotation_xml(stem, rng, chains), encoding="utf-8")
        stems.append(stem)
    return stems
