"""SMFEA: the 7-node tree-LSTM, node losses against their formulas, the concept branch, evaluation independence."""
from __future__ import annotations

import json
import math

import numpy as np

import pytest
import torch
import torch.nn.functional as F

from retr.trainers.models import create_model, preset
from retr.trainers.models.concepts import ConceptGCN, consensus_vector, mix_text_labels
from retr.trainers.models.smfea import SMFEA, node_cross_entropy, node_kl
from retr.trainers.models.layers import l2norm
from retr.trainers.models.tree_lstm import CHILDREN, SevenNodeTreeLSTM, StructuredTreeEncoder


def _descendants(t: int) -> set[int]:
    out = {t}
    for k in CHILDREN[t]:
        out |= _descendants(k)
    return out


@pytest.mark.parametrize("forget_gate", ["as-printed", "per-child"])
def test_tree_lstm_shapes_and_dependencies(forget_gate):
    torch.manual_seed(0)
    lstm = SevenNodeTreeLSTM(input_dim=5, hidden_size=6, forget_gate=forget_gate)
    x = torch.randn(3, 7, 5, requires_grad=True)
    h, c = lstm(x)
    assert h.shape == (3, 7, 6) and c.shape == (3, 7, 6)
    for t in range(7):
        grad, = torch.autograd.grad(h[:, t].sum(), x, retain_graph=True)
        depends = {s for s in range(7) if grad[:, s].abs().sum() > 0}
        assert depends == _descendants(t), (t, depends)
    # the parents' children: R2 ← E1, E3; R6 ← E5, E7; R4 ← R2, R6; leaves none
    assert CHILDREN == {0: (), 2: (), 4: (), 6: (), 1: (0, 2), 5: (4, 6), 3: (1, 5)}


def test_tree_lstm_node_update_is_eq_6_to_11():
    torch.manual_seed(1)
    lstm = SevenNodeTreeLSTM(input_dim=4, hidden_size=3, forget_gate="as-printed")
    x = torch.randn(2, 7, 4)
    h, c = lstm(x)
    W, b, U = lstm.W.weight, lstm.W.bias, lstm.U.weight
    H = 3

    def gates(t, h_sum):
        z = x[:, t] @ W.t() + b + h_sum @ U.t()
        return (torch.sigmoid(z[:, :H]), torch.sigmoid(z[:, H:2 * H]), torch.sigmoid(z[:, 2 * H:3 * H]),
                torch.tanh(z[:, 3 * H:]))

    f = {}
    for leaf in (0, 2):
        i, f[leaf], o, u = gates(leaf, torch.zeros(2, H))
        torch.testing.assert_close(c[:, leaf], i * u)
        torch.testing.assert_close(h[:, leaf], o * torch.tanh(i * u))
    i, f_t, o, u = gates(1, h[:, 0] + h[:, 2])
    c_parent = i * u + f_t * (f[0] * c[:, 0] + f[2] * c[:, 2])
    torch.testing.assert_close(c[:, 1], c_parent)
    torch.testing.assert_close(h[:, 1], o * torch.tanh(c_parent))


def test_tree_encoder_outputs():
    enc = StructuredTreeEncoder(embed_size=8, num_entities=11, num_relations=5, hidden_size=4)
    out = enc(torch.randn(3, 8))
    assert out["entity_logits"].shape == (3, 4, 11) and out["relation_logits"].shape == (3, 3, 5)
    assert out["hidden"].shape == (3, 7, 4)
    torch.testing.assert_close(out["tree"].norm(dim=-1), torch.ones(3))


def test_node_cross_entropy_direct_formula():
    torch.manual_seed(2)
    ent, rel = torch.randn(2, 4, 6), torch.randn(2, 3, 5)
    nodes = torch.tensor([[1, 0, 2, 3, 5, 4, 0], [0, 1, 0, 2, 1, 0, 4]])
    expected = torch.zeros(2)
    for b in range(2):
        for j, slot in enumerate((0, 2, 4, 6)):
            expected[b] -= torch.log(torch.softmax(ent[b, j], -1)[nodes[b, slot]])
        for j, slot in enumerate((1, 3, 5)):
            expected[b] -= torch.log(torch.softmax(rel[b, j], -1)[nodes[b, slot]])
    torch.testing.assert_close(node_cross_entropy(ent, rel, nodes), expected)


def test_node_kl_direct_formula():
    torch.manual_seed(3)
    img = {"entity_logits": torch.randn(2, 4, 6), "relation_logits": torch.randn(2, 3, 5)}
    txt = {"entity_logits": torch.randn(2, 4, 6), "relation_logits": torch.randn(2, 3, 5)}
    expected = torch.zeros(2)
    for key in img:
        p, q = torch.softmax(img[key], -1), torch.softmax(txt[key], -1)
        expected += (p * torch.log(p / q)).sum(-1).sum(-1)
    torch.testing.assert_close(node_kl(img, txt), expected)
    assert torch.allclose(node_kl(img, img), torch.zeros(2), atol=1e-6)
    assert (node_kl(img, txt) > 0).all()


def _model(**kw) -> SMFEA:
    torch.manual_seed(4)
    args = dict(vocab_size=30, num_entities=9, num_relations=6, num_concepts=5, img_dim=12, embed_size=16,
                word_dim=8, tree_hidden=6, num_regions=5)
    args.update(kw)
    model = create_model("smfea", **args)
    token_concepts = torch.full((30,), -1, dtype=torch.long)
    token_concepts[10], token_concepts[11], token_concepts[12] = 0, 3, 3    # two forms of concept 3
    model.set_token_concepts(token_concepts)
    return model


def _batch(b=4, k=5, seed=5):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(b, k, 12, generator=g)
    mask = torch.ones(b, k, dtype=torch.bool)
    mask[0, 3:] = False
    tokens = torch.randint(4, 30, (b, 6), generator=g)
    lengths = torch.tensor([6, 4, 5, 3][:b])
    nodes = torch.stack([torch.randint(0, 9, (b,), generator=g) if s % 2 == 0
                         else torch.randint(0, 6, (b,), generator=g) for s in range(7)], dim=1)
    return features, mask, tokens, lengths, nodes


EQ20_AS_PRINTED = dict(fused_rank_weight=1.0, instance_rank_weight=0.0, concept_rank_weight=0.0,
                       concept_kl_weight=0.0)


def test_loss_is_eq_20_and_ablations_drop_terms():
    features, mask, tokens, lengths, nodes = _batch()
    model = _model(**EQ20_AS_PRINTED).train()
    images = model.encode_images(features, mask)
    captions = model.encode_captions(tokens, lengths)
    scores = model.score(images, captions)
    terms = model.loss_terms(scores, images, captions, nodes)
    from retr.trainers.models.losses import hinge_triplet_loss
    torch.testing.assert_close(terms["rank"], hinge_triplet_loss(scores, 0.2, True))
    ce = (node_cross_entropy(images["entity_logits"], images["relation_logits"], nodes)
          + node_cross_entropy(captions["entity_logits"], captions["relation_logits"], nodes))
    torch.testing.assert_close(terms["node_ce"], ce.mean())
    torch.testing.assert_close(terms["node_kl"], node_kl(images, captions).mean())
    torch.testing.assert_close(model.loss(scores, images, captions, nodes), sum(terms.values()))
    assert set(_model(kl_weight=0, **EQ20_AS_PRINTED).loss_terms(scores, images, captions, nodes)) == {"rank", "node_ce"}
    assert set(_model(ce_weight=0, **EQ20_AS_PRINTED).loss_terms(scores, images, captions, nodes)) == {"rank", "node_kl"}
    summed = _model(tree_loss_reduction="sum", **EQ20_AS_PRINTED).loss_terms(scores, images, captions, nodes)
    torch.testing.assert_close(summed["node_ce"], ce.sum())
    torch.testing.assert_close(summed["node_kl"], node_kl(images, captions).sum())
    no_trees = _model(use_trees=False).train()
    out = no_trees.encode_images(features, mask)
    assert "tree" not in out and "entity_logits" not in out
    torch.testing.assert_close(out["fused"], F.normalize(0.6 * out["instance"] + 0.2 * out["concept"], dim=-1))


def test_default_objective_adds_cvse_terms():
    """3·Rank(fused) + 5·Rank(instance) + 1·Rank(concept) + 2·KL(w_t ‖ w_v), plus the tree terms."""
    from retr.trainers.models.losses import hinge_triplet_loss

    features, mask, tokens, lengths, nodes = _batch()
    model = _model().train()
    images = model.encode_images(features, mask)
    captions = model.encode_captions(tokens, lengths)
    scores = model.score(images, captions)
    terms = model.loss_terms(scores, images, captions, nodes)
    torch.testing.assert_close(terms["rank"], 3 * hinge_triplet_loss(scores, 0.2, True))
    torch.testing.assert_close(terms["rank_instance"],
                               5 * hinge_triplet_loss(images["instance"] @ captions["instance"].t(), 0.2, True))
    torch.testing.assert_close(terms["rank_concept"],
                               hinge_triplet_loss(images["concept"] @ captions["concept"].t(), 0.2, True))
    w_v, w_t = images["concept_weights"], captions["concept_weights"]
    # CVSE's KL_loss_softmax: KLDivLoss(reduce=False)(log w_v, w_t).sum() — KL(w_t ‖ w_v) summed over the batch
    torch.testing.assert_close(terms["concept_kl"], 2 * F.kl_div(w_v.log(), w_t, reduction="sum"))
    torch.testing.assert_close(terms["concept_kl"], 2 * (w_t * (w_t.log() - w_v.log())).sum())
    assert {"node_ce", "node_kl"} <= set(terms)
    mean = _model(concept_kl_reduction="mean").loss_terms(scores, images, captions, nodes)
    torch.testing.assert_close(mean["concept_kl"], 2 * (w_t * (w_t.log() - w_v.log())).sum(-1).mean())
    assert not torch.allclose(mean["concept_kl"], terms["concept_kl"])
    # gradients reach both concept distributions (CVSE's kl_div differentiates its target too)
    w_v, w_t = w_v.detach().requires_grad_(), w_t.detach().requires_grad_()
    model.loss_terms(scores, dict(images, concept_weights=w_v), dict(captions, concept_weights=w_t),
                     nodes)["concept_kl"].backward()
    assert w_v.grad.abs().sum() > 0 and w_t.grad.abs().sum() > 0


def test_text_query_norm_and_tree_residual_change_the_embeddings():
    features, mask, tokens, lengths, _ = _batch()
    normed, raw = _model().eval(), _model(text_query_l2norm=False).eval()
    raw.load_state_dict(normed.state_dict())
    with torch.no_grad():
        a, b = normed.encode_captions(tokens, lengths), raw.encode_captions(tokens, lengths)
    assert not torch.allclose(a["instance"], b["instance"])
    torch.testing.assert_close(normed.encode_images(features, mask)["instance"],
                               raw.encode_images(features, mask)["instance"])   # the image side has no such norm
    assert normed.img_tree.residual is True and _model(tree_residual=False).img_tree.residual is False


def test_fusion_is_eq_15_and_score_is_cosine():
    features, mask, tokens, lengths, _ = _batch()
    model = _model(beta_d=0.5, beta_t=0.3, beta_c=0.2).eval()
    img = model.encode_images(features, mask)
    fused = 0.5 * img["instance"] + 0.3 * img["tree"] + 0.2 * img["concept"]
    torch.testing.assert_close(img["fused"], F.normalize(fused, dim=-1))
    cap = model.encode_captions(tokens, lengths)
    torch.testing.assert_close(model.score(img, cap), F.normalize(fused, dim=-1) @ cap["fused"].t())
    assert "entity_logits" not in img            # evaluation never carries node logits around


def test_forward_backward_reaches_every_branch():
    features, mask, tokens, lengths, nodes = _batch()
    model = _model().train()
    labels = torch.randint(0, 2, (4, 5))
    model(features, mask, tokens, lengths, nodes=nodes, image_concept_labels=labels).backward()
    for name in ("img_enc.fc.weight", "img_tree.lstm.W.weight", "txt_tree.entity_classifier.weight",
                 "gcn.vectors", "gcn.weight2", "img_concept_attn.fc_score.weight", "txt_attn.fc_score.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_caption_labels_come_from_its_own_tokens():
    model = _model()
    tokens = torch.tensor([[1, 10, 5, 12, 2, 0], [1, 11, 2, 10, 0, 0]])   # second: token 10 is padding
    lengths = torch.tensor([5, 3])
    labels = model.caption_concept_labels(tokens, lengths)
    assert labels.tolist() == [[1, 0, 0, 1, 0], [0, 0, 0, 1, 0]]


def test_evaluation_score_of_a_caption_ignores_other_captions_of_its_image():
    features, mask, tokens, lengths, _ = _batch()
    model = _model().eval()
    with torch.no_grad():
        # train a few BN statistics so eval-mode normalisation is not the identity
        model.train()
        model.encode_images(features, mask), model.encode_captions(tokens, lengths)
        model.eval()
        image = model.encode_images(features[:1], mask[:1])
        alone = model.score(image, model.encode_captions(tokens[:1], lengths[:1]))
        # the same caption next to the other captions "of its image" (any other captions), in any order
        order = torch.tensor([2, 0, 3, 1])
        block = model.encode_captions(tokens[order], lengths[order])
        together = model.score(image, block)[:, 1:2]
    torch.testing.assert_close(alone, together)


def test_padding_is_masked_on_both_sides():
    features, mask, tokens, lengths, _ = _batch()
    model = _model().eval()
    with torch.no_grad():
        changed = features.clone()
        changed[0, 3:] = 100.0                       # padded regions of image 0
        torch.testing.assert_close(model.encode_images(features, mask)["fused"],
                                   model.encode_images(changed, mask)["fused"])
        padded = torch.cat([tokens, torch.randint(4, 30, (4, 3))], dim=1)
        torch.testing.assert_close(model.encode_captions(tokens, lengths)["fused"],
                                   model.encode_captions(padded, lengths)["fused"])


def test_concept_gcn_and_mixing():
    gcn = ConceptGCN(num_concepts=3, word_dim=4, hidden_dim=5, embed_size=6, concept_vectors="fixed")
    adjacency = torch.tensor([[0.7, 0.2, 0.0], [0.2, 0.7, 0.0], [0.1, 0.1, 1.0]])
    vectors = torch.randn(3, 4)
    gcn.set_graph(adjacency, vectors)
    assert "vectors" not in dict(gcn.named_parameters())           # fixed vectors are a buffer
    expected = adjacency @ (F.leaky_relu(adjacency @ (vectors @ gcn.weight1), 0.2) @ gcn.weight2)
    torch.testing.assert_close(gcn(), F.normalize(expected, dim=-1))
    w = torch.tensor([[0.2, 0.3, 0.5]])
    y = torch.tensor([[1.0, 0.0, 0.0]])
    soft = torch.tensor([math.exp(10), 1.0, 1.0]) / (math.exp(10) + 2)
    torch.testing.assert_close(mix_text_labels(w, y, 0.35), 0.35 * soft.unsqueeze(0) + 0.65 * w)
    concepts = torch.randn(3, 6)
    torch.testing.assert_close(consensus_vector(w, concepts), F.normalize(w @ concepts, dim=-1))


def test_registry_and_presets():
    model = create_model("smfea", vocab_size=10, num_entities=5, num_relations=4, num_concepts=3, img_dim=8,
                         embed_size=8, word_dim=4, tree_hidden=4)
    assert isinstance(model, SMFEA)
    f30k, coco = preset("smfea", "f30k"), preset("smfea", "coco")
    assert (f30k["epochs"], f30k["lr"], f30k["lr_update"], f30k["margin"]) == (50, 2e-4, 25, 0.2)
    assert (f30k["beta_d"], f30k["beta_t"], f30k["beta_c"]) == (0.6, 0.2, 0.2)
    assert (f30k["label_ratio"], coco["label_ratio"]) == (0.35, 0.4)


# --------------------------------------------------------------------------------------------- end to end

def _prepare_synthetic(synthetic_data, tmp_path, images):
    """Synthetic scenes, scene-description region features (``tests/trainer_synthetic.py``: one region per
    object, noise regions, K = 4; the shared ``synthetic_data``), gold-parse referral trees and concepts (in
    ``tmp_path``) — through the real commands."""
    from trainer_synthetic import write_trees_and_concepts

    manifest, features = synthetic_data(images=images, seed=0)
    write_trees_and_concepts(manifest, tmp_path)
    return manifest, features


TINY = ["--embed-size", "64", "--word-dim", "32", "--tree-hidden", "16", "--batch-size", "50", "--lr", "2e-3",
        "--device", "cpu", "--quiet", "--val-images", "20", "--num-regions", "4"]


@pytest.mark.slow
def test_smfea_learns_the_synthetic_scenes_and_reports_node_accuracy(tmp_path, synthetic_data):
    from click.testing import CliRunner

    from retr.trainers.commands import cli as train_cli
    from retr.trainers.data.splits import ImageFeatures, load_split
    from retr.trainers.evaluation.metrics import retrieval_metrics
    from retr.trainers.evaluation.similarity import similarity_matrix
    from retr.store.features import FeatureSet
    from retr.trainers.runs import checkpoint as ckpt

    manifest, features = _prepare_synthetic(synthetic_data, tmp_path, images=200)
    run = tmp_path / "run"
    # 10 epochs: CVSE's regularisers (dropout 0.4, the batch-summed concept KL) slow the first epochs down, and the
    # trajectory depends on the thread count's rounding: measured t2i R@1 with 1, 2 and 4 threads, 8 epochs
    # 40 / 42 / 24 % (the last below the 25 % asserted), 10 epochs 81 / 44 / 42 % (chance 5 %)
    result = CliRunner().invoke(train_cli, ["smfea", "--features", str(features), "--manifest", str(manifest),
                                            "--trees", str(tmp_path / "trees.h5"), "--concepts",
                                            str(tmp_path / "concepts.h5"), "--out", str(run), "--epochs", "10",
                                            "--lr-update", "100", *TINY])
    assert result.exit_code == 0, result.output
    model, vocab, config = ckpt.load_run_model(run)
    assert config["model_args"]["num_concepts"] > 10 and config["model_args"]["num_entities"] > 10
    fs = FeatureSet(features)
    test, _ = load_split(manifest, ["test"], vocab, fs)
    metrics = retrieval_metrics(similarity_matrix(model, test, ImageFeatures(fs, test.image_ids), "cpu", quiet=True),
                                test.caption_image)
    chance = 100.0 / test.num_images
    assert metrics["i2t"]["r1"] > 5 * chance and metrics["t2i"]["r1"] > 5 * chance, metrics
    accuracy = json.loads((run / "tree_accuracy.json").read_text())
    print("SMFEA synthetic test:", json.dumps({"i2t": metrics["i2t"], "t2i": metrics["t2i"], "nodes": accuracy}))
    assert accuracy["split"] == "test" and accuracy["captions"] == test.num_captions
    # the trained trees against the same untrained network (random classifiers over the dictionaries)
    from retr.trainers.models import create_model
    from retr.trainers.evaluation.tree_accuracy import tree_node_accuracy
    torch.manual_seed(0)
    untrained = create_model("smfea", **config["model_args"]).eval()
    before = tree_node_accuracy(untrained, test, ImageFeatures(fs, test.image_ids), str(tmp_path / "trees.h5"))
    assert accuracy["text"]["all"] > before["text"]["all"] + 20, (accuracy, before)
    assert accuracy["image"]["all"] > before["image"]["all"] + 20, (accuracy, before)
    assert "tree-node accuracy on test" in result.output


@pytest.mark.slow
def test_smfea_ablation_without_trees_and_errors(tmp_path, synthetic_data):
    from click.testing import CliRunner

    from retr.trainers.commands import cli as train_cli

    manifest, features = _prepare_synthetic(synthetic_data, tmp_path, images=60)
    common = ["--features", str(features), "--manifest", str(manifest), "--concepts", str(tmp_path / "concepts.h5"),
              "--epochs", "1", *TINY]
    missing = CliRunner().invoke(train_cli, ["smfea", *common, "--out", str(tmp_path / "r0")])
    assert missing.exit_code != 0 and "--trees is required" in str(missing.exception)
    result = CliRunner().invoke(train_cli, ["smfea", *common, "--no-trees", "--out", str(tmp_path / "r1")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "r1" / "config.json").read_text())
    assert config["model_args"]["use_trees"] is False and not (tmp_path / "r1" / "tree_accuracy.json").exists()
    bad = CliRunner().invoke(train_cli, ["smfea", *common, "--trees", str(tmp_path / "trees.h5"),
                                         "--concept-vectors", str(tmp_path / "glove.txt"), "--out", str(tmp_path / "r2")])
    assert bad.exit_code != 0 and "GloVe" in str(bad.exception)


def test_token_concepts_agree_with_concepts_file(tmp_path, synthetic_data):
    """The labels a caption gets from its own tokens are the ones build-concepts wrote for it."""
    from retr.store.concepts import ConceptSet
    from retr.store.features import FeatureSet
    from retr.trainers.data.splits import load_split
    from retr.trainers.models.side_inputs import caption_keys, read_training_inputs
    from retr.store.vocab import Vocabulary
    from retr.manifests.schema import read_manifest

    manifest, features = _prepare_synthetic(synthetic_data, tmp_path, images=40)
    vocab = Vocabulary.build(c for r in read_manifest(manifest) for c in r.captions)
    data, _ = load_split(manifest, ["train", "val", "test"], vocab, FeatureSet(features))
    inputs = read_training_inputs(data, str(tmp_path / "trees.h5"), str(tmp_path / "concepts.h5"),
                                  vocab_size=len(vocab))
    concepts = ConceptSet(tmp_path / "concepts.h5")
    model = create_model("smfea", vocab_size=len(vocab), num_entities=5, num_relations=5, num_concepts=len(concepts),
                         img_dim=16, embed_size=8, word_dim=4, tree_hidden=4)
    model.set_token_concepts(inputs.token_concepts)
    from retr.trainers.data.splits import pad_tokens
    tokens, lengths = pad_tokens(data.tokens)
    from_tokens = model.caption_concept_labels(tokens, lengths).numpy()
    np.testing.assert_array_equal(from_tokens, concepts.labels_for_captions(caption_keys(data)))
    assert inputs.nodes.shape == (data.num_captions, 7) and (inputs.nodes >= 0).all()


@pytest.mark.slow
def test_smfea_with_glove_format_concept_vectors(tmp_path, synthetic_data):
    """--concept-vectors FILE: fixed vectors from the file (absent words start random), recorded in the run."""
    from click.testing import CliRunner

    from retr.store.concepts import ConceptSet
    from retr.trainers.runs import checkpoint as ckpt
    from retr.trainers.commands import cli as train_cli

    manifest, features = _prepare_synthetic(synthetic_data, tmp_path, images=60)
    concepts = ConceptSet(tmp_path / "concepts.h5").concepts
    glove = tmp_path / "glove.txt"
    glove.write_text("".join(f"{w} {i} 0.5 -1 2 {i / 10}\n" for i, w in enumerate(concepts[1:], start=1)),
                     encoding="utf-8")
    result = CliRunner().invoke(train_cli, ["smfea", "--features", str(features), "--manifest", str(manifest),
                                            "--trees", str(tmp_path / "trees.h5"), "--concepts",
                                            str(tmp_path / "concepts.h5"), "--concept-vectors", str(glove),
                                            "--out", str(tmp_path / "run"), "--epochs", "1", *TINY])
    assert result.exit_code == 0, result.output
    model, _, config = ckpt.load_run_model(tmp_path / "run")
    assert config["model_args"]["concept_vectors"] == "fixed" and config["model_args"]["concept_word_dim"] == 5
    assert config["inputs"]["concept_vectors"] == str(glove)
    assert "gcn.vectors" not in dict(model.named_parameters())          # fixed, as CVSE's GloVe input
    torch.testing.assert_close(model.gcn.vectors[2], torch.tensor([2, 0.5, -1, 2, 0.2]))
    assert model.gcn.vectors[0].abs().max() <= 0.1                        # not in the file: random start


def test_one_pair_batch_contributes_nothing():
    features, mask, tokens, lengths, nodes = _batch()
    model = _model().train()
    loss = model(features[:1], mask[:1], tokens[:1], lengths[:1], nodes=nodes[:1])
    loss.backward()
    assert float(loss.detach()) == 0.0


def test_instance_bn_over_region_positions_and_attention_dropout():
    """CVSE's image attention: BatchNorm1d over the region positions of ``fc1 v`` and dropout after each tanh."""
    features, mask, _, _, _ = _batch()
    regions, by_feature = _model(), _model(instance_bn="features")
    assert regions.img_attn.bn_local.num_features == 5 and by_feature.img_attn.bn_local.num_features == 16
    attn = regions.img_attn.train()
    local = attn.fc_local(regions.img_enc(features))                             # [B, K, d]
    normed = attn.bn_local(local)
    mean, var = local.mean(dim=(0, 2)), local.var(dim=(0, 2), unbiased=False)   # statistics per position
    torch.testing.assert_close(normed, (local - mean.view(1, -1, 1)) / (var.view(1, -1, 1) + 1e-5).sqrt(),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="num_regions is 36"):
        _model(num_regions=36).encode_images(features, mask)
    assert regions.img_attn.dropout.p == 0.4 and regions.txt_attn.dropout.p == 0.4
    regions.train()
    torch.manual_seed(0)
    a = regions.encode_images(features, mask)["instance"]
    torch.manual_seed(1)
    b = regions.encode_images(features, mask)["instance"]
    assert not torch.allclose(a, b)                     # dropout in training
    regions.eval()
    torch.testing.assert_close(regions.encode_images(features, mask)["instance"],
                               regions.encode_images(features, mask)["instance"])


def _cvse_image_attention(attn, v):
    """CVSE's ``V_single_modal_atten`` (use_BatchNorm, tanh), written out with ``attn``'s layers and dropout off:
    ``fc1 → BatchNorm1d(36 positions) → tanh``, the raw region mean ``→ fc2 → BatchNorm1d(d) → tanh``, product,
    ``fc3``, softmax over regions, ``l2norm(Σ α v)``. Training-mode statistics."""
    local = attn.fc_local(v)                                                   # [B, K, d]
    mean_k = local.mean(dim=(0, 2), keepdim=True)
    var_k = local.var(dim=(0, 2), unbiased=False, keepdim=True)
    w_local = torch.tanh((local - mean_k) / (var_k + 1e-5).sqrt() * attn.bn_local.weight.view(1, -1, 1)
                         + attn.bn_local.bias.view(1, -1, 1))
    query = attn.fc_query(v.mean(1))                                           # not l2-normalised (CVSE)
    w_query = torch.tanh(F.batch_norm(query, None, None, attn.bn_query.weight, attn.bn_query.bias, training=True))
    alpha = torch.softmax(attn.fc_score(w_local * w_query.unsqueeze(1)).squeeze(-1), dim=1)
    return F.normalize((alpha.unsqueeze(-1) * v).sum(1), dim=-1)


def test_image_attention_is_cvse_region_position_batch_norm():
    """instance_bn='regions' is CVSE's BatchNorm1d(num_regions) inside the model's forward; 'features' is not."""
    features, _, _, _, _ = _batch()
    mask = torch.ones(features.shape[:2], dtype=torch.bool)                   # bottom-up sets: every region real
    model = _model(attention_dropout=0.0).train()
    for param in (model.img_attn.bn_local.weight, model.img_attn.bn_local.bias):
        torch.nn.init.normal_(param)                                          # the per-position affine is used too
    v = model.img_enc(features)
    torch.testing.assert_close(model.img_attn(v, mask), _cvse_image_attention(model.img_attn, v))
    by_feature = _model(attention_dropout=0.0, instance_bn="features").train()
    v = by_feature.img_enc(features)
    assert not torch.allclose(by_feature.img_attn(v, mask), _cvse_image_attention(model.img_attn, v), atol=1e-3)


def test_text_attention_with_normalised_query_is_cvse_unmasked_form():
    """CVSE's ``T_single_modal_atten`` masks nothing, but its padded word vectors are 0 and it l2-normalises the
    mean query and the output: retr's masked attention with ``text_query_l2norm`` equals it; the raw query not."""
    _, _, tokens, lengths, _ = _batch()
    model = _model(attention_dropout=0.0, word_dropout=0.0).eval()
    for layer in (model.txt_attn.fc_local, model.txt_attn.fc_query, model.txt_attn.fc_score):
        torch.nn.init.normal_(layer.weight)                  # weights large enough for the query norm to matter
    raw = _model(attention_dropout=0.0, word_dropout=0.0, text_query_l2norm=False).eval()
    raw.load_state_dict(model.state_dict())
    with torch.no_grad():
        words = model.txt_enc(tokens, lengths)                                  # [B, L, d], zeros past each length
        attn = model.txt_attn
        query = F.normalize(words.mean(1), dim=-1)                              # mean over all L, then l2norm
        h = torch.tanh(attn.fc_local(words)) * torch.tanh(attn.fc_query(query)).unsqueeze(1)
        alpha = torch.softmax(attn.fc_score(h).squeeze(-1), dim=1)              # padding not masked
        cvse = F.normalize((alpha.unsqueeze(-1) * words).sum(1), dim=-1)
        torch.testing.assert_close(model.encode_captions(tokens, lengths)["instance"], cvse)
        assert (raw.encode_captions(tokens, lengths)["instance"] - cvse).abs().max() > 2e-5   # 0 if ignored


def test_dropout_sits_where_cvse_has_it():
    """Word embeddings and the two attentions drop in training (CVSE's 0.4); the concept attention has none
    (CVSE's, with batch norm and tanh, has none); evaluation is deterministic."""
    features, mask, tokens, lengths, _ = _batch()
    model = _model()
    assert model.txt_enc.dropout.p == 0.4 and model.img_attn.dropout.p == 0.4 and model.txt_attn.dropout.p == 0.4
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.img_concept_attn.modules())

    def twice(m, fn):
        torch.manual_seed(0)
        a = fn(m)
        torch.manual_seed(1)
        return a, fn(m)

    words = lambda m: m.txt_enc(tokens, lengths)
    a, b = twice(model.train(), words)
    assert not torch.allclose(a, b)                                            # dropout on the word embeddings
    a, b = twice(_model(word_dropout=0.0).train(), words)
    torch.testing.assert_close(a, b)
    captions = lambda m: m.encode_captions(tokens, lengths)["instance"]
    a, b = twice(_model(word_dropout=0.0).train(), captions)
    assert not torch.allclose(a, b)                                            # dropout in the text attention
    # no dropout left anywhere else in training (trees, concepts, fusion) once both are 0
    quiet = _model(word_dropout=0.0, attention_dropout=0.0).train()
    for fn in (captions, lambda m: m.encode_captions(tokens, lengths)["fused"],
               lambda m: m.encode_images(features, mask)["fused"]):
        a, b = twice(quiet, fn)
        torch.testing.assert_close(a, b)
    model.eval()
    a, b = twice(model, lambda m: m.encode_captions(tokens, lengths)["fused"])
    torch.testing.assert_close(a, b)


def test_runs_without_the_new_settings_keep_their_old_behaviour():
    """A stored config without a setting whose default changed gets the old value (the spec's upgrade)."""
    from retr.trainers.models.smfea import SMFEA_OLD_DEFAULTS, _smfea_upgrade

    assert {"word_dropout", "concept_kl_reduction", "attention_dropout", "instance_bn", "text_query_l2norm",
            "tree_residual", "concept_kl_weight"} <= set(SMFEA_OLD_DEFAULTS)
    args, inputs = _smfea_upgrade({"embed_size": 16, "trees": "t.h5", "concepts": "c.h5"})
    assert inputs == {"trees": "t.h5", "concepts": "c.h5"}
    for name, old in SMFEA_OLD_DEFAULTS.items():
        assert args[name] == old, name
    old = _model(**{k: v for k, v in args.items() if k != "embed_size"})
    assert old.txt_enc.dropout.p == 0.0 and old.img_attn.dropout.p == 0.0 and old.concept_kl_reduction == "mean"
    assert old.img_attn.bn_local.num_features == 16 and old.rank_weights["instance"] == 0.0
    # a config that has the fields keeps them
    kept, _ = _smfea_upgrade({"word_dropout": 0.4, "concept_kl_reduction": "sum"})
    assert kept["word_dropout"] == 0.4 and kept["concept_kl_reduction"] == "sum"


def test_smfea_drops_the_last_smaller_batch_as_cvse_and_other_models_keep_it():
    """CVSE's training loader has drop_last=True (docs/models-smfea.md C13): SMFEA's presets set drop_last; the
    sampler then yields only full batches (a single, smaller batch is still kept: there is nothing else)."""
    from retr.trainers.data.splits import EpochBatchSampler
    from retr.trainers.models import preset

    assert preset("smfea", "f30k")["drop_last"] is True and preset("smfea", "coco")["drop_last"] is True
    assert "drop_last" not in preset("scan", "f30k")
    kept = EpochBatchSampler(10, 4, seed=0)
    dropped = EpochBatchSampler(10, 4, seed=0, drop_last=True)
    assert [len(b) for b in kept] == [4, 4, 2] and [len(b) for b in dropped] == [4, 4]
    assert list(dropped) == list(kept)[:2]                         # the same order, the tail left out
    assert [len(b) for b in EpochBatchSampler(3, 4, seed=0, drop_last=True)] == [3]
    assert [len(b) for b in EpochBatchSampler(8, 4, seed=0, drop_last=True)] == [4, 4]


def _tree_node_by_node(lstm: SevenNodeTreeLSTM, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 6–11 one node at a time, children before parents (the direct reading of the equations)."""
    H = lstm.hidden_size
    W, b, U = lstm.W.weight, lstm.W.bias, lstm.U.weight
    h, c, f = {}, {}, {}
    for t in (0, 2, 4, 6, 1, 5, 3):
        kids = CHILDREN[t]
        h_sum = sum((h[k] for k in kids), torch.zeros_like(x[:, 0, :H]))
        z = x[:, t] @ W.t() + b + h_sum @ U.t()
        i, f[t], o, u = (torch.sigmoid(z[:, :H]), torch.sigmoid(z[:, H:2 * H]), torch.sigmoid(z[:, 2 * H:3 * H]),
                         torch.tanh(z[:, 3 * H:]))
        c[t] = i * u
        for k in kids:
            if lstm.forget_gate == "as-printed":
                c[t] = c[t] + f[t] * f[k] * c[k]
            else:
                c[t] = c[t] + torch.sigmoid(x[:, t] @ W[H:2 * H].t() + b[H:2 * H] + h[k] @ U[H:2 * H].t()) * c[k]
        h[t] = o * torch.tanh(c[t])
    return torch.stack([h[t] for t in range(7)], 1), torch.stack([c[t] for t in range(7)], 1)


@pytest.mark.parametrize("forget_gate", ["as-printed", "per-child"])
def test_tree_lstm_levels_equal_the_node_by_node_equations(forget_gate):
    """The level-batched update gives every node's Eq. 6–11 values and gradients (float64: the two differ only in
    the order of a few sums, ~1e-16 relative)."""
    torch.manual_seed(4)
    lstm = SevenNodeTreeLSTM(input_dim=5, hidden_size=3, forget_gate=forget_gate).double()
    x = torch.randn(4, 7, 5, dtype=torch.float64, requires_grad=True)
    outputs = [lstm(x), _tree_node_by_node(lstm, x)]
    for ours, direct in zip(*outputs):
        torch.testing.assert_close(ours, direct, rtol=1e-12, atol=1e-14)
    grads = [torch.autograd.grad(sum(o.sin().sum() for o in out), [x, *lstm.parameters()]) for out in outputs]
    for ours, direct in zip(*grads):
        torch.testing.assert_close(ours, direct, rtol=1e-12, atol=1e-14)


def test_tree_encoder_node_maps_are_its_seven_linears():
    """The node maps run as one product each; their values are the seven Linear layers' (float64)."""
    torch.manual_seed(5)
    enc = StructuredTreeEncoder(embed_size=8, num_entities=11, num_relations=5, hidden_size=4).double()
    instance = torch.randn(3, 8, dtype=torch.float64)
    out = enc(instance)
    hidden, _ = enc.lstm(torch.stack([m(instance) for m in enc.node_inputs], 1))
    tree = l2norm(sum(m(hidden[:, t]) for t, m in enumerate(enc.node_outputs)), dim=-1)
    torch.testing.assert_close(out["hidden"], hidden, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out["tree"], tree, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out["entity_logits"], enc.entity_classifier(hidden[:, [0, 2, 4, 6]]))
    torch.testing.assert_close(out["relation_logits"], enc.relation_classifier(hidden[:, [1, 3, 5]]))
