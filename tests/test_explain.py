"""``explain``: every model with attention returns the maps ``score`` computes for one pair.

For every registered model that explains (and a few variants of each: SCAN's two directions, SMAN without the
multi-modal step, SEAM-E/C/G, SMFEA without trees, JGCAR cutting captions at ``max_words``), a tiny random model
encodes one image and one caption and the test checks:

* the names are the model's ``explains``, the shapes those its class docstring gives, padding dropped;
* rows are distributions where the paper's attention is a softmax; node ids are ids;
* **faithfulness**: the pair's score is recomputed *from the returned maps* with the model's formula written out
  here (e.g. SCAN t-i: attended region vectors = weights @ regions, cosine with the words, LogSumExp) and must
  equal ``model.score`` to 1e-5 — and the same recomputation with any other map (a one-hot one) must not;
* the pair inside a padded batch (garbage in padded regions, a longer caption beside it) gives the same maps.

VSE++ has no attention: ``explains`` is empty and ``explain`` raises.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from retr.trainers.models import create_model, get_spec, list_models
from retr.trainers.models.base import MatchingModel
from retr.trainers.models.tree_lstm import ENTITY_SLOTS, RELATION_SLOTS

K, D, V = 6, 16, 40            # positions per image (regions / cells / crops), feature size, vocabulary
K_REAL, L = 4, 7               # the explained pair: real regions of its image, tokens of its caption
NUM_CLASSES = 5                # SMFEA's dictionary and concept sizes (data_sizes)

#: small values for the size settings (as tests/test_model_registry.py), applied where the config has the field
TINY = {"embed_size": 16, "word_dim": 8, "hidden_size": 8, "tree_hidden": 8, "gru_size": 8, "hops": 3,
        "attention_hidden": 8, "conv_filters": 4, "concept_word_dim": 8, "num_negatives": 3, "dropout": 0.0,
        "pair_chunk": 7, "max_words": 12, "num_regions": K}

#: variants beyond each registry default: (model, settings)
VARIANTS = [("scan", {"direction": "i2t", "agg": "avg", "lambda_softmax": 4.0}),
            ("scan", {"direction": "t2i", "agg": "max", "norm": "softmax"}),
            ("scan", {"direction": "i2t", "agg": "lse", "lambda_lse": 5.0, "norm": "l2norm"}),
            ("sman", {"multimodal_step": False}),
            ("sman", {"divide_by_cells": True, "alpha": 1.0}),
            ("jgcar", {"max_words": 5}),
            ("seam", {"text_encoder": "e"}),
            ("seam", {"text_encoder": "g"}),
            ("seam", {"text_encoder": "c", "padding": "authors"}),
            ("smfea", {"use_trees": False}),
            ("smfea", {"instance_bn": "features"})]


def data_sizes(name: str) -> dict:
    """Constructor sizes beyond vocab_size/img_dim (SMFEA's dictionary and concept sizes)."""
    params = inspect.signature(get_spec(name).model_class.__init__).parameters
    return {n: NUM_CLASSES for n, p in params.items()
            if n not in ("self", "vocab_size", "img_dim", "config", "settings") and p.default is p.empty}


#: the layers that make attention logits, and by how much the tests scale their weights: a tiny random model
#: attends almost uniformly, and with sharper attention a wrong map changes the score measurably
SHARPEN = {"sman": {"img_attn1.logit": 20.0, "txt_attn1.logit": 20.0, "img_attn2.logit": 20.0,
                    "txt_attn2.logit": 20.0},
           "jgcar": {"coattn.w_hv": 20.0, "coattn.w_hs": 20.0, "coattn.W_b": 5.0, "coattn.W_v": 5.0,
                     "coattn.W_s": 5.0},
           "seam": {f"txt_enc.attention.{m}.ws2": 20.0 for m in range(3)},
           "smfea": {"img_attn.fc_score": 20.0, "txt_attn.fc_score": 20.0}}


def tiny_model(name: str, settings: dict | None = None, seed: int = 0) -> MatchingModel:
    names = {f.name for f in dataclasses.fields(get_spec(name).config_class)}
    torch.manual_seed(seed)
    model = create_model(name, vocab_size=V, img_dim=D, **data_sizes(name),
                         **{**{k: v for k, v in TINY.items() if k in names}, **(settings or {})})
    modules = dict(model.named_modules())
    with torch.no_grad():
        for layer, factor in SHARPEN.get(name, {}).items():
            if layer in modules:
                modules[layer].weight.mul_(factor)
    return model.eval()


def fixed_positions(name: str) -> bool:
    """Models built for a fixed number of positions (JGCAR's per-region bias, SMFEA's per-region batch norm)."""
    return "num_regions" in {f.name for f in dataclasses.fields(get_spec(name).config_class)}


def pair(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The explained pair, unpadded: features ``[1, k, D]`` and mask (k = K_REAL, or K with the last K − K_REAL
    positions masked for models with a fixed number of positions), tokens ``[1, L]`` and lengths ``[1]``."""
    g = torch.Generator().manual_seed(11)
    features = torch.randn(1, K, D, generator=g)
    mask = torch.arange(K).view(1, -1) < K_REAL
    if fixed_positions(name):
        features = features.masked_fill(~mask.unsqueeze(-1), 0.0)
    else:
        features, mask = features[:, :K_REAL], mask[:, :K_REAL]
    tokens = torch.randint(4, V, (1, L), generator=g)
    tokens[0, 0], tokens[0, -1] = 1, 2                                   # <start> … <end>
    return features, mask, tokens, torch.tensor([L])


def padded_batch(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row 0 of both sides is :func:`pair`, padded: its image's padded regions hold garbage, another image beside
    it; its caption is zero-padded to a longer caption's length, two captions beside it."""
    features, mask, tokens, lengths = pair(name)
    g = torch.Generator().manual_seed(12)
    batch = torch.randn(2, K, D, generator=g) * 1e3                      # garbage wherever a position is padded
    batch[0, :K_REAL] = features[0, :K_REAL]
    batch[1] = torch.randn(K, D, generator=g)
    batch_mask = torch.tensor([[True] * K_REAL + [False] * (K - K_REAL), [True] * K])
    longest = L + 3
    caps = torch.randint(4, V, (3, longest), generator=g)
    caps[:, 0] = 1
    caps[0, :L], caps[0, L:] = tokens[0], 0
    caps[1, -1], caps[2, 4:] = 2, 0
    caps[2, 3] = 2
    return batch, batch_mask, caps, torch.tensor([L, longest, 4])


def row(embeddings: dict, index: int = 0) -> dict:
    return {k: v[index:index + 1] for k, v in embeddings.items()}


def real_words(model: MatchingModel) -> int:
    """Tokens the model keeps of the pair's caption (JGCAR cuts captions at ``max_words``)."""
    return min(L, model.max_words) if model.name == "jgcar" else L


# ------------------------------------------------------------------------------------ each model's documentation

def expected_shapes(model: MatchingModel) -> dict[str, tuple[int, ...]]:
    """The shapes each class docstring gives, for the pair (K_REAL regions, L tokens)."""
    k, n = K_REAL, real_words(model)
    if model.name == "scan":
        return {"word_to_region": (n, k)} if model.direction == "t2i" else {"region_to_word": (k, n)}
    if model.name == "sman":
        steps = 2 if model.multimodal_step else 1
        return {"visual_attention": (steps, k), "textual_attention": (steps, n)}
    if model.name == "jgcar":
        return {"visual_attention": (1, k), "textual_attention": (1, n)}
    if model.name == "seam":
        return {name: (attention.hops, n) for name, attention in zip(model.explains, model.txt_enc.attention)}
    if model.name == "smfea":
        shapes = {"region_attention": (k,), "word_attention": (n,)}
        if model.use_trees:
            shapes.update(image_tree_nodes=(7,), text_tree_nodes=(7,))
        return shapes
    if model.name == "vse-infinity":
        return {"image_pooling": (k,), "caption_pooling": (n,)}
    raise AssertionError(f"{model.name} explains {model.explains}: add its documented shapes and its score "
                         "formula to tests/test_explain.py")


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """The authors' ``x / (‖x‖ + 1e-8)``."""
    return x / (x.norm(dim=-1, keepdim=True) + 1e-8)


def _cos(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The authors' cosine along the last axis, ``x·y / max(‖x‖‖y‖, 1e-8)``."""
    return (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1)).clamp(min=1e-8)


def _aggregate(r: torch.Tensor, agg: str, lambda_lse: float) -> torch.Tensor:
    if agg == "lse":
        return torch.log(torch.exp(lambda_lse * r).sum()) / lambda_lse
    return {"avg": r.mean(), "max": r.max(), "sum": r.sum()}[agg]


def scan_from_maps(model, features, mask, tokens, lengths, images, captions, maps) -> torch.Tensor:
    """SCAN §3.1–3.2: the attended vector of each query is the weighted sum of the context vectors; its relevance
    R = cos(query, attended); the score aggregates R over the queries (LSE, AVG, max or sum)."""
    v = images["regions"][0][images["mask"][0]]                          # [K, d] real regions
    e = captions["words"][0][captions["mask"][0]]                        # [L, d] real words
    if model.direction == "t2i":
        attended = maps["word_to_region"] @ v                            # a_j = Σ_i α_ji v_i   [L, d]
        relevance = _cos(e, attended)                                    # R(e_j, a_j)          [L]
    else:
        attended = maps["region_to_word"] @ e                            # a_i = Σ_j α_ij e_j   [K, d]
        relevance = _cos(v, attended)                                    # R(v_i, a_i)          [K]
    return _aggregate(relevance.double(), model.agg, model.lambda_lse)


def sman_from_maps(model, features, mask, tokens, lengths, images, captions, maps) -> torch.Tensor:
    """SMAN Eq. 7, 11, 15, 18–20: v1 = tanh(P1 Σ a I), t1 = Σ a S, v2 = tanh(P2 Σ a I), t2 = Σ a S (the second
    rows), score = Σ_k cos(v_k, t_k); level 0 (mean pooling, no attention) is the encoders'."""
    cells = features[0][mask[0]].float()                                 # I_m [K, D_in] (eval: no dropout)
    words = captions["words"][0][captions["mask"][0]]                    # S_l [L, d]
    visual, textual = maps["visual_attention"], maps["textual_attention"]
    scale = 1.0 / cells.shape[0] if model.divide_by_cells else 1.0       # the optional 1/M of Eq. 7/15
    v1 = torch.tanh(model.img_proj1(scale * (visual[0] @ cells)))
    t1 = textual[0] @ words
    total = _cos(images["v0"][0], captions["t0"][0]) + _cos(v1, t1)
    if model.multimodal_step:
        v2 = torch.tanh(model.img_proj2(scale * (visual[1] @ cells)))
        t2 = textual[1] @ words
        total = total + _cos(v2, t2)
    return total


def jgcar_from_maps(model, features, mask, tokens, lengths, images, captions, maps) -> torch.Tensor:
    """JGCAR Eq. 14–15: v̄ = Σ a^v V, s̄ = Σ a^s S, α = cos(v̄, s̄)."""
    regions = images["regions"][0][images["mask"][0]]                    # V [N, d]
    words = captions["words"][0][captions["mask"][0]]                    # S^s [T, d]
    v_bar = maps["visual_attention"][0] @ regions
    s_bar = maps["textual_attention"][0] @ words
    return F.cosine_similarity(v_bar, s_bar, dim=-1, eps=1e-8)


def seam_from_maps(model, features, mask, tokens, lengths, images, captions, maps) -> torch.Tensor:
    """SEAM: M = A·H per attention module (H: what it attends over), concatenated, projected, l2-normalised and
    made non-negative; the score is the order violation −‖max(0, c − i)‖."""
    views, _ = model.txt_enc.views(tokens, lengths)
    pooled = torch.cat([(maps[name] @ h[0, :L]).flatten() for name, h in zip(model.explains, views)])
    caption = _l2norm(model.txt_enc.fc(pooled)).abs()
    violation = (caption - images["vector"][0]).clamp(min=0)
    return -violation.pow(2).sum() if model.order_squared else -violation.norm()


def smfea_from_maps(model, features, mask, tokens, lengths, images, captions, maps) -> torch.Tensor:
    """SMFEA Eq. 3: V_D = l2norm(Σ α_i v_i) (S_D likewise over the words); the tree and concept branches and the
    fusion V_F = l2norm(β_d V_D + β_t V_T + β_c V_C) are built on it; the score is V_F · S_F."""
    regions = model.img_enc(features)[0][mask[0]]                        # v_i [K, d]
    words = model.txt_enc(tokens, lengths)[0][:L]                        # [L, d]
    v_d = _l2norm(maps["region_attention"] @ regions)
    s_d = _l2norm(maps["word_attention"] @ words)
    img = model._branches(v_d.unsqueeze(0), model.img_tree if model.use_trees else None, model.img_concept_attn,
                          None)
    cap = model._branches(s_d.unsqueeze(0), model.txt_tree if model.use_trees else None, model.txt_concept_attn,
                          model.caption_concept_labels(tokens, lengths))
    return (img["fused"] @ cap["fused"].t())[0, 0]


def vse_infinity_from_maps(model, features, mask, tokens, lengths, images, captions, maps) -> torch.Tensor:
    """VSE∞ Eq. 2-3: each dimension's values sorted in decreasing order, v = Σ_k θ_k · max_k, l2-normalised on
    both sides; the score is their dot product."""
    regions = model.img_enc.project(features, mask)[0][mask[0]]          # [K, d] real regions
    words = model.txt_enc(tokens, lengths)[0][:L]                        # [L, d]
    pool = lambda x, theta: _l2norm(theta @ x.sort(dim=0, descending=True).values)  # noqa: E731
    return pool(regions, maps["image_pooling"]) @ pool(words, maps["caption_pooling"])


FROM_MAPS: dict[str, Callable[..., torch.Tensor]] = {
    "scan": scan_from_maps, "sman": sman_from_maps, "jgcar": jgcar_from_maps, "seam": seam_from_maps,
    "smfea": smfea_from_maps, "vse-infinity": vse_infinity_from_maps}


def _explaining(name: str) -> bool:
    return bool(tiny_model(name).explains)


DEFAULTS = [name for name in list_models() if _explaining(name)]
CASES = [(name, {}) for name in DEFAULTS] + VARIANTS
CASE_IDS = [name + "".join(f"-{k}={v}" for k, v in settings.items()) for name, settings in CASES]


@torch.no_grad()
def explained(name: str, settings: dict):
    model = tiny_model(name, settings)
    features, mask, tokens, lengths = pair(name)
    images, captions = model.encode_images(features, mask), model.encode_captions(tokens, lengths)
    return model, (features, mask, tokens, lengths), images, captions, model.explain(images, captions)


# ------------------------------------------------------------------------------------------------- the tests

def test_every_model_with_attention_explains_and_the_cases_cover_it():
    explaining = {name for name in list_models() if _explaining(name)}
    assert {"scan", "sman", "jgcar", "seam", "smfea"} <= explaining
    assert "vsepp" not in explaining
    assert {name for name, _ in VARIANTS} <= explaining


@pytest.mark.parametrize("name,settings", CASES, ids=CASE_IDS)
def test_names_shapes_and_distributions(name, settings):
    model, _, _, _, maps = explained(name, settings)
    assert tuple(maps) == tuple(model.explains)
    shapes = expected_shapes(model)
    assert {k: tuple(v.shape) for k, v in maps.items()} == shapes
    for key, value in maps.items():
        assert torch.isfinite(value.double()).all(), key
        if key.endswith("_nodes"):                                       # SMFEA's predicted referral tree
            assert value.dtype == torch.long
            assert ((value >= 0) & (value < NUM_CLASSES)).all()
            continue
        assert value.is_floating_point() and (value >= 0).all(), key
        torch.testing.assert_close(value.sum(-1), torch.ones(value.shape[:-1]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name,settings", CASES, ids=CASE_IDS)
def test_the_score_follows_from_the_maps(name, settings):
    """Faithfulness: the pair's score recomputed from the returned maps with the paper's formula is ``score``'s;
    with a one-hot map in place of any of them it is not (so the check would catch another map)."""
    model, (features, mask, tokens, lengths), images, captions, maps = explained(name, settings)
    from_maps = FROM_MAPS[name]
    with torch.no_grad():
        expected = model.score(images, captions)[0, 0]
        got = from_maps(model, features, mask, tokens, lengths, images, captions, maps)
        assert abs(float(got) - float(expected)) < 1e-5, (float(got), float(expected))
        for key, value in maps.items():
            if not value.is_floating_point():
                continue
            other = F.one_hot(value.argmin(-1), value.shape[-1]).to(value.dtype)   # all weight elsewhere
            wrong = from_maps(model, features, mask, tokens, lengths, images, captions, {**maps, key: other})
            assert abs(float(wrong) - float(expected)) > 1e-4, key


@pytest.mark.parametrize("name,settings", CASES, ids=CASE_IDS)
def test_a_padded_batch_gives_the_pairs_maps(name, settings):
    """In float64: padding (garbage regions ×1e3, zero-padded words, other rows beside it) changes the order of
    the reductions (packed GRU batches, masked softmaxes, BLAS blocking), so in float32 the pair's maps agree only
    to ~1e-6, and whether one element lands above a 1e-6 bound depends on the CPU and the thread count (it did on
    an AMD EPYC). In float64 the same rounding is ~1e-15: 1e-10 is far above it, and a padded position that
    leaked into a map (weights ~1e-3 and up) or a score would still fail."""
    model = tiny_model(name, settings).double()
    if getattr(model, "captions_in_split_order", False):
        pytest.skip("SEAM-C padding=authors: a caption's embedding depends on its batch, as in the authors' code")
    alone = pair(name)
    alone = (alone[0].double(), *alone[1:])
    features, mask, tokens, lengths = padded_batch(name)
    with torch.no_grad():
        maps = model.explain(model.encode_images(*alone[:2]), model.encode_captions(*alone[2:]))
        images, captions = model.encode_images(features.double(), mask), model.encode_captions(tokens, lengths)
        padded = model.explain(row(images), row(captions))
        # the batch scores its row 0 as the pair alone, and the maps behind that score are the pair's
        alone_score = model.score(model.encode_images(*alone[:2]), model.encode_captions(*alone[2:]))[0, 0]
        assert abs(float(model.score(images, captions)[0, 0]) - float(alone_score)) < 1e-10
    assert tuple(padded) == tuple(maps)
    for key in maps:
        assert padded[key].shape == maps[key].shape, key
        torch.testing.assert_close(padded[key], maps[key], rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", DEFAULTS)
def test_explain_takes_one_pair(name):
    model = tiny_model(name)
    features, mask, tokens, lengths = padded_batch(name)
    with torch.no_grad():
        images, captions = model.encode_images(features, mask), model.encode_captions(tokens, lengths)
        with pytest.raises(ValueError, match="one image and one caption"):
            model.explain(images, row(captions))
        with pytest.raises(ValueError, match="one image and one caption"):
            model.explain(row(images), captions)


def test_scan_attention_is_scores_own_over_a_chunked_block(monkeypatch):
    """SCAN's ``xattn_block`` keeps every chunk's attention; its scores are ``xattn_scores``' bit for bit, and each
    pair's slice of the block's attention is that pair's ``explain`` (to float32 rounding)."""
    from retr.trainers.models import scan as xattn

    monkeypatch.setattr(xattn, "CHUNK_ELEMENTS", 50)                     # many image and caption chunks
    for direction in ("t2i", "i2t"):
        model = tiny_model("scan", {"direction": direction})
        features, mask, tokens, lengths = padded_batch("scan")
        with torch.no_grad():
            images, captions = model.encode_images(features, mask), model.encode_captions(tokens, lengths)
            args = (images["regions"], images["mask"], captions["words"], captions["mask"], direction, model.norm,
                    model.agg, model.lambda_softmax, model.lambda_lse)
            scores, attention = xattn.xattn_block(*args, keep_attention=True)
            assert torch.equal(scores, xattn.xattn_scores(*args)) and torch.equal(scores, model.score(images, captions))
            for i in range(2):
                for c in range(3):
                    (weights,) = model.explain(row(images, i), row(captions, c)).values()
                    block = attention[i, :, c][images["mask"][i]][:, captions["mask"][c]]
                    # one pair alone and the whole block are reductions of other shapes: with one thread bit
                    # for bit; with several each may be split otherwise (1 float32 ulp seen at 2 threads)
                    torch.testing.assert_close(weights, block.t() if direction == "t2i" else block,
                                               rtol=2 * torch.finfo(torch.float32).eps, atol=0)


def test_smfea_node_ids_are_its_trees_predictions():
    model, (features, mask, tokens, lengths), _, _, maps = explained("smfea", {})
    torch.testing.assert_close(maps["image_tree_nodes"], model.predict_nodes(features=features, mask=mask)[0])
    torch.testing.assert_close(maps["text_tree_nodes"], model.predict_nodes(tokens=tokens, lengths=lengths)[0])
    assert ENTITY_SLOTS == (0, 2, 4, 6) and RELATION_SLOTS == (1, 3, 5)


def test_vsepp_has_no_attention_to_explain():
    model = tiny_model("vsepp")
    features, mask, tokens, lengths = pair("vsepp")
    assert model.explains == ()
    with torch.no_grad(), pytest.raises(NotImplementedError, match="no attention maps"):
        model.explain(model.encode_images(features, mask), model.encode_captions(tokens, lengths))
