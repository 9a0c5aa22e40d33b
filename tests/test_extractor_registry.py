"""The extractor registry: one :class:`ExtractorSpec` per extractor, registered beside its builder, and every list of
extractors derived from the specs.

A throwaway extractor defined here (each image's mean colour per cell of a G×G grid, with weights declared as a URL
of its own) is registered for the duration of each test and unregistered after, as ``tests/test_model_registry.py``
does with a throwaway model: it must appear in ``available_extractors()``, ``retr-pipeline extract``'s choices and
help, ``fetch-weights``' names, help and downloads, and the extras check — so adding an extractor is one module.
The other tests hold every registered spec to what its extractor builds and to the presets.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from PIL import Image

from retr.common import downloads
from retr.common.downloads import SOURCES, Source
from retr.common.optional import MissingExtraError
from retr.extractors import weights as extractor_weights
from retr.extractors.base import (Extractor, ImageError, available_extractors, build_extractor, declared_options,
                                  extractor_spec, extractor_specs, needed_by, register_extractor,
                                  unregister_extractor)
from retr.extractors.images import decode_image
from retr.extractors.spec import ALL, ExtractorSpec, RandomInit
from retr.extractors.weights import UrlWeights
from retr.pipeline.commands import cli
from retr.pipeline.weights import weights_catalog, weights_items
from tests.local_server import LocalServer

# ------------------------------------------------------------------------------------------------ the throwaway

WEIGHTS_BYTES = b"throwaway weights " * 1000
WEIGHTS_SOURCE = Source("throwaway-cells", "the throwaway extractor's weights (a test's)",
                        "https://example.invalid/throwaway-cells.bin", "throwaway-cells.bin",
                        size=len(WEIGHTS_BYTES), sha256=hashlib.sha256(WEIGHTS_BYTES).hexdigest())


class CellColours(Extractor):
    """Mean RGB of each cell of a ``grid×grid`` split of a 32×32 resize: features ``[B, grid², 3]``."""

    name = "throwaway-cells"
    kind = "grid"

    def __init__(self, grid: int):
        self.grid = grid

    @property
    def feature_shape(self) -> tuple[int, int]:
        return (self.grid * self.grid, 3)

    def attrs(self) -> dict:
        return {"kind": self.kind, "extractor": self.name, "backbone": "none", "weights": "none",
                "image_size": 32, "grid": self.grid}

    def load(self, path: str) -> torch.Tensor:
        image = decode_image(path, False).convert("RGB").resize((32, 32))
        if image.size != (32, 32):
            raise ImageError("not resized")
        return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)

    def extract(self, batch: torch.Tensor) -> dict[str, np.ndarray]:
        cells = F.adaptive_avg_pool2d(batch, self.grid)                # [B, 3, G, G]
        return {"features": cells.flatten(2).transpose(1, 2).numpy()}  # [B, G·G, 3]


def build_cells(weights: str = "random", device: str = "cpu", grid: int = 2) -> CellColours:
    """The throwaway: mean colours of a ``grid``×``grid`` split."""
    return CellColours(grid)


THROWAWAY = ExtractorSpec(
    name="throwaway-cells", builder=build_cells, kind="grid", output=lambda o: (o["grid"] ** 2, 3),
    weights=UrlWeights(source=WEIGHTS_SOURCE), extra="pipeline", requires=("timm",), random=RandomInit("none"))
#: the throwaway again, needing a module no one installs
NEEDS_MISSING = dataclasses.replace(THROWAWAY, name="throwaway-missing", requires=("retr_no_such_module",),
                                    extra="report")


@pytest.fixture(autouse=True)
def throwaway_registered():
    register_extractor(THROWAWAY)
    yield
    unregister_extractor(THROWAWAY.name)
    unregister_extractor(NEEDS_MISSING.name)


# ------------------------------------------------------------------------------------------------ every list

def test_the_throwaway_is_listed_and_built_like_any_extractor():
    assert {"resnet152-grid", "vgg16-maps", "tencrop-irv2", "butd-regions", "clip-vit-b-16",
            "throwaway-cells"} <= set(available_extractors())
    assert extractor_spec("throwaway-cells") is THROWAWAY and THROWAWAY in extractor_specs()
    assert declared_options("throwaway-cells") == {"weights", "device", "grid"}
    assert build_extractor("throwaway-cells", grid=3).feature_shape == (9, 3) == THROWAWAY.feature_shape({"grid": 3})


def test_after_unregistering_it_is_gone_everywhere_and_back_once_registered_again():
    unregister_extractor("throwaway-cells")
    assert "throwaway-cells" not in available_extractors()
    assert "throwaway-cells" not in weights_catalog().extractors
    with pytest.raises(ValueError, match="unknown extractor 'throwaway-cells'"):
        build_extractor("throwaway-cells")
    for command in ("extract", "fetch-weights"):      # the lists are read when shown, not kept from a first use
        assert "throwaway-cells" not in CliRunner().invoke(cli, [command, "--help"]).output
    register_extractor(THROWAWAY)
    for command in ("extract", "fetch-weights"):
        assert "throwaway-cells" in CliRunner().invoke(cli, [command, "--help"]).output


def test_extract_lists_it_in_its_choices_and_help_and_runs_it(tmp_path):
    names = available_extractors()
    shown = CliRunner().invoke(cli, ["extract", "--help"])
    assert shown.exit_code == 0 and "--extractor [" + "|".join(names) + "]" in shown.output
    assert "|throwaway-cells|" in shown.output
    for i, colour in enumerate([(255, 0, 0), (0, 0, 255)]):
        Image.new("RGB", (40, 30), colour).save(tmp_path / f"{i}.png")
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"im{i}", "path": f"{i}.png", "split": "test", "captions": ["x"]})
                                + "\n" for i in range(2)))
    result = CliRunner().invoke(cli, ["extract", "--manifest", str(manifest), "--extractor", "throwaway-cells",
                                      "--out", str(tmp_path / "f"), "--workers", "0", "--quiet"])
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "f" / "throwaway-cells.h5") as f:
        assert f.attrs["extractor"] == "throwaway-cells" and f["features"].shape == (2, 4, 3)
        assert np.allclose(f["features"][0], [1, 0, 0], atol=1e-3) and np.allclose(f["features"][1], [0, 0, 1],
                                                                                   atol=1e-3)


def test_fetch_weights_takes_its_weights_by_their_name_and_by_the_extractor(tmp_path, monkeypatch, run_cli):
    catalog = weights_catalog()
    assert catalog.extractors["throwaway-cells"] == "throwaway-cells"
    assert catalog.groups[ALL][-2:] == ("throwaway-cells", "stanza")     # after the table's, before the parser's
    assert [item.name for item in weights_items(["throwaway-cells"])] == ["throwaway-cells"]
    shown = CliRunner().invoke(cli, ["fetch-weights", "--help"])
    assert shown.exit_code == 0 and "butd, throwaway-cells, stanza" in " ".join(shown.output.split())
    monkeypatch.setenv("RETR_WEIGHTS", str(tmp_path / "w"))
    code, out, err = run_cli.as_user("pipeline", "fetch-weights", "throwaway-cells", "--offline")
    assert code == 1 and err == (f"error: weights throwaway-cells not found (looked in {tmp_path / 'w'}/"
                                 f"throwaway-cells.bin, {Path.home()}/.cache/retr/weights/throwaway-cells.bin); run "
                                 "retr-pipeline fetch-weights throwaway-cells on a connected machine and copy what it "
                                 "downloads to those folders (RETR_OFFLINE is set, so retr does not download here)\n")


def test_fetch_weights_downloads_its_url_with_size_and_sha256_checked(tmp_path, monkeypatch, run_cli):
    monkeypatch.setenv("RETR_OFFLINE", "0")
    monkeypatch.setenv("RETR_MIRROR", "")     # recorded, so the --mirror the command sets is undone afterwards
    monkeypatch.delenv("RETR_MIRROR")
    monkeypatch.setattr(downloads, "DEFAULT_RETRY_WAIT", 0.0)
    monkeypatch.setenv("RETR_WEIGHTS", str(tmp_path / "w"))
    with LocalServer() as server:
        server.files["/throwaway-cells.bin"] = WEIGHTS_BYTES[:-1] + b"!"          # damaged: refused, nothing kept
        code, out, err = run_cli.as_user("pipeline", "fetch-weights", "throwaway-cells", "--mirror", server.url,
                                         "--quiet")
        assert code == 1 and "fails its sha256 check" in err and err.count("\n") == 1
        assert not (tmp_path / "w" / "throwaway-cells.bin").exists()
        server.files["/throwaway-cells.bin"] = WEIGHTS_BYTES
        code, out, err = run_cli.as_user("pipeline", "fetch-weights", "throwaway-cells", "--mirror", server.url,
                                         "--quiet")
    assert code == 0, err
    assert out == f"throwaway-cells: {tmp_path / 'w' / 'throwaway-cells.bin'} (downloaded)\n"
    assert (tmp_path / "w" / "throwaway-cells.bin").read_bytes() == WEIGHTS_BYTES


def test_the_extras_check_names_it(monkeypatch):
    assert needed_by("timm") == "the tencrop-irv2, throwaway-cells extractors"
    from retr.extractors import timm_weights
    assert timm_weights.what() == "the tencrop-irv2, throwaway-cells extractors and their weights"
    register_extractor(NEEDS_MISSING)
    with pytest.raises(MissingExtraError) as caught:
        build_extractor("throwaway-missing")
    assert str(caught.value) == ("retr_no_such_module is not installed (needed by the throwaway-missing extractor): "
                                 "pip install 'retr[report]' (or make setup)")


def test_a_spec_that_does_not_match_what_its_builder_builds_is_a_bug():
    register_extractor(dataclasses.replace(NEEDS_MISSING, requires=(), output=(5, 3)))
    with pytest.raises(TypeError, match=r"built 'throwaway-cells' of kind 'grid' with features \[4, 3\]; its spec "
                                        r"says kind 'grid', \[5, 3\]"):
        build_extractor("throwaway-missing")


def test_a_name_taken_by_another_builder_and_an_unknown_source_key_are_refused():
    with pytest.raises(ValueError, match="registered twice"):
        register_extractor(dataclasses.replace(THROWAWAY, builder=lambda **options: None))
    register_extractor(THROWAWAY)                                   # the same spec again: no change
    with pytest.raises(ValueError, match="not a key of retr.common.downloads.SOURCES"):
        UrlWeights(source="no-such-file")
    with pytest.raises(ValueError, match="requires timm but names no extra"):
        dataclasses.replace(THROWAWAY, extra=None)


# ------------------------------------------------------------------------------------------------ the real specs

def test_fetch_weights_names_are_the_specs_in_the_download_tables_order():
    unregister_extractor("throwaway-cells")
    catalog = weights_catalog()
    assert catalog.groups == {"all": ("resnet152", "vgg16", "vgg19", "inception_resnet_v2", "butd", "stanza"),
                              "clip": ("clip-vit-b-32", "clip-vit-b-16", "clip-vit-l-14", "clip-vit-l-14-336")}
    assert list(catalog.by_extractor.items()) == [
        ("resnet152-grid", "resnet152"), ("tencrop-resnet152", "resnet152"), ("vgg16-maps", "vgg16"),
        ("tencrop-vgg19", "vgg19"), ("tencrop-irv2", "inception_resnet_v2"), ("butd-regions", "butd")]
    for key, source in catalog.sources.items():
        assert source.entry is SOURCES[key]


def test_every_preset_extractor_is_registered_takes_its_options_and_fetches_with_all():
    from retr.manifests.presets import ALL_EXTRACTORS, EXTRA_EXTRACTORS, SYNTHETIC_EXTRACT_OPTIONS, get_preset
    catalog = weights_catalog()
    named = {*ALL_EXTRACTORS, *(n for names in EXTRA_EXTRACTORS.values() for n in names), *SYNTHETIC_EXTRACT_OPTIONS}
    for preset in ("coco", "f30k", "synthetic"):
        named |= set(get_preset(preset).extractors)
    assert named - set(available_extractors()) == set()
    for name in named:
        assert catalog.extractors[name] in catalog.groups[ALL], name              # make extract needs it: in all
        assert set(SYNTHETIC_EXTRACT_OPTIONS.get(name, {})) <= declared_options(name), name


def test_declared_outputs_follow_the_options():
    assert extractor_spec("resnet152-grid").feature_shape() == (49, 2048)
    assert extractor_spec("resnet152-grid").feature_shape({"grid_size": 14}) == (196, 2048)
    assert extractor_spec("vgg16-maps").feature_shape({"image_size": 224}) == (49, 512)
    assert extractor_spec("butd-regions").feature_shape({"max_boxes": 10}) == (10, 2048)
    assert extractor_spec("tencrop-irv2").feature_shape({"image_size": 75}) == (10, 1536)
    from retr.extractors.clip import FAMILY, geometry
    for name, arch in FAMILY.items():                  # the data against open_clip's configs
        g = geometry(arch)
        assert extractor_spec(name).feature_shape() == (g["tokens"], g["embed_dim"]), name


def test_every_random_network_is_made_once_in_the_one_seeded_cache(monkeypatch):
    """BUTD's random detector included: same seed constant, same cache, made once, the library the spec names."""
    from retr.extractors.butd import random_weights
    assert random_weights.RANDOM_SEED is extractor_weights.RANDOM_SEED
    monkeypatch.setattr(extractor_weights, "_RANDOM_MODELS", extractor_weights.OrderedDict())
    made = []
    real = random_weights._randomize
    monkeypatch.setattr(random_weights, "_randomize", lambda model, seed: made.append(seed) or real(model, seed))
    options = {"short_side": 64, "max_side": 64, "post_nms_topk": 36, "pooled_size": 7}
    first = build_extractor("butd-regions", weights="random", **options)
    second = build_extractor("butd-regions", weights="random", **options)
    assert made == [extractor_weights.RANDOM_SEED]
    for (name, a), b in zip(first.network.state_dict().items(), second.network.state_dict().values()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name
    build_extractor("vgg16-maps", weights="random", image_size=224)
    assert [key[0] for key in extractor_weights._RANDOM_MODELS] == [
        extractor_spec("butd-regions").random.library, extractor_spec("vgg16-maps").random.library] == [
        "butd", "torchvision"]


def test_the_reproduction_recipes_ask_for_what_the_specs_declare():
    """Every feature set a published row needs: the shape its extractor's spec gives for the recipe's options, and
    the weights its spec's default weights are recorded as (the recipes state both as data of their own)."""
    from retr.trainers.reproduction import recipes
    provenances = [v for v in vars(recipes).values() if isinstance(v, recipes.FeatureProvenance)]
    assert {p.extractor for p in provenances} >= {"resnet152-grid", "vgg16-maps", "tencrop-vgg19",
                                                  "tencrop-resnet152", "tencrop-irv2", "butd-regions"}
    for provenance in provenances:
        spec = extractor_spec(provenance.extractor)
        options = {k: v for k, v in provenance.extracted.items() if k in declared_options(spec.name)}
        assert spec.feature_shape(options) == tuple(provenance.shape), provenance.extractor
        assert recipes.accepts(provenance.extracted["weights"], spec.weights.recorded), (provenance.extractor,
                                                                                          spec.weights.recorded)
