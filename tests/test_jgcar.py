"""JGCAR: shapes and masking, every loss against its direct formula, pair/block scoring, two-step retrieval."""
from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from retr.store.labels import read_label_file
from retr.trainers.models.losses import hinge_triplet_loss
from retr.trainers.config import upgrade_stored
from retr.trainers.models import create_model, preset
from retr.trainers.models.jgcar import JGCAR, JGCARConfig, decorrelation_loss, intra_modal_triplet
from retr.trainers.models.side_inputs import caption_concepts, labels_to_multihot
from retr.trainers.evaluation.two_step import rerank_matrices


def small_model(**overrides) -> JGCAR:
    args = dict(vocab_size=30, img_dim=8, embed_size=6, word_dim=5, hidden_size=7, num_regions=9, max_words=8,
                dropout=0.0, num_negatives=3)
    args.update(overrides)
    torch.manual_seed(0)
    model = create_model("jgcar", **args)
    with torch.no_grad():   # non-zero position biases, so the masking tests see them
        model.coattn.b_v.normal_()
        model.coattn.b_s.normal_()
    return model.double().eval()


def batch(b=5, n=9, dim=8, max_len=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(b, n, dim, generator=g, dtype=torch.float64)
    lengths = torch.randint(2, max_len + 1, (b,), generator=g)
    tokens = torch.randint(4, 30, (b, max_len), generator=g)
    for k in range(b):
        tokens[k, lengths[k]:] = 0
    return features, torch.ones(b, n, dtype=torch.bool), tokens, lengths


def test_registry_and_presets():
    assert preset("jgcar", "coco")["max_words"] == 20 and preset("jgcar", "f30k")["max_words"] == 15
    p = preset("jgcar")
    assert (p["embed_size"], p["batch_size"], p["gamma"], p["num_negatives"], p["beta"]) == (256, 200, 10.0, 30, 0.5)
    # §3.1: lr 4e-4, momentum 0.99, weight decay 1e-8, ≤ 128 epochs, early stop 5, 512-d words and hidden layers,
    # dropout 0.5, top-100 candidates; λ2 = λ3 = λ4 = 1 (§2.2)
    assert (p["lr"], p["momentum"], p["weight_decay"], p["epochs"], p["early_stop"]) == (4e-4, 0.99, 1e-8, 128, 5)
    assert (p["word_dim"], p["hidden_size"], p["dropout"], p["shortlist"]) == (512, 512, 0.5, 100)
    assert (p["lambda2"], p["lambda3"], p["lambda4"], p["lr_update"]) == (1.0, 1.0, 1.0, 128)
    assert p["negative_mining"] == "similar" and p["optimizer"] == "paper"


def test_runs_written_before_the_mining_default_keep_dissimilar():
    from retr.trainers.models import get_spec
    spec = get_spec("jgcar")
    stored = upgrade_stored(spec, {"model": "jgcar", "model_args": {"gamma": 10.0, "labels": "l.json"}})
    args, inputs = stored["model_args"], stored["inputs"]
    assert args["negative_mining"] == "dissimilar" and inputs == {"labels": "l.json"} and "labels" not in args
    assert upgrade_stored(spec, {"model": "jgcar", "model_args": {"negative_mining": "similar"}})["model_args"][
        "negative_mining"] == "similar"


def test_default_mining_takes_the_most_similar_negatives():
    from retr.trainers.models.jgcar import mine_negatives
    sims = torch.tensor([[9.0, 1.0, 5.0, 3.0, 7.0]])
    valid = torch.tensor([[False, True, True, True, True]])
    mode = small_model().negative_mining
    assert mode == "similar"
    assert sorted(mine_negatives(sims, valid, 2, mode)[0].tolist()[0]) == [2, 4]
    assert sorted(mine_negatives(sims, valid, 2, "dissimilar")[0].tolist()[0]) == [1, 3]


def test_shapes():
    model = small_model()
    features, mask, tokens, lengths = batch()
    images, captions = model.encode_images(features, mask), model.encode_captions(tokens, lengths)
    assert images["regions"].shape == (5, 9, 6) and images["global"].shape == (5, 6)
    assert captions["words"].shape == (5, int(lengths.max()), 6) and captions["global"].shape == (5, 6)
    assert model.score(images, captions).shape == (5, 5)
    assert model.global_score(images, captions).shape == (5, 5)
    # padding positions of S^s are exactly zero
    assert torch.all(captions["words"][~captions["mask"]] == 0)


def test_padded_caption_scores_like_unpadded():
    model = small_model()
    features, mask, tokens, lengths = batch()
    images = model.encode_images(features, mask)
    short = torch.tensor([[1, 7, 9, 2]])
    alone = model.encode_captions(short, torch.tensor([4]))
    padded_tokens = torch.tensor([[1, 7, 9, 2, 0, 0, 0], [1, 5, 6, 7, 8, 9, 2]])
    padded_tokens_other = padded_tokens.clone()
    padded_tokens_other[0, 4:] = 13                    # whatever sits after the length must not matter
    for toks in (padded_tokens, padded_tokens_other):
        together = model.encode_captions(toks, torch.tensor([4, 7]))
        torch.testing.assert_close(model.score(images, together)[:, :1], model.score(images, alone))
        torch.testing.assert_close(model.global_score(images, together)[:, :1], model.global_score(images, alone))


def test_masked_regions_do_not_matter():
    model = small_model(position_bias=False)
    features, mask, tokens, lengths = batch()
    captions = model.encode_captions(tokens, lengths)
    mask[:, 6:] = False
    a = model.score(model.encode_images(features, mask), captions)
    features[:, 6:] = 100.0
    b = model.score(model.encode_images(features, mask), captions)
    torch.testing.assert_close(a, b)


def direct_coattention(model: JGCAR, v: torch.Tensor, s: torch.Tensor) -> float:
    """Eq. 11–15 for one pair as printed (A formed explicitly), ``v`` [N, d], ``s`` [T, d] real positions only."""
    c = model.coattn
    a = s @ c.W_b.weight @ v.t()                                                     # [T, N]
    hv = torch.tanh(v @ c.W_v.weight.t() + c.b_v[:v.shape[0]]) * torch.tanh(a.t() @ s @ c.W_s.weight.t())
    hs = torch.tanh(s @ c.W_s.weight.t() + c.b_s[:s.shape[0]]) * torch.tanh(a @ v @ c.W_v.weight.t())
    av = torch.softmax(hv @ c.w_hv.weight.view(-1), 0)
    as_ = torch.softmax(hs @ c.w_hs.weight.view(-1), 0)
    vb, sb = av @ v, as_ @ s
    return float((vb @ sb / (vb.norm() * sb.norm())).detach())


def test_coattention_matches_direct_equations():
    model = small_model()
    features, mask, tokens, lengths = batch()
    images, captions = model.encode_images(features, mask), model.encode_captions(tokens, lengths)
    scores = model.score(images, captions)
    for i in range(5):
        for j in range(5):
            s = captions["words"][j, :int(lengths[j])]
            assert scores[i, j].item() == pytest.approx(direct_coattention(model, images["regions"][i], s), abs=1e-10)


def test_blockwise_equals_pairs_one_by_one_and_pair_score():
    model = small_model(pair_chunk=4)
    features, mask, tokens, lengths = batch(b=6)
    images, captions = model.encode_images(features, mask), model.encode_captions(tokens, lengths)
    block = model.score(images, captions)
    one = torch.tensor([[model.score({k: v[i:i + 1] for k, v in images.items()},
                                     {k: v[j:j + 1, :int(lengths[j])] for k, v in captions.items()}).item()
                         for j in range(6)] for i in range(6)], dtype=torch.float64)
    torch.testing.assert_close(block, one)
    ii = torch.tensor([5, 0, 3, 3, 1, 2, 4])
    cc = torch.tensor([1, 0, 5, 2, 2, 4, 0])
    torch.testing.assert_close(model.pair_score(images, captions, ii, cc, image_block=2), block[ii, cc])


def test_global_losses_against_direct_formulas():
    g = torch.Generator().manual_seed(1)
    b = 6
    omega = torch.randn(b, b, generator=g, dtype=torch.float64)
    image_index = torch.tensor([0, 0, 1, 2, 3, 3])
    same = image_index.view(-1, 1) == image_index.view(1, -1)
    m = 0.3
    direct = 0.0
    for i in range(b):
        for j in range(b):
            if not same[i, j]:
                direct += max(0.0, m - omega[i, i] + omega[i, j])   # Eq. 6, caption j negative of image i
                direct += max(0.0, m - omega[j, j] + omega[i, j])   # image i negative of caption j
    assert hinge_triplet_loss(omega, m, max_violation=False, positives=same).item() == pytest.approx(float(direct))

    sims = torch.randn(b, b, generator=g, dtype=torch.float64)
    labels = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 1], [1, 0, 1], [0, 0, 1]], dtype=torch.bool)
    pos = (labels.float() @ labels.float().t() > 0) | same
    neg = ~pos
    for reduction in ("sum", "mean_positive"):
        direct = 0.0
        for k in range(b):
            ps = [p for p in range(b) if p != k and pos[k, p]]
            for n in range(b):
                if n == k or not neg[k, n]:
                    continue
                costs = [max(0.0, m - float(sims[k, p]) + float(sims[k, n])) for p in ps]
                if costs:
                    direct += sum(costs) if reduction == "sum" else sum(costs) / len(costs)
        got = intra_modal_triplet(sims, pos, neg, m, reduction).item()
        assert got == pytest.approx(direct), reduction


def test_decorrelation_against_eq9():
    g = torch.Generator().manual_seed(2)
    b, k, d = 4, 3, 5
    x = torch.randn(b, k, d, generator=g, dtype=torch.float64)
    mask = torch.ones(b, k, dtype=torch.bool)
    mu = x.mean(0)                                                               # [K, d]
    c = torch.zeros(d, d, dtype=torch.float64)
    for d1 in range(d):
        for d2 in range(d):
            c[d1, d2] = sum(float((x[kk, :, d1] - mu[:, d1]) @ (x[kk, :, d2] - mu[:, d2])) for kk in range(b)) / b
    direct = 0.5 * (float((c ** 2).sum()) - float((c.diagonal() ** 2).sum()))
    assert decorrelation_loss(x, mask).item() == pytest.approx(direct)
    # text: the mean at a word position is over the captions that have a word there
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    c = torch.zeros(d, d, dtype=torch.float64)
    for n in range(k):
        rows = [kk for kk in range(b) if mask[kk, n]]
        mu_n = x[rows, n].mean(0)
        for kk in rows:
            c += torch.outer(x[kk, n] - mu_n, x[kk, n] - mu_n) / b
    direct = 0.5 * (float((c ** 2).sum()) - float((c.diagonal() ** 2).sum()))
    assert decorrelation_loss(x, mask).item() == pytest.approx(direct)


@pytest.mark.parametrize("mining", ["dissimilar", "similar"])
def test_bi_rank_loss_against_eq16(mining):
    b, m_neg, gamma = 6, 2, 10.0
    model = small_model(num_negatives=m_neg, gamma=gamma, negative_mining=mining)
    g = torch.Generator().manual_seed(3)
    table = torch.rand(b, b, generator=g, dtype=torch.float64) * 2 - 1          # α(image, caption)
    model.coattn.block_scores = lambda img, cap, chunk=0, recompute=False: table
    omega = torch.randn(b, b, generator=g, dtype=torch.float64)
    isims = torch.randn(b, b, generator=g, dtype=torch.float64)
    csims = torch.randn(b, b, generator=g, dtype=torch.float64)
    image_index = torch.tensor([0, 1, 1, 2, 3, 4])
    same = image_index.view(-1, 1) == image_index.view(1, -1)
    dummy = {"regions": torch.zeros(b, 9, 6, dtype=torch.float64), "mask": torch.ones(b, 9, dtype=torch.bool)}
    dummy_c = {"words": torch.zeros(b, 3, 6, dtype=torch.float64), "mask": torch.ones(b, 3, dtype=torch.bool)}
    got = model.bi_rank(dummy, dummy_c, omega, isims, csims, same).item()

    def pick(scores, k):
        cands = [j for j in range(b) if not same[k, j]]
        cands.sort(key=lambda j: float(scores[j]), reverse=(mining == "similar"))
        return cands[:m_neg]

    def p(pos, negs):
        den = math.exp(gamma * pos) + sum(math.exp(gamma * x) for x in negs)
        return math.exp(gamma * pos) / den
    direct = 0.0
    for k in range(b):
        pos = float(table[k, k])
        s_neg, v_neg = pick(omega[k], k), pick(isims[k], k)                        # image anchor k
        direct += 2 - p(pos, [float(table[k, j]) for j in s_neg]) - p(pos, [float(table[i, k]) for i in v_neg])
        v_neg, s_neg = pick(omega[:, k], k), pick(csims[k], k)                     # caption anchor k
        direct += 2 - p(pos, [float(table[i, k]) for i in v_neg]) - p(pos, [float(table[k, j]) for j in s_neg])
    assert got == pytest.approx(direct)


def test_joint_loss_is_beta_mix_and_trains():
    model = small_model(num_negatives=2).train()
    features, mask, tokens, lengths = batch(b=6)
    index = torch.tensor([0, 0, 1, 2, 3, 4])
    images, captions = model.encode_images(features, mask), model.encode_captions(tokens, lengths)
    terms: dict = {}
    loss = model.joint_loss(images, captions, index, terms=terms)
    j_g = terms["j1"] + terms["j2"] + terms["j3"] + terms["j4"]
    assert terms["j_g"] == pytest.approx(j_g)
    assert loss.item() == pytest.approx(0.5 * j_g + 0.5 * terms["j_c"])
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith(("coattn.W", "img_enc", "txt_enc.lstm")))
    # forward (what the loop calls) gives the same loss
    assert model(features, mask, tokens, lengths, image_index=index).item() == pytest.approx(loss.item())


def test_two_step_with_full_shortlist_equals_full_rerank():
    model = small_model()
    features, mask, tokens, lengths = batch(b=7)
    images, captions = model.encode_images(features, mask), model.encode_captions(tokens, lengths)
    full = model.score(images, captions)
    g = model.global_score(images, captions)
    i2t, t2i = rerank_matrices(g, lambda ii, cc: model.pair_score(images, captions, ii, cc), shortlist=100)
    torch.testing.assert_close(i2t, full)
    torch.testing.assert_close(t2i, full)


def test_two_step_shortlist_placement():
    g = torch.tensor([[0.9, 0.1, 0.5, 0.3], [0.2, 0.8, 0.7, 0.1], [0.4, 0.6, 0.0, 0.95]], dtype=torch.float64)
    alpha = torch.tensor([[-0.5, 0.2, 0.9, 0.1], [0.3, -0.9, 0.4, 0.0], [0.6, 0.7, 0.8, -1.0]], dtype=torch.float64)
    i2t, t2i = rerank_matrices(g, lambda ii, cc: alpha[ii, cc], shortlist=2)
    for row in range(3):
        top = set(g[row].topk(2).indices.tolist())
        for col in range(4):
            if col in top:
                assert i2t[row, col] == alpha[row, col]
            else:
                assert i2t[row, col] < alpha.min()
        rest = [c for c in range(4) if c not in top]
        order = sorted(rest, key=lambda c: -float(g[row, c]))
        assert sorted(rest, key=lambda c: -float(i2t[row, c])) == order
    for col in range(4):
        top = set(g[:, col].topk(2).indices.tolist())
        for row in range(3):
            assert (t2i[row, col] == alpha[row, col]) == (row in top)


def test_same_image_pairs_per_batch_is_the_exact_expectation():
    import itertools
    from retr.trainers.models.side_inputs import same_image_pairs_per_batch
    owner = np.array([0, 0, 0, 1, 1, 2, 3])
    subsets = list(itertools.combinations(range(7), 3))
    brute = np.mean([sum(owner[a] == owner[b] for a, b in itertools.combinations(c, 2)) for c in subsets])
    assert same_image_pairs_per_batch(owner, batch=3) == pytest.approx(brute)
    coco = np.repeat(np.arange(113_287), 5)                    # COCO train + restval, 5 captions per image
    assert same_image_pairs_per_batch(coco) == pytest.approx(0.14, abs=0.005)


def test_training_without_labels_notes_that_j3_is_nearly_inert(tmp_path):
    from retr.trainers.data.splits import SplitData
    from retr.trainers.models.side_inputs import load_jgcar_inputs
    data = SplitData(["a", "b"], ["a red circle", "the red circle", "a blue star", "one blue star"],
                     np.array([0, 0, 1, 1]), [[1, 4, 5, 2]] * 4)
    notes = load_jgcar_inputs(data, None).notes
    assert len(notes) == 1 and "\n" not in notes[0]
    assert "retr-pipeline labels coco" in notes[0] and "retr-pipeline labels f30k-entities" in notes[0]
    assert "--labels" in notes[0] and "J3" in notes[0]
    labels = tmp_path / "labels.json"
    labels.write_text('{"a": ["dog"], "b": []}')
    assert load_jgcar_inputs(data, str(labels)).notes == []


def test_labels_and_concepts(tmp_path):
    path = tmp_path / "labels.json"
    path.write_text('{"a": ["dog", "cat"], "b": ["cat"], "c": []}')
    assert read_label_file(path) == {"a": ["dog", "cat"], "b": ["cat"], "c": []}
    lines = tmp_path / "labels.jsonl"
    lines.write_text('{"id": "a", "labels": [3]}\n{"id": "b", "labels": [3, 5]}\n')
    assert read_label_file(lines) == {"a": ["3"], "b": ["3", "5"]}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\n')
    from retr.common.errors import UserError
    with pytest.raises(UserError, match="bad.jsonl:1"):
        read_label_file(bad)
    hot = labels_to_multihot([["dog", "cat"], ["cat"], []])
    assert hot.tolist() == [[True, True], [True, False], [False, False]]
    concepts = caption_concepts([[["a", "red", "circle", "left", "of", "a", "blue", "star"],
                                  ["the", "blue", "star", "right", "of", "red", "circle"],
                                  ["a", "big", "red", "circle"]]])
    assert concepts == [{"red", "circle", "blue", "star"}]


# ------------------------------------------------------------------------------------------------- learning

def write_scene_maps(folder, name: str = "scene-maps", seed: int = 0):
    """A ``maps`` feature set (196 × 512, the ``vgg16-maps`` shape) made from the synthetic ``scenes.jsonl``.

    Random-weight VGG-16 maps carry too little of the scene to learn from in a test, so each 16-px cell of the
    14×14 grid gets small noise plus, where an object covers the cell centre, the object's one-hot size (2),
    colour (6) and shape (5) in its first 13 channels: what and where, as a trained CNN's pool5 would show it.
    Written through the real store writer, so the trainer reads it like an extracted set.
    """
    import json

    from retr.manifests.synthetic import COLOURS, SHAPES, SIZES
    from retr.store.features import ShardWriter, shard_name, write_index
    grid, dim = 14, 512
    rng = np.random.default_rng(seed)
    scenes = [json.loads(line) for line in (folder / "scenes.jsonl").read_text().splitlines() if line.strip()]
    centres = (np.arange(grid) + 0.5) * 224 / grid
    cy, cx = np.meshgrid(centres, centres, indexing="ij")
    feats = 0.05 * rng.standard_normal((len(scenes), grid * grid, dim)).astype(np.float32)
    for i, scene in enumerate(scenes):
        for obj in scene["objects"]:
            code = np.zeros(dim, np.float32)
            code[SIZES.index(obj["size"])] = 1
            code[2 + list(COLOURS).index(obj["colour"])] = 1
            code[8 + SHAPES.index(obj["shape"])] = 1
            r = max(obj["radius"], 9)
            inside = ((cx - obj["centre"][0]) ** 2 + (cy - obj["centre"][1]) ** 2 <= r * r).reshape(-1)
            feats[i, inside] += code
    attrs = dict(kind="maps", extractor=name, backbone="scene-description", weights="random", image_size=224,
                 manifest_sha256="0" * 64)
    path = folder / name / shard_name(0, 1)
    with ShardWriter(path, attrs, (grid * grid, dim), shard_index=0, num_shards=1) as writer:
        writer.append([s["id"] for s in scenes], feats)
    return write_index(folder / f"{name}.h5", [path])


@pytest.mark.slow
def test_jgcar_learns_on_synthetic_maps(tmp_path, caplog):
    """Through the shared loop: a short run reaches a two-step test R@1 many times chance, both directions."""
    from retr.manifests.synthetic import generate_synthetic
    from retr.store.features import FeatureSet
    from retr.trainers.runs import checkpoint as ckpt
    from retr.trainers.data.splits import ImageFeatures, load_split
    from retr.trainers.training.loop import TrainConfig, train
    from retr.trainers.evaluation.two_step import two_step_split

    generate_synthetic(tmp_path / "synth", 200, 0)
    features = write_scene_maps(tmp_path / "synth")
    manifest = tmp_path / "synth" / "manifest.jsonl"
    # small sizes for CPU; cosine global scores (an option) start learning sooner than the printed dot product
    args = JGCARConfig(embed_size=32, word_dim=32, hidden_size=16, dropout=0.0, num_negatives=6, shortlist=10,
                       global_similarity="cosine", optimizer="adam")
    cfg = TrainConfig(model="jgcar", model_config=args, features=str(features), manifest=str(manifest),
                      out=str(tmp_path / "run"), epochs=4, batch_size=32, lr=2e-3, lr_update=100, grad_clip=2.0,
                      device="cpu", train_splits=["train"], seed=0)
    with caplog.at_level(logging.INFO, logger="retr"):
        train(cfg, quiet=True)
    assert sum(m.startswith("note: no --labels") for m in caplog.messages) == 1   # no label file: said at start
    # config.json holds the full config, settings not given included, so later default changes keep their meaning
    stored = json.loads((tmp_path / "run" / "config.json").read_text())["model_args"]
    assert stored["negative_mining"] == "similar" and stored["gamma"] == 10.0
    assert ckpt.read_config(tmp_path / "run")["model_args"]["negative_mining"] == "similar"
    model, vocab, _ = ckpt.load_run_model(str(tmp_path / "run"), "best", torch.device("cpu"))
    fs = FeatureSet(features)
    data, _ = load_split(manifest, ["test"], vocab, fs)
    result = two_step_split(model, data, ImageFeatures(fs, data.image_ids), "cpu", shortlist=10, full=True)
    chance_i2t = 100.0 * 5 / data.num_captions      # a true caption first among the test captions
    chance_t2i = 100.0 / data.num_images
    two = result["two_step"]
    assert two["i2t"]["r1"] >= 4 * chance_i2t and two["t2i"]["r1"] >= 4 * chance_t2i, two
    assert result["pairs_scored"]["two_step"] < result["pairs_scored"]["full"]


def test_ddp_gradients_sum_to_the_single_process_ones():
    """Two simulated DDP ranks: each encodes its half, the gather puts the other half (no gradient) around it,
    every rank scores the gathered batch. The summed rank gradients must equal the single-process gradient —
    including the co-attention weights used only after the gather (scaled by 1/world size)."""
    from tests.ddp_simulation import Gather

    model = small_model(num_negatives=2).train()
    features, mask, tokens, lengths = batch(b=6)
    index = torch.tensor([0, 0, 1, 2, 3, 4])

    def grads():
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    model(features, mask, tokens, lengths, image_index=index).backward()
    single = grads()
    parts = [slice(0, 3), slice(3, 6)]
    total: dict = {}
    for rank, part in enumerate(parts):
        other = parts[1 - rank]
        with torch.no_grad():
            remote = {"regions": model.encode_images(features[other], mask[other]),
                      "words": model.encode_captions(tokens[other], lengths[other]),
                      "image_index": {"image_index": index[other]}}

        def join(local, rank=rank, remote=remote):
            kind = next(k for k in ("regions", "words", "image_index") if k in local)
            far = remote[kind]
            return {k: torch.cat([local[k], far[k]] if rank == 0 else [far[k], local[k]]) for k in local}

        gather = Gather(join)

        model.zero_grad()
        model(features[part], mask[part], tokens[part], lengths[part], gather=gather,
              image_index=index[part]).backward()
        for name, g in grads().items():
            total[name] = total.get(name, 0) + g
    assert set(total) == set(single)
    for name in single:
        torch.testing.assert_close(total[name], single[name], rtol=1e-7, atol=1e-9, msg=name)


@pytest.mark.parametrize("budget", [None, 2 * 3 * 4 * 5])
def test_tanh_contraction_gradients_equal_autograd_of_the_direct_formula(monkeypatch, budget):
    """The co-attention logits' hand-written backward (recomputing tanh chunk by chunk) against autograd of the
    formula, in float64 where both are exact to rounding (1e-10 is far above float64 rounding of these sums);
    with a budget of two rows a chunk, the chunks' partial gradients of ``b`` add up."""
    import retr.trainers.models.jgcar as jgcar
    if budget is not None:
        monkeypatch.setattr(jgcar, "CPU_CHUNK_ELEMENTS", budget)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 3, 6, dtype=torch.float64, generator=g, requires_grad=True)    # [P, M, d]
    b = torch.randn(4, 6, 5, dtype=torch.float64, generator=g, requires_grad=True)    # [C, d, l]
    w = torch.randn(5, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)    # [P, M, l]
    direct = (torch.tanh(torch.einsum("pmd,cdl->pmcl", a, b)) * w.unsqueeze(2)).sum(-1)
    got = jgcar.TanhContraction.apply(a, b, w)
    torch.testing.assert_close(got, direct, rtol=1e-12, atol=1e-12)
    upstream = torch.randn(5, 3, 4, dtype=torch.float64, generator=g)
    want = torch.autograd.grad(direct, (a, b, w), upstream)
    have = torch.autograd.grad(got, (a, b, w), upstream)
    for x, y in zip(have, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(jgcar.TanhContraction.apply, (a, b, w))


def test_tanh_contraction_backward_runs_under_forwards_autocast():
    """With ``--amp bf16`` the forward's logits are bfloat16: backward recomputes under the same autocast (else its
    bfloat16 gradient meets float32 tensors and fails), and the gradients are float32's to bfloat16 rounding
    (8 mantissa bits: 5e-2 relative over these 6-term sums)."""
    from retr.trainers.models.jgcar import TanhContraction
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(4, 3, 8, generator=g), torch.randn(5, 8, 6, generator=g), torch.randn(4, 3, 6, generator=g)]
    grads = {}
    for amp in (False, True):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = TanhContraction.apply(*leaves)
        assert out.dtype == (torch.bfloat16 if amp else torch.float32)
        out.float().sum().backward()
        grads[amp] = [x.grad for x in leaves]
    for low, full in zip(grads[True], grads[False]):
        assert low.dtype == torch.float32
        torch.testing.assert_close(low, full, rtol=5e-2, atol=5e-2)
    empty = TanhContraction.apply(torch.zeros(0, 3, 8), inputs[1], torch.zeros(0, 3, 6))
    assert empty.shape == (0, 3, 5)
