"""SMAN: shapes, masking, the equations against a per-pair reference, blockwise scoring, the loss, learning."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from retr.trainers.config import upgrade_stored
from retr.trainers.models import create_model, preset
from retr.trainers.models.sman import SMAN, SMANConfig
from tests.ddp_simulation import simulated_ddp_grads

VOCAB, D_IN, D, CELLS = 40, 24, 16, 49


def tiny(**kw) -> SMAN:
    torch.manual_seed(kw.pop("seed", 0))
    args = dict(vocab_size=VOCAB, img_dim=D_IN, embed_size=D, word_dim=D, dropout=0.0)
    args.update(kw)
    return create_model("sman", **args).eval()


def batch(n_img=3, n_cap=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(n_img, CELLS, D_IN, generator=g)
    lengths = torch.tensor([9, 3, 6, 2, 7, 5, 4, 8][:n_cap])
    tokens = torch.randint(4, VOCAB, (n_cap, int(lengths.max())), generator=g)
    tokens = tokens.masked_fill(torch.arange(tokens.shape[1]) >= lengths.view(-1, 1), 0)
    return features, torch.ones(n_img, CELLS, dtype=torch.bool), tokens, lengths


def reference_pair(m: SMAN, cells: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Eq. 2–20 for one image [M, D_in] and one unpadded caption [L], written out step by step."""
    S = m.txt_enc(tokens.view(1, -1), torch.tensor([tokens.numel()]))[0]            # [L, d]
    v0 = torch.tanh(m.img_global(cells.mean(0)))
    if m.use_location:
        v0 = v0 + m.img_location(cells.unsqueeze(0))[0][0].mean(0)

    def attend(att, items, query):
        h = torch.tanh(att.item(items)) * torch.tanh(att.query(query))
        return torch.softmax(att.logit(h).squeeze(-1), dim=0)                        # bias included

    v1 = torch.tanh(m.img_proj1(attend(m.img_attn1, cells, v0) @ cells))
    t0 = S.mean(0)
    t1 = attend(m.txt_attn1, S, t0) @ S
    levels = [F.cosine_similarity(v0, t0, dim=0), F.cosine_similarity(v1, t1, dim=0)]
    if m.multimodal_step:
        v_hat, t_hat = m.img_memory(v0 + v1), m.txt_memory(t0 + t1)
        o_v = torch.sigmoid(m.alpha * v_hat + (1 - m.alpha) * t_hat)
        o_t = torch.sigmoid(m.alpha * t_hat + (1 - m.alpha) * v_hat)
        v2 = torch.tanh(m.img_proj2(attend(m.img_attn2, cells, o_v) @ cells))
        t2 = attend(m.txt_attn2, S, o_t) @ S
        levels.append(F.cosine_similarity(v2, t2, dim=0))
    return torch.stack(levels)


@pytest.mark.parametrize("options", [{}, {"alpha": 1.0}, {"use_location": False}, {"multimodal_step": False},
                                     {"alpha": 0.5, "text_rnn": "gru"}])
def test_block_scores_equal_the_equations_pair_by_pair(options):
    m = tiny(**options)
    features, mask, tokens, lengths = batch()
    with torch.no_grad():
        levels = m.level_scores(m.encode_images(features, mask), m.encode_captions(tokens, lengths))
        scores = m.score(m.encode_images(features, mask), m.encode_captions(tokens, lengths))
        n_levels = 3 if m.multimodal_step else 2
        assert levels.shape == (3, 4, n_levels) and scores.shape == (3, 4)
        for i in range(3):
            for c in range(4):
                expected = reference_pair(m, features[i], tokens[c, :lengths[c]])
                torch.testing.assert_close(levels[i, c], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(scores, levels.sum(-1))


def test_scores_are_pair_specific_and_alpha_one_is_not():
    """With α < 1 an image's level-2 vector depends on the caption; the α = 1 ablation removes that."""
    features, mask, tokens, lengths = batch()
    for alpha, pair_specific in ((0.9, True), (1.0, False)):
        m = tiny(alpha=alpha)
        im, caps = m.encode_images(features, mask), m.encode_captions(tokens, lengths)
        # swap the captions' level-2 text inputs for those of caption 0: only o_v's text part changes
        captions_0 = {k: v[:1].expand(4, *v.shape[1:]) for k, v in caps.items()}
        mixed = dict(captions_0, t0=caps["t0"], t1=caps["t1"])
        with torch.no_grad():
            a, b = m.level_scores(im, captions_0)[..., 2], m.level_scores(im, mixed)[..., 2]
        assert (not torch.allclose(a, b, atol=1e-6)) == pair_specific


def test_chunks_do_not_change_block_scores():
    """Block = pairs and padding invariance are test_model_registry.py's (every model); here SMAN's own chunking."""
    m = tiny()
    features, mask, tokens, lengths = batch(n_img=3, n_cap=6)
    with torch.no_grad():
        im, caps = m.encode_images(features, mask), m.encode_captions(tokens, lengths)
        block = m.score(im, caps)
        m.max_chunk_elements = 1          # one image row per chunk
        torch.testing.assert_close(m.score(im, caps), block)


def test_two_step_hooks_score_listed_pairs_like_the_block():
    """``pair_score`` equals ``score`` on listed pairs; with a shortlist covering everything, two-step = one-step."""
    from retr.trainers.evaluation.two_step import rerank_matrices
    for mode in ("sum", "concat"):
        m = tiny(eval_score=mode)
        features, mask, tokens, lengths = batch(n_img=3, n_cap=6)
        with torch.no_grad():
            im, caps = m.encode_images(features, mask), m.encode_captions(tokens, lengths)
            full = m.score(im, caps)
            img_idx, cap_idx = torch.tensor([0, 2, 1, 1, 0, 2]), torch.tensor([5, 0, 3, 3, 1, 2])
            m.max_chunk_elements = 1    # one pair per chunk
            torch.testing.assert_close(m.pair_score(im, caps, img_idx, cap_idx), full[img_idx, cap_idx])
            levels = m.level_scores(im, caps)
            torch.testing.assert_close(m.global_score(im, caps), levels[..., :2].sum(-1))
            i2t, t2i = rerank_matrices(m.global_score(im, caps),
                                       lambda ii, cc: m.pair_score(im, caps, ii, cc), shortlist=10)
        torch.testing.assert_close(i2t, full)
        torch.testing.assert_close(t2i, full)
    assert tiny(shortlist=50).shortlist == 50 and tiny().shortlist == 0


def test_float64_evaluation_embeddings_score_like_float32():
    """The evaluator hands over float64 embeddings and asks for float64 scores."""
    m = tiny()
    features, mask, tokens, lengths = batch()
    with torch.no_grad():
        im, caps = m.encode_images(features, mask), m.encode_captions(tokens, lengths)
        ref = m.score(im, caps)
        as64 = m.score({k: v.double() if v.is_floating_point() else v for k, v in im.items()},
                       {k: v.double() if v.is_floating_point() else v for k, v in caps.items()}, dtype=torch.float64)
    assert as64.dtype == torch.float64
    torch.testing.assert_close(as64.float(), ref, rtol=1e-5, atol=1e-6)


def test_concat_evaluation_score_is_the_cosine_of_concatenated_levels():
    m = tiny(eval_score="concat")
    features, mask, tokens, lengths = batch()
    with torch.no_grad():
        got = m.score(m.encode_images(features, mask), m.encode_captions(tokens, lengths))
        for i in range(3):
            for c in range(4):
                # rebuild v2/t2 through the reference, then concatenate the raw (unnormalised) levels
                S = m.txt_enc(tokens[c:c + 1, :lengths[c]], lengths[c:c + 1])[0]
                im = m.encode_images(features[i:i + 1], mask[i:i + 1])
                cap = m.encode_captions(tokens[c:c + 1, :lengths[c]], lengths[c:c + 1])
                parts = m._multimodal(im, cap, slice(None), torch.float32, dots=True)[0, 0]
                dot = (im["v0"] @ cap["t0"].t() + im["v1"] @ cap["t1"].t()).squeeze() + parts[0]
                vv = im["v0"].pow(2).sum() + im["v1"].pow(2).sum() + parts[1]
                tt = cap["t0"].pow(2).sum() + cap["t1"].pow(2).sum() + parts[2]
                assert S.shape[0] == lengths[c]
                torch.testing.assert_close(got[i, c], dot / (vv.sqrt() * tt.sqrt()), rtol=1e-5, atol=1e-6)
    m.train()   # training always uses the sum of per-level cosines (Eq. 20)
    with torch.no_grad():
        levels = m.level_scores(m.encode_images(features, mask), m.encode_captions(tokens, lengths))
        torch.testing.assert_close(m.score(m.encode_images(features, mask), m.encode_captions(tokens, lengths)),
                                   levels.sum(-1))


def direct_loss(scores, matched, m1, m2, lam, level):
    """Eq. 21–23 with loops: hardest negatives both ways + λ·Σ 2·[1 − cos − m2]₊."""
    B = len(scores)
    total = 0.0
    for i in range(B):
        total += max(max(0.0, m1 - scores[i][i] + scores[i][j]) for j in range(B) if j != i)
        total += max(max(0.0, m1 - scores[i][i] + scores[j][i]) for j in range(B) if j != i)
    intra = 0.0
    for i in range(B):
        distances = [1 - c for c in matched[i]] if level == "each" else [sum(1 - c for c in matched[i])]
        intra += sum(2 * max(0.0, dist - m2) for dist in distances)
    return total + lam * intra


@pytest.mark.parametrize("level", ["each", "sum"])
def test_loss_matches_the_direct_formula(level):
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(6, 6, generator=g) * 6 - 3
    matched = torch.rand(6, 3, generator=g) * 2 - 1
    m = tiny(intra_pair_weight=1.5, intra_pair_margin=0.25, intra_pair_level=level, margin=0.2)
    expected = direct_loss(scores.tolist(), matched.tolist(), 0.2, 0.25, 1.5, level)
    assert m.loss(scores, matched).item() == pytest.approx(expected, rel=1e-5)
    no_intra = tiny(intra_pair_weight=0.0)   # the SMAN-inter ablation
    assert no_intra.loss(scores).item() == pytest.approx(direct_loss(scores.tolist(), matched.tolist(),
                                                                      0.2, 0.25, 0.0, level), rel=1e-5)
    with pytest.raises(ValueError, match="per-level"):
        m.loss(scores)


def test_forward_is_the_loss_of_the_batch_levels():
    m = tiny()
    features, mask, tokens, lengths = batch(n_img=4)
    with torch.no_grad():
        levels = m.level_scores(m.encode_images(features, mask), m.encode_captions(tokens, lengths))
        expected = m.loss(levels.sum(-1), levels.diagonal(dim1=0, dim2=1).t())
        torch.testing.assert_close(m(features, mask, tokens, lengths), expected)


def test_registry_preset_and_options():
    cfg = preset("sman", "coco")
    assert cfg["alpha"] == 0.9 and cfg["margin"] == 0.2 and cfg["intra_pair_margin"] == 0.25
    assert cfg["intra_pair_weight"] == 1.0 and cfg["grad_clip"] == 0.1 and cfg["embed_size"] == 512
    assert cfg["epochs"] == 60 and cfg["lr_update"] == 50 and cfg["optimizer"] == "adadelta"
    assert cfg["lr"] == 0.05 and cfg["batch_size"] == 128 and cfg["max_violation"] is True
    assert cfg["rho"] == 0.9 and cfg["adadelta_eps"] == 1e-8 and cfg["weight_decay"] == 5e-4
    assert cfg["dropout"] == 0.3 and cfg["word_dim"] == 512 and cfg["text_rnn"] == "lstm"
    assert preset("sman", "f30k") == cfg                     # §IV-A3 gives one setting for both datasets
    model_args = {k: v for k, v in cfg.items() if k in SMAN.__init__.__code__.co_varnames}
    model = create_model("sman", vocab_size=VOCAB, img_dim=D_IN, **model_args)
    assert isinstance(model, SMAN) and model.alpha == 0.9
    assert tiny(use_location=False).img_location is None
    for bad in ({"alpha": 1.5}, {"intra_pair_level": "max"}, {"eval_score": "dot"}, {"text_rnn": "rnn"}):
        with pytest.raises(ValueError):
            tiny(**bad)


def tensorflow_adadelta(var, grads, lr, rho, eps, weight_decay):
    """TensorFlow's ApplyAdadelta, step by step (weight decay as an L2 term: its gradient ``wd · var``)."""
    accum, accum_update = torch.zeros_like(var), torch.zeros_like(var)
    for g in grads:
        g = g + weight_decay * var
        accum = rho * accum + (1 - rho) * g * g
        update = (accum_update + eps).sqrt() / (accum + eps).sqrt() * g
        accum_update = rho * accum_update + (1 - rho) * update * update
        var = var - lr * update
    return var


@pytest.mark.parametrize("settings", [{}, {"adadelta_eps": 1e-6}, {"rho": 0.95}])
def test_adadelta_steps_follow_tensorflows_update(settings):
    """The optimiser takes TensorFlow's Adadelta steps with the configured ε and ρ (defaults: ε 1e-8, ρ 0.9)."""
    m = tiny(**settings).double()
    eps, rho = settings.get("adadelta_eps", 1e-8), settings.get("rho", 0.9)
    optimizer = m.configure_optimizer(0.05)
    param = m.img_proj1.weight
    start = param.detach().clone()
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(param.shape, generator=g, dtype=torch.float64) * 0.01 for _ in range(3)]
    for grad in grads:
        optimizer.zero_grad(set_to_none=True)
        param.grad = grad.clone()
        optimizer.step()
    expected = tensorflow_adadelta(start, grads, 0.05, rho, eps, 5e-4)
    torch.testing.assert_close(param.detach(), expected, rtol=1e-10, atol=1e-12)
    # ε matters at this gradient size: PyTorch's 1e-6 would move ~10× farther than TensorFlow's 1e-8
    other = tensorflow_adadelta(start, grads, 0.05, rho, 1e-6 if eps == 1e-8 else 1e-8, 5e-4)
    ratio = (other - start).norm() / (expected - start).norm()
    assert ratio > 5 or ratio < 0.2


def test_runs_written_before_adadelta_eps_keep_pytorchs_epsilon():
    from retr.trainers.models import get_spec
    spec = get_spec("sman")
    upgraded = lambda args: upgrade_stored(spec, {"model": "sman", "model_args": args})["model_args"]  # noqa: E731
    assert upgraded({"alpha": 0.9})["adadelta_eps"] == 1e-6
    assert upgraded({"adadelta_eps": 1e-8})["adadelta_eps"] == 1e-8
    old = create_model("sman", vocab_size=VOCAB, img_dim=D_IN, embed_size=D, word_dim=D, **upgraded({}))
    assert old.configure_optimizer(0.05).param_groups[0]["eps"] == 1e-6
    assert tiny().configure_optimizer(0.05).param_groups[0]["eps"] == 1e-8


def test_ddp_gradients_sum_to_the_single_process_ones():
    """Score-side parameters (U_v, U_t, level-2 queries) must not count the gathered batch once per process."""
    m = tiny().train()
    features, mask, tokens, lengths = batch(n_img=4, n_cap=4)
    lengths = torch.tensor([9, 3, 9, 5])          # each half holds a 9-word caption: same padded width
    single, summed = simulated_ddp_grads(m, features, mask, tokens, lengths)
    assert set(single) == set(summed)
    for name in single:
        torch.testing.assert_close(summed[name], single[name], rtol=1e-4, atol=1e-6, msg=name)


# -------------------------------------------------------------------------------------------------- learning

def write_scene_grid_features(dataset, out, dim: int = 16, seed: int = 0):
    """A grid feature set [N, 49, dim] made from ``scenes.jsonl`` (what a perfect detector would see).

    Each object adds its one-hot attributes (size 2, colour 6, shape 5) and a presence flag to the 7×7 cell
    (32-px cells of the 224-px image) holding its centre; every cell gets N(0, 0.1²) noise. The relation is
    only in where the objects are, as in a real grid.
    """
    from retr.manifests.synthetic import COLOURS, SHAPES
    from retr.store.features import ShardWriter, shard_name, write_index
    colours, shapes = list(COLOURS), list(SHAPES)
    rng = np.random.default_rng(seed)
    scenes = [json.loads(line) for line in (dataset / "scenes.jsonl").read_text().splitlines()]
    features = rng.normal(0, 0.1, (len(scenes), 49, dim)).astype(np.float32)
    for n, scene in enumerate(scenes):
        for obj in scene["objects"]:
            cell = min(6, obj["centre"][1] // 32) * 7 + min(6, obj["centre"][0] // 32)
            features[n, cell, ["small", "large"].index(obj["size"])] += 1
            features[n, cell, 2 + colours.index(obj["colour"])] += 1
            features[n, cell, 8 + shapes.index(obj["shape"])] += 1
            features[n, cell, 13] += 1
    attrs = dict(kind="grid", extractor="scene-grid", backbone="none", weights="random", image_size=224,
                 manifest_sha256="0" * 64)
    shard = out / "scene-grid" / shard_name(0, 1)
    with ShardWriter(shard, attrs, (49, dim), dtype="float32", shard_index=0, num_shards=1) as writer:
        writer.append([s["id"] for s in scenes], features)
    return write_index(out / "scene-grid.h5", [shard])


@pytest.mark.slow
def test_sman_learns_the_synthetic_scenes(tmp_path):
    """Through the shared loop: test R@1 (both directions) many times chance after a short CPU run."""
    from retr.manifests.synthetic import generate_synthetic
    from retr.store.features import FeatureSet
    from retr.trainers.data.splits import ImageFeatures, load_split
    from retr.trainers.evaluation.metrics import retrieval_metrics
    from retr.trainers.evaluation.similarity import similarity_matrix
    from retr.trainers.training.loop import TrainConfig, train

    dataset = tmp_path / "synth"
    generate_synthetic(dataset, num_images=200, seed=0)
    features = write_scene_grid_features(dataset, tmp_path)
    # Adam and the sum over negatives: from scratch, on 180 training images, hardest negatives alone collapse
    # to equal scores within the couple of epochs there is time for (VSE++ reports the same for small data).
    cfg = TrainConfig(model="sman", model_config=SMANConfig(embed_size=32, word_dim=32, dropout=0.0, optimizer="adam",
                                                             max_violation=False),
                      features=str(features), manifest=str(dataset / "manifest.jsonl"), out=str(tmp_path / "run"),
                      epochs=4, batch_size=50, lr=3e-3, lr_update=100, grad_clip=2.0, device="cpu",
                      train_splits=["train"], val_images=20)
    train(cfg, quiet=True)
    state = torch.load(tmp_path / "run" / "best.pt", map_location="cpu", weights_only=False)
    from retr.store.vocab import Vocabulary
    vocab = Vocabulary.from_json(state["vocab"])
    model = create_model("sman", **state["config"]["model_args"])
    model.load_state_dict(state["model"])
    fs = FeatureSet(features)
    test, _ = load_split(dataset / "manifest.jsonl", ["test"], vocab, fs)
    sims = similarity_matrix(model, test, ImageFeatures(fs, test.image_ids), "cpu", quiet=True)
    metrics = retrieval_metrics(sims, test.caption_image)
    chance = 100.0 / test.num_images
    assert metrics["t2i"]["r1"] > 5 * chance, metrics
    assert metrics["i2t"]["r1"] > 5 * chance, metrics
