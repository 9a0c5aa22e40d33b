"""Recipes: every published row retr can reproduce, as data in one place.

A :class:`Recipe` names the feature set it needs, each member's training settings (a model, a preset and
overrides — the same settings ``retr-train MODEL`` takes), the evaluation protocol, and the published numbers
with their source (paper, table, row). A recipe with several members is an ensemble: the members' similarity
matrices are averaged (SCAN's ensembles). Members are runs named by what they are (``scan-f30k-t2i-avg``), so
recipes that share a model share its run: ``scan-coco1k-ensemble`` and ``scan-coco5k-ensemble`` train the
same COCO models once.

``retr-train recipes`` lists them; ``retr-train reproduce NAME`` trains, evaluates and compares
(:mod:`retr.trainers.reproduce`). Numbers are transcribed from ``papers/*.txt``; where the text lost a number
(OCR), it is ``None`` and the recipe says so — never filled in from memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from retr.common.errors import UserError

Recall = tuple[float | None, float | None, float | None]   # R@1, R@5, R@10 (None: not printed / lost)


@dataclass(frozen=True)
class Published:
    """A published row: i2t (sentence retrieval) and t2i (image retrieval) R@1/5/10, and where it is printed."""

    i2t: Recall
    t2i: Recall
    source: str
    #: the rSum the paper prints (None: computed from the six recalls when all are known)
    printed_rsum: float | None = None

    @property
    def rsum(self) -> float | None:
        if self.printed_rsum is not None:
            return self.printed_rsum
        values = [*self.i2t, *self.t2i]
        return None if any(v is None for v in values) else round(sum(values), 1)


@dataclass(frozen=True)
class FeatureSet:
    """The feature set a recipe needs and how to make it."""

    extractor: str
    how: str


@dataclass(frozen=True)
class Member:
    """One trained model of a recipe: ``retr-train MODEL --preset PRESET <settings>`` into ``OUT/run``."""

    run: str
    model: str
    preset: str | None
    settings: Mapping[str, Any] = field(default_factory=dict)
    #: the published row of this member alone, when the paper prints one
    published: Published | None = None


@dataclass(frozen=True)
class Recipe:
    name: str
    title: str
    features: FeatureSet
    members: tuple[Member, ...]
    protocol: str
    published: Published
    notes: str = ""

    @property
    def ensemble(self) -> bool:
        return len(self.members) > 1


BUTD = FeatureSet("butd-regions", "retr-pipeline extract --extractor butd-regions (36 regions per image, the "
                                  "bottom-up-attention detector), or retr-pipeline import-scan on SCAN's released "
                                  "{split}_ims.npy files")
RESNET_GRID = FeatureSet("resnet152-grid", "retr-pipeline extract --extractor resnet152-grid (448-px input, 7×7)")
VGG_MAPS = FeatureSet("vgg16-maps", "retr-pipeline extract --extractor vgg16-maps (448-px input, 14×14)")
TENCROP_RESNET = FeatureSet("tencrop-resnet152", "retr-pipeline extract --extractor tencrop-resnet152")
TENCROP_VGG19 = FeatureSet("tencrop-vgg19", "retr-pipeline extract --extractor tencrop-vgg19")
TENCROP_IRV2 = FeatureSet("tencrop-irv2", "retr-pipeline extract --extractor tencrop-irv2 (Inception-ResNet-v2)")

SCAN_PAPER = "SCAN (Lee et al., ECCV 2018)"


def _scan_member(dataset: str, direction: str, agg: str, published: Published | None = None) -> Member:
    return Member(f"scan-{dataset}-{direction}-{agg}", "scan", f"{dataset}-{direction}-{agg}", {}, published)


# ------------------------------------------------------------------------------------------------- SCAN
_SCAN_F30K = {
    ("t2i", "lse"): Published((61.1, 85.4, 91.5), (43.3, 71.9, 80.9), f"{SCAN_PAPER}, Table 1, 'SCAN t-i LSE (λ1 = 9, λ2 = 6)'"),
    ("t2i", "avg"): Published((61.8, 87.5, 93.7), (45.8, 74.4, 83.0), f"{SCAN_PAPER}, Table 1, 'SCAN t-i AVG (λ1 = 9)'"),
    ("i2t", "lse"): Published((67.7, 88.9, 94.0), (44.0, 74.2, 82.6), f"{SCAN_PAPER}, Table 1, 'SCAN i-t LSE (λ1 = 4, λ2 = 5)'"),
    ("i2t", "avg"): Published((67.9, 89.0, 94.4), (43.9, 74.2, 82.8), f"{SCAN_PAPER}, Table 1, 'SCAN i-t AVG (λ1 = 4)'"),
}
_SCAN_COCO1K = {
    ("t2i", "lse"): Published((67.5, 92.9, 97.6), (53.0, 85.4, 92.9), f"{SCAN_PAPER}, Table 2 (1K), 'SCAN t-i LSE (λ1 = 9, λ2 = 6)'"),
    ("t2i", "avg"): Published((70.9, 94.5, 97.8), (56.4, 87.0, 93.9), f"{SCAN_PAPER}, Table 2 (1K), 'SCAN t-i AVG (λ1 = 9)'"),
    ("i2t", "lse"): Published((68.4, 93.9, 98.0), (54.8, 86.1, 93.3), f"{SCAN_PAPER}, Table 2 (1K), 'SCAN i-t LSE (λ1 = 4, λ2 = 20)'"),
    ("i2t", "avg"): Published((None, 93.2, 97.5), (54.4, 86.0, 93.6), f"{SCAN_PAPER}, Table 2 (1K), 'SCAN i-t AVG (λ1 = 4)' "
                              "(its sentence R@1 is lost in papers/scan.txt)"),
}

RECIPES: dict[str, Recipe] = {}


def _add(recipe: Recipe) -> None:
    if recipe.name in RECIPES:
        raise ValueError(f"recipe {recipe.name} defined twice")
    RECIPES[recipe.name] = recipe


for (_direction, _agg), _row in _SCAN_F30K.items():
    _add(Recipe(f"scan-f30k-{_direction}-{_agg}", f"SCAN {_direction} {_agg.upper()} on Flickr30K", BUTD,
                (_scan_member("f30k", _direction, _agg, _row),), "f30k-1k", _row))
_add(Recipe("scan-f30k-ensemble", "SCAN t-i AVG + i-t LSE on Flickr30K (averaged similarities)", BUTD,
            (_scan_member("f30k", "t2i", "avg", _SCAN_F30K[("t2i", "avg")]),
             _scan_member("f30k", "i2t", "lse", _SCAN_F30K[("i2t", "lse")])), "f30k-1k",
            Published((67.4, 90.3, 95.8), (48.6, 77.7, 85.2), f"{SCAN_PAPER}, Table 1, 'SCAN t-i AVG + i-t LSE'"),
            "The members were selected on the validation set (§4.2)."))
for (_direction, _agg), _row in _SCAN_COCO1K.items():
    _add(Recipe(f"scan-coco1k-{_direction}-{_agg}", f"SCAN {_direction} {_agg.upper()} on COCO 1K (5 folds)", BUTD,
                (_scan_member("coco", _direction, _agg, _row),), "coco-1k", _row))
_add(Recipe("scan-coco1k-ensemble", "SCAN t-i LSE + i-t AVG on COCO 1K (averaged similarities)", BUTD,
            (_scan_member("coco", "t2i", "lse", _SCAN_COCO1K[("t2i", "lse")]),
             _scan_member("coco", "i2t", "avg", _SCAN_COCO1K[("i2t", "avg")])), "coco-1k",
            Published((72.7, 94.8, 98.4), (58.8, 88.4, 94.8), f"{SCAN_PAPER}, Table 2 (1K), 'SCAN t-i LSE + i-t AVG'")))
_SCAN_COCO5K_ITLSE = Published((46.4, 77.4, 87.2), (34.4, 63.7, 75.7), f"{SCAN_PAPER}, Table 2 (5K), 'SCAN i-t LSE'")
_add(Recipe("scan-coco5k-i2t-lse", "SCAN i-t LSE on COCO 5K", BUTD,
            (_scan_member("coco", "i2t", "lse", _SCAN_COCO5K_ITLSE),), "coco-5k", _SCAN_COCO5K_ITLSE,
            "The paper lists only its best single 5K model (selected on validation)."))
_add(Recipe("scan-coco5k-ensemble", "SCAN t-i AVG + i-t LSE on COCO 5K (averaged similarities)", BUTD,
            (_scan_member("coco", "t2i", "avg"), _scan_member("coco", "i2t", "lse", _SCAN_COCO5K_ITLSE)), "coco-5k",
            Published((50.4, 82.2, 90.0), (38.6, 69.3, 80.4), f"{SCAN_PAPER}, Table 2 (5K), 'SCAN t-i AVG + i-t LSE'")))


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise UserError(f"unknown recipe {name!r} (retr-train recipes lists them)")
    return RECIPES[name]


def list_recipes() -> list[Recipe]:
    return list(RECIPES.values())
