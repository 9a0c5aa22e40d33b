"""Tests that run over every registered model (timm-style): a new model module is covered by registering it.

Each model is built tiny (its config's size fields shrunk, :data:`TINY`) and checked for: output shapes, padding
invariance on both sides, block scoring = sub-block scoring = listed-pair scoring, float64 scoring, one real
training step (through the loop's ``train_step``, with the side files its spec reads made from the synthetic
dataset), a state-dict round trip, its presets and its generated command. A throwaway model defined here (a
mean-pooling dot-product model) is registered for the duration of this module, so these tests also show that
adding a model is one module with its spec.
"""
from __future__ import annotations

import copy

import dataclasses
import inspect
from pathlib import Path
import io
import json
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from retr.trainers.config import (Settings, embed_size_setting, flag_of, make_config, margin_setting, setting,
                                  violation_setting, word_dim_setting)
from retr.trainers.models import ModelSpec, create_model, get_spec, list_models, register_model
from retr.trainers.models.base import Embeddings, MatchingModel
from retr.trainers.models.layers import l2norm, lengths_mask, masked_mean
from retr.trainers.models.registry import unregister_model

K, D, V = 4, 16, 40

#: small values for the size settings any model may have (applied only where the config has the field)
TINY = {"embed_size": 16, "word_dim": 8, "hidden_size": 8, "tree_hidden": 8, "gru_size": 8, "hops": 2,
        "attention_hidden": 8, "conv_filters": 4, "concept_word_dim": 8, "num_negatives": 3, "dropout": 0.0,
        "pair_chunk": 7, "max_words": 12, "num_regions": K}


# ------------------------------------------------------------------------------------- a throwaway model

@dataclass
class ThrowawayConfig(Settings):
    """The throwaway model's settings."""

    embed_size: int = embed_size_setting(32)
    word_dim: int = word_dim_setting(16)
    temperature: float = setting(1.0, "Scale of the dot product.")
    margin: float = margin_setting(0.2)
    max_violation: bool = violation_setting(True)


class Throwaway(MatchingModel):
    """Mean of the regions → Linear; mean of the word embeddings → Linear; scaled dot product."""

    def __init__(self, vocab_size: int, img_dim: int = 2048, config: ThrowawayConfig | None = None):
        cfg = self.config = config if config is not None else ThrowawayConfig()
        super().__init__(cfg.margin, cfg.max_violation)
        self.img = nn.Linear(img_dim, cfg.embed_size)
        self.embed = nn.Embedding(vocab_size, cfg.word_dim)
        self.txt = nn.Linear(cfg.word_dim, cfg.embed_size)
        self.temperature = cfg.temperature

    def encode_images(self, features, mask) -> Embeddings:
        return {"vector": l2norm(self.img(masked_mean(features.float(), mask.bool())))}

    def encode_captions(self, tokens, lengths) -> Embeddings:
        mask = lengths_mask(lengths.to(tokens.device), tokens.shape[1])
        return {"vector": l2norm(self.txt(masked_mean(self.embed(tokens), mask)))}

    def score(self, images, captions, dtype=None):
        dtype = dtype or images["vector"].dtype
        return self.temperature * images["vector"].to(dtype) @ captions["vector"].to(dtype).t()


THROWAWAY = ModelSpec(name="throwaway-mean", model_class=Throwaway, config_class=ThrowawayConfig,
                      summary="Train a mean-pooling dot-product model (a test's throwaway).",
                      examples=("retr-train throwaway-mean --features f.h5 --manifest m.jsonl --out runs/t",),
                      presets={"f30k": {"epochs": 2, "lr": 1e-3}}, default_preset="f30k")
#: VSE∞ with its BERT text encoder, checked as a model of its own (a tiny random BERT: tests/bert_support.py)
BERT_VARIANT = "vse-infinity+bert"
#: every registered model, the BERT variant, and the throwaway (registered only while a test runs: no other test
#: sees it)
MODELS = [*list_models(), BERT_VARIANT, THROWAWAY.name]


def spec_name(name: str) -> str:
    """The registered model a name of :data:`MODELS` is."""
    return "vse-infinity" if name == BERT_VARIANT else name


@pytest.fixture(autouse=True)
def throwaway_registered():
    register_model(THROWAWAY)
    yield
    unregister_model(THROWAWAY.name)


def test_registry_lists_the_papers_models_and_the_throwaway():
    assert {"scan", "vsepp", "sman", "seam", "jgcar", "smfea", "throwaway-mean"} <= set(MODELS)


def test_every_report_a_spec_names_after_training_exists():
    from retr.trainers.evaluation.reports import AFTER_TRAINING

    named = {name: get_spec(spec_name(name)).after_training for name in MODELS}
    assert named["smfea"] == ("tree_accuracy",)
    assert {report for reports in named.values() for report in reports} <= set(AFTER_TRAINING)


# ------------------------------------------------------------------------------------- helpers

def data_sizes(name: str) -> dict:
    """Constructor sizes beyond vocab_size/img_dim (e.g. SMFEA's dictionary sizes): 5 each."""
    params = inspect.signature(get_spec(spec_name(name)).model_class.__init__).parameters
    sizes = {n: 5 for n, p in params.items()
             if n not in ("self", "vocab_size", "img_dim", "config", "settings") and p.default is p.empty}
    if name == BERT_VARIANT:
        from bert_support import bert_config
        sizes["bert_config"] = bert_config(V)
    return sizes


def tiny_settings(name: str) -> dict:
    names = {f.name for f in dataclasses.fields(get_spec(spec_name(name)).config_class)}
    return {k: v for k, v in TINY.items() if k in names} | ({"text_encoder": "bert"} if name == BERT_VARIANT else {})


def tiny_model(name: str, seed: int = 0, vocab_size: int = V, img_dim: int = D, **sizes) -> MatchingModel:
    torch.manual_seed(seed)
    model = create_model(spec_name(name), vocab_size=vocab_size, img_dim=img_dim, **{**data_sizes(name), **sizes},
                         **tiny_settings(name))
    if name == BERT_VARIANT:
        from bert_support import prepare_word_pieces
        prepare_word_pieces(model, vocab_size)
    return model


def image_batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, K, D]`` features whose padded rows hold large garbage, and the mask ``[n, K]``."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(n, K, D, generator=g)
    counts = torch.tensor([K - (i % 3) for i in range(n)])
    mask = torch.arange(K).view(1, -1) < counts.view(-1, 1)
    return features, mask


def caption_batch(n: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5 + (i * 3) % 7 for i in range(n)])
    tokens = torch.randint(4, V, (n, int(lengths.max())), generator=g)
    tokens[:, 0] = 1
    tokens[torch.arange(n), lengths - 1] = 2
    tokens = tokens * (torch.arange(tokens.shape[1]).view(1, -1) < lengths.view(-1, 1))
    return tokens, lengths


@torch.no_grad()
def scores(model, features, mask, tokens, lengths, dtype=None) -> torch.Tensor:
    return model.score(model.encode_images(features, mask), model.encode_captions(tokens, lengths), dtype=dtype)


# ------------------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("name", MODELS)
def test_shapes_and_finite_scores(name):
    model = tiny_model(name).eval()
    s = scores(model, *image_batch(3), *caption_batch(5))
    assert s.shape == (3, 5) and torch.isfinite(s).all()


@pytest.mark.parametrize("name", MODELS)
def test_padding_changes_no_score(name):
    """Garbage in padded regions, extra padding and other words after a caption's length leave every score as it
    was."""
    model = tiny_model(name).eval()
    features, mask = image_batch(3)
    tokens, lengths = caption_batch(5)
    reference = scores(model, features, mask, tokens, lengths)
    garbage = features.masked_fill(~mask.unsqueeze(-1), 1e3)
    assert torch.allclose(scores(model, garbage, mask, tokens, lengths), reference, atol=1e-5)
    padded = torch.cat([tokens, torch.zeros(5, 4, dtype=tokens.dtype)], dim=1)
    assert torch.allclose(scores(model, features, mask, padded, lengths), reference, atol=1e-5)
    words_after = padded.masked_fill(torch.arange(padded.shape[1]) >= lengths.view(-1, 1), 7)   # not padding ids
    assert torch.allclose(scores(model, features, mask, words_after, lengths), reference, atol=1e-5)
    for j in range(5):      # each caption alone, cut to its length
        alone = scores(model, features, mask, tokens[j:j + 1, :int(lengths[j])], lengths[j:j + 1])
        assert torch.allclose(alone[:, 0], reference[:, j], atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_blocks_pairs_and_float64_agree(name):
    model = tiny_model(name).eval()
    features, mask = image_batch(4)
    tokens, lengths = caption_batch(6)
    with torch.no_grad():
        images, captions = model.encode_images(features, mask), model.encode_captions(tokens, lengths)
        full = model.score(images, captions)
        sub = lambda e, s: {k: v[s] for k, v in e.items()}  # noqa: E731
        blocks = torch.cat([torch.cat([model.score(sub(images, r), sub(captions, c)) for c in (slice(0, 2), slice(2, 6))],
                                      dim=1) for r in (slice(0, 3), slice(3, 4))], dim=0)
        assert torch.allclose(blocks, full, atol=1e-5)
        img_idx, cap_idx = torch.tensor([0, 3, 1, 1, 2]), torch.tensor([5, 0, 2, 4, 1])
        pairs = model.pair_score(images, captions, img_idx, cap_idx)
        assert torch.allclose(pairs.float(), full[img_idx, cap_idx], atol=1e-5)
        exact = model.score(images, captions, dtype=torch.float64)
    assert exact.dtype == torch.float64 and torch.allclose(exact.float(), full, atol=1e-4)


#: the models whose pair_score scores each listed pair on its own (its cost grows with the pairs)
ALIGNED = ("scan", "sman", "seam", "vsepp", "vse-infinity", BERT_VARIANT, "smfea")


@pytest.mark.parametrize("name", MODELS)
def test_a_model_that_scores_without_parameters_scores_in_float64_as_its_float64_copy(name):
    """``score_uses_parameters = False`` lets the evaluator score float64 with the model itself: its scores and
    listed pairs in float64 must then equal a float64 copy's, to the bit (and its parameters must be unused)."""
    import copy

    model = tiny_model(name).eval()
    if model.score_uses_parameters:
        return
    features, mask = image_batch(4)
    tokens, lengths = caption_batch(6)
    with torch.no_grad():
        images, captions = model.encode_images(features, mask), model.encode_captions(tokens, lengths)
        wide = copy.deepcopy(model).double()
        for p in wide.parameters():
            p.data.fill_(float("nan"))          # a parameter used would show in every score
        img_idx, cap_idx = torch.tensor([0, 3, 1, 1, 2]), torch.tensor([5, 0, 2, 4, 1])
        for scorer in (model, wide):
            got = scorer.score(images, captions, dtype=torch.float64)
            pairs = scorer.pair_score(images, captions, img_idx, cap_idx, dtype=torch.float64)
            assert got.dtype == torch.float64 and torch.isfinite(got).all() and torch.isfinite(pairs).all()
        assert torch.equal(model.score(images, captions, dtype=torch.float64),
                           wide.score(images, captions, dtype=torch.float64))


@pytest.mark.parametrize("name", ["throwaway-mean", *ALIGNED])
def test_pair_score_equals_score_on_the_listed_pairs(name):
    """The base ``pair_score`` (the throwaway model keeps it) and the aligned ones: pairs in any order, repeated,
    spread over several image blocks and caption chunks (the base's blocks; the aligned ones' chunks shrunk to a
    few pairs), give ``score``'s entries, in float32 and float64; no pairs give ``[0]``."""
    kept = type(tiny_model(name)).pair_score is MatchingModel.pair_score
    assert kept == (name == "throwaway-mean") and tiny_model(name).pair_score_is_aligned == (name in ALIGNED)
    model = tiny_model(name).eval()
    with torch.no_grad():
        images = model.encode_images(*image_batch(7))
        captions = model.encode_captions(*caption_batch(9))
        g = torch.Generator().manual_seed(3)
        img_idx, cap_idx = torch.randint(0, 7, (40,), generator=g), torch.randint(0, 9, (40,), generator=g)
        img_idx[:3], cap_idx[:3] = 5, 4                                   # one pair three times
        wide = lambda e: {k: v.double() if v.is_floating_point() else v for k, v in e.items()}  # noqa: E731
        for dtype in (None, torch.float64):
            if dtype is not None:        # as the evaluator scores in float64: a float64 copy of the model (SMAN's
                model = copy.deepcopy(model).double()      # attention runs in the parameters' dtype)
                images, captions = wide(images), wide(captions)
            full = model.score(images, captions, dtype=dtype)
            for image_block, pair_budget in ((64, 1 << 16), (2, 3), (3, 1)):
                if kept:
                    pairs = model.pair_score(images, captions, img_idx, cap_idx, dtype=dtype,
                                             image_block=image_block, pair_budget=pair_budget)
                else:
                    for attribute in ("pair_chunk", "max_chunk_elements"):
                        if hasattr(model, attribute):
                            setattr(model, attribute, pair_budget * (1 if attribute == "pair_chunk" else 64))
                    pairs = model.pair_score(images, captions, img_idx, cap_idx, dtype=dtype)
                assert pairs.shape == (40,) and pairs.dtype == full.dtype
                torch.testing.assert_close(pairs, full[img_idx, cap_idx], rtol=0, atol=1e-6 if dtype is None
                                           else 1e-12)
        empty = torch.zeros(0, dtype=torch.long)
        assert model.pair_score(images, captions, empty, empty).shape == (0,)


def _model_state(model: nn.Module) -> tuple[dict, dict]:
    """Every plain attribute of every submodule (other objects by type) and every tensor (dtype, value)."""
    plain = (bool, int, float, str, tuple, torch.dtype, type(None))
    attributes = {(path, k): (v if isinstance(v, plain) else type(v))
                  for path, module in model.named_modules() for k, v in vars(module).items()}
    tensors = {k: (v.dtype, v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()}
    return attributes, tensors


@pytest.mark.parametrize("name", MODELS)
def test_scoring_in_float64_leaves_the_model_as_it_was(name):
    """The dtype is an argument: scoring (and the two-step hooks) at float64 sets and changes nothing."""
    model = tiny_model(name).eval()
    with torch.no_grad():
        images = model.encode_images(*image_batch(3))
        captions = model.encode_captions(*caption_batch(4))
        before = _model_state(model)
        reference = model.score(images, captions)
        wide = lambda e: {k: v.double() if v.is_floating_point() else v for k, v in e.items()}  # noqa: E731
        model.score(wide(images), wide(captions), dtype=torch.float64)
        model.pair_score(wide(images), wide(captions), torch.tensor([0, 2]), torch.tensor([3, 1]), dtype=torch.float64)
        if model.has_global_stage:
            model.global_score(wide(images), wide(captions), dtype=torch.float64)
        else:
            with pytest.raises(NotImplementedError, match="no global stage"):
                model.global_score(images, captions)
        after = _model_state(model)
        assert torch.equal(model.score(images, captions), reference)
    assert after[0] == before[0]
    assert after[1].keys() == before[1].keys()
    for key, (dtype, value) in before[1].items():
        assert after[1][key][0] == dtype and torch.equal(after[1][key][1], value), key


def test_hook_defaults_are_declared_on_the_base_class():
    model = tiny_model("throwaway-mean")
    assert (model.batch_extras, model.shortlist, model.has_global_stage) == ((), 0, False)
    assert isinstance(model.configure_optimizer(1e-3), torch.optim.Adam)
    with pytest.raises(NotImplementedError, match="throwaway-mean predicts no tree nodes"):
        model.predict_nodes()
    assert {n: get_spec(n).model_class.has_global_stage for n in ("jgcar", "sman", "scan", "vsepp")} == \
        {"jgcar": True, "sman": True, "scan": False, "vsepp": False}


@pytest.mark.parametrize("name", MODELS)
def test_state_dict_round_trip_gives_the_same_scores(name):
    model = tiny_model(name, seed=0).eval()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    other = tiny_model(name, seed=1).eval()
    other.load_state_dict(torch.load(buffer, weights_only=True))
    batch = (*image_batch(3), *caption_batch(4))
    assert torch.equal(scores(model, *batch), scores(other, *batch))


@pytest.fixture(scope="module")
def synthetic_side_files(synthetic_data, tmp_path_factory):
    """A small synthetic dataset, its scene-region features, trees, concepts and a label file."""
    from trainer_synthetic import write_trees_and_concepts

    folder = tmp_path_factory.mktemp("registry")
    manifest, features = synthetic_data(images=30, seed=0)
    write_trees_and_concepts(manifest, folder)
    scenes = [json.loads(line) for line in (manifest.parent / "scenes.jsonl").read_text().splitlines()]
    (folder / "labels.json").write_text(json.dumps({s["id"]: sorted({o["shape"] for o in s["objects"]})
                                                    for s in scenes}))
    files = {"trees": str(folder / "trees.h5"), "concepts": str(folder / "concepts.h5"),
             "labels": str(folder / "labels.json")}
    return manifest, features, files


@pytest.mark.parametrize("name", MODELS)
def test_one_training_step_through_the_loop(name, synthetic_side_files):
    """The spec's side files → tensors → ``prepare_training``; one ``train_step`` changes the parameters."""
    from retr.store.features import FeatureSet
    from retr.store.vocab import Vocabulary
    from retr.trainers.data.splits import CaptionBatches, EpochBatchSampler, ImageFeatures, load_split
    from retr.trainers.training.loop import train_step
    from retr.trainers.models import ModelInputs
    from retr.manifests.schema import read_manifest

    manifest, features, files = synthetic_side_files
    spec = get_spec(spec_name(name))
    captions = [c for r in read_manifest(manifest, splits=["train"]) for c in r.captions]
    config = make_config(spec.config_class, tiny_settings(name))
    if name == BERT_VARIANT:                 # a tiny pretrained BERT folder over the captions' words
        from bert_support import wordpiece_tokens, write_tiny_bert
        folder = write_tiny_bert(Path(files["trees"]).parent / "tiny-bert", wordpiece_tokens(captions))
        config = dataclasses.replace(config, bert_model=str(folder))
        vocab = spec.caption_vocabulary(config, None)
    else:
        vocab = Vocabulary.build(captions, 1)
    fs = FeatureSet(features)
    data, _ = load_split(manifest, ["train"], vocab, fs)
    wanted = {i.name: files.get(i.name) for i in spec.inputs}
    inputs = spec.load_inputs(data, wanted, config, vocab) if spec.load_inputs else ModelInputs()
    torch.manual_seed(0)
    model = create_model(spec.name, vocab_size=len(vocab), img_dim=int(fs.feature_shape[1]),
                         **{**data_sizes(name), **inputs.sizes}, config=config)
    model.prepare_training(inputs.tensors)
    optimizer = model.configure_optimizer(1e-2)
    sampler = EpochBatchSampler(data.num_captions, 8, 0, 0, 1)
    batch = next(iter(torch.utils.data.DataLoader(CaptionBatches(data, ImageFeatures(fs, data.image_ids)),
                                                  sampler=sampler, batch_size=None)))
    before = [p.detach().clone() for p in model.parameters()]
    loss = train_step(model, batch, optimizer, None, 2.0, torch.device("cpu"))
    assert loss == loss and abs(loss) < 1e6
    changed = sum(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert changed > 0


@pytest.mark.parametrize("name", MODELS)
def test_presets_resolve_and_every_setting_has_help(name):
    spec = get_spec(spec_name(name))
    for preset in spec.presets:
        make_config(spec.config_class, {k: v for k, v in spec.resolve_preset(preset).items()
                                        if k in {f.name for f in dataclasses.fields(spec.config_class)}})
    for field in dataclasses.fields(spec.config_class):
        assert field.metadata.get("help"), f"{name}.{field.name} has no help"


@pytest.mark.parametrize("name", MODELS)
def test_generated_command_lists_every_setting(name):
    from retr.trainers.commands.train import training_command

    spec = get_spec(spec_name(name))
    command = training_command(spec)
    flags = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
    for field in dataclasses.fields(spec.config_class):
        if field.metadata.get("cli", True):
            assert set(flag_of(field).split("/")) <= flags, field.name
    for side in spec.inputs:
        assert "--" + side.name.replace("_", "-") in flags


def test_unknown_setting_is_refused_by_name():
    with pytest.raises(ValueError, match="bogus"):
        tiny_model("throwaway-mean", bogus=1)
    with pytest.raises(ValueError, match="direction must be one of"):
        create_model("scan", vocab_size=V, direction="sideways")
