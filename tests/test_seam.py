"""SEAM: shapes, masking, self-attention/penalty/order-violation/loss against direct formulas, crops, learning."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from retr.trainers.models import create_model, preset
from retr.trainers.models.seam import SEAMConfig, SEAM, MaskedBatchNorm1d, SelfAttention, attention_penalty
from tests.ddp_simulation import simulated_ddp_grads

VOCAB, D_IN, CROPS = 40, 20, 10


def tiny(text_encoder="c", **kw) -> SEAM:
    torch.manual_seed(kw.pop("seed", 0))
    args = dict(vocab_size=VOCAB, img_dim=D_IN, text_encoder=text_encoder, embed_size=16, word_dim=12, hops=3,
                attention_hidden=8, conv_filters=5, gru_size=10)
    args.update(kw)
    return create_model("seam", **args)


def batch(n_img=3, n_cap=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    features = torch.rand(n_img, CROPS, D_IN, generator=g)
    lengths = torch.tensor([9, 3, 6, 2, 7, 5, 4, 8][:n_cap])
    tokens = torch.randint(4, VOCAB, (n_cap, int(lengths.max())), generator=g)
    tokens = tokens.masked_fill(torch.arange(tokens.shape[1]) >= lengths.view(-1, 1), 0)
    return features, torch.ones(n_img, CROPS, dtype=torch.bool), tokens, lengths


@pytest.mark.parametrize("kind", ["e", "c", "g"])
def test_shapes_and_abs_normalised_embeddings(kind):
    m = tiny(kind).eval()
    features, mask, tokens, lengths = batch()
    with torch.no_grad():
        im, caps = m.encode_images(features, mask), m.encode_captions(tokens, lengths)
        scores = m.score(im, caps)
    assert im["vector"].shape == (3, 16) and caps["vector"].shape == (4, 16) and caps["penalty"].shape == (4,)
    assert scores.shape == (3, 4) and (scores <= 0).all()
    for v in (im["vector"], caps["vector"]):
        assert (v >= 0).all()
        torch.testing.assert_close(v.norm(dim=1), torch.ones(v.shape[0]), rtol=1e-5, atol=1e-5)
    modules = m.txt_enc.attention
    assert len(modules) == (3 if kind == "c" else 1) and all(a.hops == 3 for a in modules)
    assert m.txt_enc.fc.in_features == {"e": 12, "c": 5 + 5 + 12, "g": 10}[kind] * 3


def test_default_hops_follow_the_paper():
    assert [a.hops for a in tiny("e", hops=None).txt_enc.attention] == [30]
    assert [a.hops for a in tiny("c", hops=None).txt_enc.attention] == [10, 10, 10]
    assert [a.hops for a in tiny("g", hops=None).txt_enc.attention] == [30]


@pytest.mark.parametrize("kind", ["e", "c", "g"])
def test_padded_caption_scores_the_same_as_unpadded(kind):
    m = tiny(kind).eval()
    features, mask, tokens, lengths = batch()
    with torch.no_grad():
        im = m.encode_images(features, mask)
        padded = m.score(im, m.encode_captions(tokens, lengths))     # caption 1: 3 words padded to 9
        alone = m.score(im, m.encode_captions(tokens[1:2, :3], lengths[1:2]))
        penalty = m.encode_captions(tokens, lengths)["penalty"][1]
        penalty_alone = m.encode_captions(tokens[1:2, :3], lengths[1:2])["penalty"][0]
    torch.testing.assert_close(padded[:, 1], alone[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(penalty, penalty_alone, rtol=1e-5, atol=1e-6)


def test_self_attention_matches_its_formula():
    torch.manual_seed(0)
    att = SelfAttention(in_dim=6, hops=4, hidden=5)
    h = torch.randn(2, 7, 6)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    out, a = att(h, mask)
    for b, n in ((0, 7), (1, 4)):
        H = h[b, :n]                                                    # [T, z]
        A = torch.softmax(torch.tanh(H @ att.ws1.weight.t()) @ att.ws2.weight.t(), dim=0).t()   # [hops, T]
        torch.testing.assert_close(a[b, :, :n], A, rtol=1e-5, atol=1e-6)
        assert a[b, :, n:].abs().sum() < 1e-6
        torch.testing.assert_close(out[b], (A @ H).reshape(-1), rtol=1e-5, atol=1e-6)


def test_penalty_matches_the_frobenius_formula():
    g = torch.Generator().manual_seed(2)
    a = torch.softmax(torch.randn(3, 4, 6, generator=g), dim=-1)
    for squared in (True, False):
        got = attention_penalty(a, squared)
        for b in range(3):
            A = a[b].numpy().astype(np.float64)
            frob = np.sqrt(((A @ A.T - np.eye(4)) ** 2).sum())
            assert got[b].item() == pytest.approx(frob ** 2 if squared else frob, rel=1e-5)


def test_masked_batch_norm_uses_real_words_only():
    bn = MaskedBatchNorm1d(3).train()
    x = torch.randn(2, 3, 5)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    real = torch.cat([x[0].t(), x[1, :, :2].t()])                    # [7, 3]
    expected = (real - real.mean(0)) / torch.sqrt(real.var(0, unbiased=False) + bn.eps)
    out = bn(x, mask)
    torch.testing.assert_close(torch.cat([out[0].t(), out[1, :, :2].t()]), expected, rtol=1e-5, atol=1e-5)
    assert (out[1, :, 2:] == 0).all()


def public_seam_c(m: SEAM, tokens: torch.Tensor, training: bool, stats: dict) -> torch.Tensor:
    """SEAM-C's caption vector as ``jwehrmann/seam-retrieval`` computes it (``ConvAttentiveTextEncoder.forward``
    with ``ConvBlock`` = Conv1d → ReLU → BatchNorm1d and ``SelfAttentiveEncoder``), written out with ``m``'s
    weights. ``tokens`` [B, T]: 0 (``<pad>``) after each caption, T = the longest caption; ``stats``: BatchNorm
    running statistics {"bn2": (mean, var), "bn3": …}, updated in place in training."""
    enc = m.txt_enc
    x_embed = enc.embed.weight[tokens]                                 # the <pad> row is a row like any other
    x = x_embed.permute(0, 2, 1)                                       # [B, 300, T]
    pad = (tokens == 0).float()

    def conv_block(conv, bn, name):                                    # BatchNorm over every position
        y = torch.relu(F.conv1d(x, conv.weight, conv.bias, padding=1))
        return F.batch_norm(y, *stats[name], bn.weight, bn.bias, training, bn.momentum, bn.eps)

    def attend(att, h):                                                # h [B, T, z]
        alphas = F.linear(torch.tanh(F.linear(h, att.ws1.weight)), att.ws2.weight).transpose(1, 2)
        alphas = torch.softmax(alphas + (-10000 * pad.unsqueeze(1)), dim=-1)
        return torch.bmm(alphas, h).reshape(h.shape[0], -1)

    conv1 = conv_block(enc.conv2, enc.bn2, "bn2")[:, :, :-1]           # k=2: T+1 outputs, cropped after BN
    conv2 = conv_block(enc.conv3, enc.bn3, "bn3")
    vectors = torch.cat([attend(enc.attention[0], conv1.permute(0, 2, 1)),
                         attend(enc.attention[1], conv2.permute(0, 2, 1)),
                         attend(enc.attention[2], x_embed)], 1)
    out = F.linear(vectors, enc.fc.weight, enc.fc.bias)
    return (out / out.pow(2).sum(1, keepdim=True).sqrt()).abs()


def bn_stats(m: SEAM) -> dict:
    return {n: (getattr(m.txt_enc, n).running_mean.clone(), getattr(m.txt_enc, n).running_var.clone())
            for n in ("bn2", "bn3")}


def test_authors_padding_reproduces_the_public_seam_c_arithmetic():
    """padding="authors" = the public code's SEAM-C: the <pad> embedding is convolved, BatchNorm sees padded
    positions (training: batch statistics and running statistics); "masked" differs, so the option matters."""
    _, _, tokens, lengths = batch(n_cap=6)                    # lengths 9, 3, 6, 2, 7, 5: padded to 9
    authors, masked = tiny("c", padding="authors").train(), tiny("c", padding="masked").train()
    assert authors.txt_enc.embed.weight[0].abs().min() > 0     # a real <pad> vector, not zeros
    stats = bn_stats(authors)
    got = authors.encode_captions(tokens, lengths)["vector"]
    expected = public_seam_c(authors, tokens, True, stats)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for name in ("bn2", "bn3"):                                 # running statistics include padded positions
        torch.testing.assert_close(getattr(authors.txt_enc, name).running_mean, stats[name][0])
        torch.testing.assert_close(getattr(authors.txt_enc, name).running_var, stats[name][1])
    assert (masked.encode_captions(tokens, lengths)["vector"] - expected).abs().max() > 1e-3
    assert (masked.txt_enc.bn3.running_mean - stats["bn3"][0]).abs().max() > 1e-4

    # evaluation (running statistics): the public arithmetic on this very batch — the longest caption's last
    # trigram reads the convolution's zero padding, every shorter caption's the <pad> row
    authors.eval()
    stats = bn_stats(authors)
    with torch.no_grad():
        got = authors.encode_captions(tokens, lengths)["vector"]
        torch.testing.assert_close(got, public_seam_c(authors, tokens, False, stats), rtol=1e-5, atol=1e-6)
        for j in range(6):
            alone = authors.encode_captions(tokens[j:j + 1, :int(lengths[j])], lengths[j:j + 1])["vector"]
            torch.testing.assert_close(alone, public_seam_c(authors, tokens[j:j + 1, :int(lengths[j])], False, stats),
                                       rtol=1e-5, atol=1e-6)
            if lengths[j] == lengths.max():          # the longest reads zeros in its batch as alone
                torch.testing.assert_close(alone[0], got[j], rtol=1e-5, atol=1e-6)
            else:                                     # a shorter one reads the <pad> row in the batch, zeros alone
                assert (alone[0] - got[j]).abs().max() > 1e-4
        masked.eval().load_state_dict(authors.state_dict())
        assert (masked.encode_captions(tokens, lengths)["vector"] - got).abs().max() > 1e-4
    assert authors.captions_in_split_order and not masked.captions_in_split_order
    assert not tiny("e", padding="authors").captions_in_split_order        # E and G: no convolution, no effect


def test_authors_padding_is_evaluated_in_the_authors_batches():
    """SEAM-C with padding="authors" is encoded for evaluation as the authors' encode_data does: consecutive
    batches in split order (not length-sorted blocks), each caption where it stands (identical captions are not
    merged: each is encoded in its own batch); the default keeps length-sorted blocks and merged duplicates."""
    from retr.trainers.data.splits import SplitData, pad_tokens
    from retr.trainers.evaluation.similarity import SplitEmbeddings

    class Features:                                                     # the two methods encode_split uses
        def __init__(self, n):
            self.array = torch.rand(n, CROPS, D_IN, generator=torch.Generator().manual_seed(3))

        def get(self, idx):
            return self.array[torch.as_tensor(idx)], torch.ones(len(idx), CROPS, dtype=torch.bool)

    g = torch.Generator().manual_seed(4)
    lengths = [5, 9, 4, 6, 3, 7, 5, 6, 8, 4, 8, 5, 6, 3, 7, 4, 10, 9]
    tokens = [[1] + torch.randint(4, VOCAB, (n - 2,), generator=g).tolist() + [2] for n in lengths]
    tokens[17] = list(tokens[1])          # one caption twice: the longest of batch 0, not of batch 2 (16 is longer)
    data = SplitData([f"i{j}" for j in range(6)], ["x"] * 18, np.arange(18) // 3, tokens)
    authors = tiny("c", padding="authors").eval()
    embeddings = SplitEmbeddings.encode(authors, data, Features(6), batch_size=8, quiet=True)
    assert [list(idx) for idx, _ in embeddings.caption_blocks] == [list(range(0, 8)), list(range(8, 16)), [16, 17]]
    assert (embeddings.sources == np.arange(18)).all()
    with torch.no_grad():
        for (idx, block), start in zip(embeddings.caption_blocks, (0, 8, 16)):
            batch = pad_tokens(tokens[start:start + 8])
            torch.testing.assert_close(block["vector"], authors.encode_captions(*batch)["vector"])
    twins = embeddings.caption_blocks[0][1]["vector"][1], embeddings.caption_blocks[2][1]["vector"][1]
    assert (twins[0] - twins[1]).abs().max() > 1e-4                     # as in the authors' evaluation
    masked = tiny("c").eval()
    embeddings = SplitEmbeddings.encode(masked, data, Features(6), batch_size=8, quiet=True)
    assert embeddings.sources[17] == 1                                  # merged with its twin
    lengths_in_blocks = [[lengths[m] for m in idx] for idx, _ in embeddings.caption_blocks]
    assert [sorted(b) for b in lengths_in_blocks] == lengths_in_blocks   # length-sorted blocks


def test_init_authors_keeps_pytorch_default_text_biases_zero_bias_zeroes_them():
    for kind, text_biases in (("e", ["fc"]), ("c", ["fc", "conv2", "conv3"]), ("g", ["fc"])):
        authors, zero = tiny(kind, init="authors"), tiny(kind, init="zero_bias")
        for name in text_biases:
            layer = getattr(authors.txt_enc, name)
            bound = 1 / layer.weight[0].numel() ** 0.5             # PyTorch's default: U(±1/√fan_in)
            assert 0 < layer.bias.abs().max() <= bound and layer.bias.abs().max() > bound / 2
            assert (getattr(zero.txt_enc, name).bias == 0).all()
        assert (authors.img_fc.bias == 0).all() and (zero.img_fc.bias == 0).all()   # the public image encoder
        differ = {f"txt_enc.{n}.bias" for n in text_biases}
        zero_params = dict(zero.named_parameters())
        for name, p in authors.named_parameters():                 # the same random draws otherwise
            if name not in differ:
                torch.testing.assert_close(p, zero_params[name], msg=name)


@pytest.mark.parametrize("squared", [False, True])
def test_order_violation_score_matches_the_direct_formula(squared):
    m = tiny("e", order_squared=squared)
    g = torch.Generator().manual_seed(4)
    im, cap = torch.rand(5, 16, generator=g), torch.rand(7, 16, generator=g)
    got = m.score({"vector": im}, {"vector": cap})
    for i in range(5):
        for c in range(7):
            violation = sum(max(0.0, float(cap[c, k] - im[i, k])) ** 2 for k in range(16))
            expected = -violation if squared else -violation ** 0.5
            assert got[i, c].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    m.max_chunk_elements = 16        # one image per chunk
    torch.testing.assert_close(m.score({"vector": im}, {"vector": cap}), got)


def test_loss_matches_the_direct_formula():
    g = torch.Generator().manual_seed(5)
    scores, penalty = -torch.rand(6, 6, generator=g), torch.rand(6, generator=g) * 3
    m = tiny("e", margin=0.05, penalty_weight=0.5)
    s = scores.tolist()
    hinge = sum(max(0.0, 0.05 - s[i][i] + s[i][j]) + max(0.0, 0.05 - s[i][i] + s[j][i])
                for i in range(6) for j in range(6) if j != i)           # every negative, both directions
    assert m.loss(scores, penalty).item() == pytest.approx(hinge + 0.5 * float(penalty.mean()), rel=1e-5)
    with pytest.raises(ValueError, match="penalty"):
        m.loss(scores)
    assert tiny("e", penalty_weight=0.0).loss(scores).item() == pytest.approx(hinge, rel=1e-5)


@pytest.mark.parametrize("kind", ["e", "c", "g"])
def test_penalty_changes_the_gradient_by_lambda_times_its_own(kind):
    features, mask, tokens, lengths = batch(n_img=4)

    def grads(weight, only_penalty=False):
        m = tiny(kind, penalty_weight=weight).train()
        if only_penalty:
            loss = m.encode_captions(tokens, lengths)["penalty"].mean()
        else:
            loss = m(features, mask, tokens, lengths)
        loss.backward()
        return torch.cat([p.grad.flatten() for a in m.txt_enc.attention for p in a.parameters()])

    without, with_penalty, penalty_only = grads(0.0), grads(0.5), grads(0.5, only_penalty=True)
    assert (with_penalty - without).abs().max() > 1e-4
    torch.testing.assert_close(with_penalty - without, 0.5 * penalty_only, rtol=1e-4, atol=1e-6)


def test_forward_adds_the_penalty_to_the_hinge():
    m = tiny("c").train()
    features, mask, tokens, lengths = batch(n_img=4)
    torch.manual_seed(9)
    got = m(features, mask, tokens, lengths)
    torch.manual_seed(9)
    caps = m.encode_captions(tokens, lengths)
    expected = m.loss(m.score(m.encode_images(features, mask), caps), caps["penalty"])
    torch.testing.assert_close(got, expected)


def test_crops_are_averaged_or_sampled():
    features, mask, _, _ = batch()
    m = tiny("e").train()
    pooled = features.mean(1)
    expected = m.img_fc(pooled / pooled.norm(dim=1, keepdim=True))
    expected = (expected / expected.norm(dim=1, keepdim=True)).abs()
    torch.testing.assert_close(m.encode_images(features, mask)["vector"], expected)
    r = tiny("e", crops="random").train()
    torch.manual_seed(3)
    sampled = r.encode_images(features, mask)["vector"]
    single = [r.encode_images(features[:, k:k + 1], mask[:, :1])["vector"] for k in range(CROPS)]
    for i in range(3):      # every image's vector is the encoding of one of its own crops
        assert any(torch.allclose(sampled[i], s[i], atol=1e-6) for s in single)
    assert not torch.allclose(sampled, r.eval().encode_images(features, mask)["vector"])
    torch.testing.assert_close(r.eval().encode_images(features, mask)["vector"], expected)   # eval: the mean


def test_registry_preset_and_bad_options():
    cfg = preset("seam", "coco")
    assert cfg["margin"] == 0.05 and cfg["max_violation"] is False and cfg["penalty_weight"] == 0.5
    assert cfg["lr"] == 1e-3 and cfg["lr_update"] == 15 and cfg["epochs"] == 30 and cfg["batch_size"] == 128
    model_args = {k: v for k, v in cfg.items() if k in SEAMConfig.__dataclass_fields__}
    model = create_model("seam", vocab_size=VOCAB, img_dim=D_IN, **{**model_args, "text_encoder": "g"})
    assert isinstance(model, SEAM) and model.txt_enc.rnn.hidden_size == 512
    assert cfg["padding"] == "masked" and cfg["init"] == "authors" and cfg["hops"] is None
    assert (cfg["embed_size"], cfg["word_dim"], cfg["attention_hidden"], cfg["conv_filters"]) == (1024, 300, 300, 100)
    assert cfg["grad_clip"] == 1.0 and cfg["text_encoder"] == "c" and cfg["order_squared"] is False
    for bad in ({"text_encoder": "x"}, {"crops": "centre"}, {"penalty_norm": "l1"}, {"padding": "zero"},
                {"init": "xavier"}):
        with pytest.raises(ValueError):
            tiny(**bad)


def test_ddp_gradients_sum_to_the_single_process_ones():
    """The penalty is the global batch mean whatever the number of processes (SEAM-G: no BatchNorm)."""
    m = tiny("g").train()
    features, mask, tokens, lengths = batch(n_img=4, n_cap=4)
    lengths = torch.tensor([9, 3, 9, 5])
    single, summed = simulated_ddp_grads(m, features, mask, tokens, lengths)
    assert set(single) == set(summed)
    for name in single:
        torch.testing.assert_close(summed[name], single[name], rtol=1e-4, atol=1e-6, msg=name)


# -------------------------------------------------------------------------------------------------- learning

def write_scene_tencrop_features(dataset, out, dim: int = 32, seed: int = 0):
    """A 10-crop feature set [N, 10, dim] made from ``scenes.jsonl`` (what a perfect global CNN would see).

    Slot 1 holds the one-hot attributes (size 2, colour 6, shape 5) of the left/upper object, slot 2 those of
    the other, then the relation (left, above); each crop adds its own |N(0, 0.1²)| noise (features are
    non-negative like fc7 after ReLU).
    """
    from retr.manifests.synthetic import COLOURS, SHAPES
    from retr.store.features import ShardWriter, shard_name, write_index
    colours, shapes = list(COLOURS), list(SHAPES)
    rng = np.random.default_rng(seed)
    scenes = [json.loads(line) for line in (dataset / "scenes.jsonl").read_text().splitlines()]
    base = np.zeros((len(scenes), dim), np.float32)
    for n, scene in enumerate(scenes):
        axis = 0 if scene["relation"] == "left" else 1
        objects = sorted(scene["objects"], key=lambda o: o["centre"][axis])
        for slot, obj in enumerate(objects):
            o = 13 * slot
            base[n, o + ["small", "large"].index(obj["size"])] = 1
            base[n, o + 2 + colours.index(obj["colour"])] = 1
            base[n, o + 8 + shapes.index(obj["shape"])] = 1
        base[n, 26 + axis] = 1
    features = base[:, None, :] + np.abs(rng.normal(0, 0.1, (len(scenes), 10, dim))).astype(np.float32)
    attrs = dict(kind="tencrop", extractor="scene-tencrop", backbone="none", weights="random", image_size=224,
                 manifest_sha256="0" * 64)
    shard = out / "scene-tencrop" / shard_name(0, 1)
    with ShardWriter(shard, attrs, (10, dim), dtype="float32", shard_index=0, num_shards=1) as writer:
        writer.append([s["id"] for s in scenes], features)
    return write_index(out / "scene-tencrop.h5", [shard])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["c", "g"])
def test_seam_learns_the_synthetic_scenes(tmp_path, kind):
    """Through the shared loop with the paper's loss: test R@1 (both directions) many times chance."""
    from retr.manifests.synthetic import generate_synthetic
    from retr.store.features import FeatureSet
    from retr.trainers.data.splits import ImageFeatures, load_split
    from retr.trainers.evaluation.metrics import retrieval_metrics
    from retr.trainers.evaluation.similarity import similarity_matrix
    from retr.trainers.training.loop import TrainConfig, train
    from retr.store.vocab import Vocabulary

    dataset = tmp_path / "synth"
    generate_synthetic(dataset, num_images=200, seed=0)
    features = write_scene_tencrop_features(dataset, tmp_path)
    cfg = TrainConfig(model="seam", model_config=SEAMConfig(text_encoder=kind, embed_size=64, word_dim=32, hops=4,
                                                             attention_hidden=32, conv_filters=16, gru_size=32),
                      features=str(features), manifest=str(dataset / "manifest.jsonl"), out=str(tmp_path / "run"),
                      epochs=4, batch_size=100, lr=1e-3 * 5, lr_update=100, grad_clip=1.0, device="cpu",
                      train_splits=["train"], val_images=20)
    train(cfg, quiet=True)
    state = torch.load(tmp_path / "run" / "best.pt", map_location="cpu", weights_only=False)
    vocab = Vocabulary.from_json(state["vocab"])
    model = create_model("seam", **state["config"]["model_args"])
    model.load_state_dict(state["model"])
    fs = FeatureSet(features)
    test, _ = load_split(dataset / "manifest.jsonl", ["test"], vocab, fs)
    metrics = retrieval_metrics(similarity_matrix(model, test, ImageFeatures(fs, test.image_ids), "cpu", quiet=True),
                                test.caption_image)
    chance = 100.0 / test.num_images
    assert metrics["t2i"]["r1"] > 5 * chance, metrics
    assert metrics["i2t"]["r1"] > 5 * chance, metrics


@pytest.mark.parametrize("momentum", [0.1, None])
def test_masked_batch_norm_is_batch_norm_of_the_real_positions(momentum):
    """``masked_batch_norm`` computes BatchNorm1d's statistics from the real positions with masked sums instead of
    ``x[mask]`` (which reads the count back from a GPU): outputs, gradients and the running averages over three
    training steps, then evaluation, equal ``bn(x[mask])``'s (float64: the sums differ only in order, ~1e-16)."""
    from retr.trainers.models.layers import masked_batch_norm
    torch.manual_seed(0)
    ours, theirs = (torch.nn.BatchNorm1d(4, momentum=momentum).double() for _ in range(2))
    for bn in (ours, theirs):
        torch.nn.init.normal_(bn.weight)
        torch.nn.init.normal_(bn.bias)
    theirs.load_state_dict(ours.state_dict())
    mask = torch.tensor([[True] * 5, [True, True, False, False, False], [True, False, False, False, False]])
    for training in (True, True, True, False):
        ours.train(training), theirs.train(training)
        x = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
        grad = torch.randn(3, 5, 4, dtype=torch.float64)
        out = masked_batch_norm(ours, x, mask)
        (g_ours,) = torch.autograd.grad((out * grad).sum(), x)
        expected = theirs(x[mask])
        (g_theirs,) = torch.autograd.grad((expected * grad[mask]).sum(), x)
        torch.testing.assert_close(out[mask], expected, rtol=1e-12, atol=1e-12)
        assert (out[~mask] == 0).all()
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-12, atol=1e-12)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=1e-12, atol=1e-12)


def test_masked_batch_norm_of_bfloat16_inputs_takes_float32_statistics():
    """Under autocast the features arrive in bfloat16, whose 8-bit mantissa cannot even count 4,607 positions:
    the statistics are taken in float32 (the running mean equals float32's on the same inputs to 1e-5, where
    bfloat16 sums are ~4e-3 off) and the result is returned in bfloat16, within its rounding of float32's."""
    import copy

    from retr.trainers.models.layers import masked_batch_norm
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(4).train()
    wide_bn = copy.deepcopy(bn)
    x = (torch.randn(64, 72, 4) * 3 + 5).bfloat16()
    mask = torch.rand(64, 72) < 0.999                                   # ~4,600 real positions
    narrow = masked_batch_norm(bn, x, mask)
    wide = masked_batch_norm(wide_bn, x.float(), mask)
    assert narrow.dtype == torch.bfloat16
    torch.testing.assert_close(bn.running_mean, wide_bn.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var, wide_bn.running_var, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(narrow, wide.to(torch.bfloat16), rtol=0, atol=0)


def test_masked_batch_norm_without_real_positions_and_with_non_finite_padding():
    """A batch with no real position gives zeros and leaves the running averages as they were (``bn(x[mask])``
    raised); a NaN or inf at a padded position is never read."""
    from retr.trainers.models.layers import masked_batch_norm
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3).train()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    out = masked_batch_norm(bn, torch.randn(2, 4, 3), torch.zeros(2, 4, dtype=torch.bool))
    assert (out == 0).all()
    for key, value in bn.state_dict().items():
        assert torch.equal(value, before[key]), key
    x = torch.randn(2, 4, 3)
    mask = torch.tensor([[True, True, False, False], [True, True, True, False]])
    spoiled = x.clone()
    spoiled[~mask] = float("nan")
    spoiled[0, 3, 0] = float("inf")
    clean_bn, spoiled_bn = torch.nn.BatchNorm1d(3).train(), torch.nn.BatchNorm1d(3).train()
    torch.testing.assert_close(masked_batch_norm(spoiled_bn, spoiled, mask), masked_batch_norm(clean_bn, x, mask))
    torch.testing.assert_close(spoiled_bn.running_var, clean_bn.running_var)
