"""VSE∞'s own pieces (the registry-wide tests cover shapes, padding, blocks, a training step; test_explain.py its
pooling weights; test_golden_vse_infinity.py parity with the authors' code): GPO's formula, the positional
encoding, size augmentation, the optimiser, the presets, and ``retr-train vse-infinity`` end to end."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch
from click.testing import CliRunner

from retr.trainers.commands import cli
from retr.trainers.models import create_model, get_spec
from retr.trainers.models.layers import lengths_mask
from retr.trainers.models.vse_infinity import GPO, positional_encoding


def tiny(**settings):
    torch.manual_seed(0)
    return create_model("vse-infinity", vocab_size=10_000, img_dim=12, embed_size=16, word_dim=8, **settings)


def test_positional_encoding_is_the_transformer_formula():
    """p[k, 2j] = sin(k / 10000^(2j/d)), p[k, 2j+1] = cos(…); float32 arithmetic, so 1e-6 (a few float32 ulps of
    an argument up to 40)."""
    pe = positional_encoding(41, 8)
    for k in (0, 1, 7, 40):
        for j in range(4):
            angle = k / 10000 ** (2 * j / 8)
            assert pe[k, 2 * j].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[k, 2 * j + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    with pytest.raises(ValueError, match="even"):
        positional_encoding(3, 5)


def test_gpo_weights_each_dimensions_sorted_values_by_set_size_only():
    """pooled = Σ_k θ_k · (k-th largest value of each dimension), θ a distribution over the n real ranks that
    depends on n alone; a set given with holes in its mask pools as the same set packed to the front. float64, so
    1e-12 is rounding only."""
    torch.manual_seed(1)
    gpo = GPO(8, 6).double()
    x = torch.randn(4, 6, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0], [0, 0, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0]]).bool()
    pooled, theta, size = gpo(x, mask)
    assert size.tolist() == [6, 3, 1, 3]
    torch.testing.assert_close(theta.sum(1), torch.ones(4, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (theta[~lengths_mask(size, 6)] == 0).all()
    for b in range(4):
        real = x[b][mask[b]]                                              # [n, 5]
        expected = (theta[b, :len(real)].unsqueeze(1) * real.sort(dim=0, descending=True).values).sum(0)
        torch.testing.assert_close(pooled[b], expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(theta[1], theta[3], rtol=0, atol=1e-12)    # same size, other values: same θ
    packed = torch.zeros(1, 6, 5, dtype=torch.float64)
    packed[0, :3] = x[1][mask[1]]
    torch.testing.assert_close(gpo(packed, lengths_mask(torch.tensor([3]), 6))[0][0], pooled[1], rtol=0, atol=1e-12)
    wider = gpo(torch.cat([x, torch.full((4, 3, 5), 1e3, dtype=torch.float64)], 1),
                torch.cat([mask, torch.zeros(4, 3, dtype=torch.bool)], 1))
    torch.testing.assert_close(wider[1][:, :6], theta, rtol=0, atol=1e-12)


def test_gpo_with_one_hot_weights_is_max_pooling():
    """A θ that puts all weight on rank 1 makes GPO max pooling (the paper's special case)."""
    gpo = GPO(8, 4)
    with torch.no_grad():
        gpo.linear.weight.zero_()
    x, mask = torch.randn(2, 5, 3), lengths_mask(torch.tensor([5, 2]), 5)
    gpo.weights = lambda lengths, width: torch.eye(width)[0].expand(len(lengths), -1)   # noqa: E731
    pooled, _, _ = gpo(x, mask)
    torch.testing.assert_close(pooled, torch.stack([x[0].max(0).values, x[1, :2].max(0).values]))


def test_region_size_augmentation_drops_a_fifth_and_never_empties_a_set():
    """Training mode drops each real region with probability 0.2: over 36,000 regions the kept fraction is
    0.8 ± 5σ (σ = √(0.8·0.2/36000) ≈ 0.002); a one-region set always keeps it; eval mode drops nothing."""
    model = tiny().train()
    torch.manual_seed(2)
    mask = torch.ones(1000, 36, dtype=torch.bool)
    kept = model.drop_regions(mask)
    assert abs(kept.float().mean().item() - 0.8) < 5 * math.sqrt(0.8 * 0.2 / 36000)
    single = lengths_mask(torch.ones(500, dtype=torch.long), 4)
    assert torch.equal(tiny(drop_regions=0.9).drop_regions(single), single)
    features = torch.randn(3, 36, 12)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model.encode_images(features, mask[:3])["vector"],
                           model.encode_images(features, mask[:3])["vector"])


def test_word_size_augmentation_masks_replaces_and_deletes_in_the_authors_proportions():
    """Each token with p = 0.2: <mask> (p/2 = 0.1), a random id (p/10 = 0.02), deleted (2p/5 = 0.08); survivors keep
    their order. Tokens are increasing ids 1…40 of a 10,000-word vocabulary: a random id lands among them with
    probability 0.4% (~3 of the ~800 replacements), each breaking the order at most twice, so at most 40 breaks are
    allowed (a reordering of the survivors breaks thousands). Bounds: 5σ of the binomial over 40,000 tokens."""
    model = tiny().train()
    torch.manual_seed(3)
    tokens = torch.arange(1, 41).repeat(1000, 1)
    lengths = torch.full((1000,), 40)
    lengths[::2] = 25
    tokens = tokens * lengths_mask(lengths, 40)
    out, new_lengths = model.augment_words(tokens, lengths)
    total = int(lengths.sum())
    bound = lambda p: 5 * math.sqrt(p * (1 - p) / total)  # noqa: E731
    assert abs(1 - new_lengths.sum().item() / total - 0.08) < bound(0.08)
    assert abs((out == model.mask_token).sum().item() / total - 0.10) < bound(0.10)
    foreign = breaks = 0
    for row, n in zip(out, new_lengths.tolist()):
        assert (row[n:] == 0).all() and n >= 1
        originals = [t for t in row[:n].tolist() if 1 <= t <= 40]
        breaks += sum(b <= a for a, b in zip(originals, originals[1:]))
        foreign += sum(1 for t in row[:n].tolist() if t > 40 and t != model.mask_token)
    assert breaks <= 40
    assert abs(foreign / total - 0.02) < bound(0.02)


def test_optimiser_presets_and_settings():
    model = tiny(weight_decay=0.05)
    optimizer = model.configure_optimizer(5e-4)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["weight_decay"] == 0.05
    assert model.txt_enc.embed.num_embeddings == 10_001 and model.mask_token == 10_000
    spec = get_spec("vse-infinity")
    for name in ("f30k", "coco"):
        assert {k: spec.resolve_preset(name)[k] for k in ("epochs", "lr", "lr_update", "warmup_epochs")} == \
            {"epochs": 25, "lr": 5e-4, "lr_update": 15, "warmup_epochs": 1}
    assert tiny(image_mlp=False).img_enc.mlp is None
    with pytest.raises(ValueError, match="drop_regions must be in"):
        tiny(drop_regions=1.0)


@pytest.mark.slow
def test_train_eval_and_explain_from_the_command_line(tmp_path, synthetic_data):
    """``retr-train vse-infinity`` (its preset's warm-up epoch, size augmentation, AdamW) learns the synthetic task:
    R@1 both ways at least 5× chance (measured 80 / 42 against chance 5); the run's model explains a pair; a bad
    setting is one line."""
    from retr.trainers.runs.checkpoint import load_run_model

    manifest, features = synthetic_data(images=200)
    run = tmp_path / "run"
    args = ["vse-infinity", "--features", str(features), "--manifest", str(manifest), "--out", str(run),
            "--embed-size", "64", "--word-dim", "32", "--batch-size", "32", "--epochs", "4", "--lr", "2e-3",
            "--quiet", "--device", "cpu"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    config = json.loads((run / "config.json").read_text())
    assert config["warmup_epochs"] == 1 and config["model_args"]["drop_regions"] == 0.2
    epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [e for e in epochs if "val" in e]
    assert len(epochs) == 4 and epochs[-1]["train_loss"] < epochs[1]["train_loss"]
    out = CliRunner().invoke(cli, ["eval", str(run), "--protocol", "f30k-1k", "--allow-size-mismatch", "--json",
                                   "--device", "cpu", "--quiet"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    result, chance = json.loads(out.output), 100 / 20         # 20 test images
    assert result["i2t"]["r1"] >= 5 * chance and result["t2i"]["r1"] >= 5 * chance, result
    model, _, _ = load_run_model(run)
    model.eval()
    with torch.no_grad():
        maps = model.explain(model.encode_images(torch.randn(1, 4, 16), torch.tensor([[1, 1, 1, 0]]).bool()),
                             model.encode_captions(torch.tensor([[1, 5, 6, 2]]), torch.tensor([4])))
    assert {k: tuple(v.shape) for k, v in maps.items()} == {"image_pooling": (3,), "caption_pooling": (4,)}
    bad = CliRunner().invoke(cli, [*args[:-2], "--drop-regions", "1.5"])
    assert bad.exit_code != 0 and str(bad.exception) == "--drop-regions must be in [0, 1), not 1.5"


def test_word_vectors_fill_the_vocabulary_rows_and_leave_mask_alone(tmp_path):
    """``--word-vectors FILE``: words in the file start from its vectors, the others and ``<mask>`` (the row after
    the vocabulary) keep the model's init; frozen with ``freeze_word_vectors``."""
    from retr.store.vocab import Vocabulary
    from retr.trainers.models import ModelInputs
    from retr.trainers.models.vse_infinity import VSEInfinity, VSEInfinityConfig
    from retr.trainers.models.side_inputs import add_word_vectors

    vocab = Vocabulary(["cat", "dog", "bird"])
    path = tmp_path / "vectors.txt"
    path.write_text("cat 1 2 3 4\nbird -1 -2 -3 -4\nzebra 9 9 9 9\n", encoding="utf-8")
    for freeze in (False, True):
        cfg = VSEInfinityConfig(word_vectors=str(path), word_dim=4, embed_size=8, freeze_word_vectors=freeze)
        inputs = add_word_vectors(ModelInputs(), cfg, vocab)
        model = VSEInfinity(len(vocab), img_dim=6, config=cfg, **inputs.sizes)
        before = model.txt_enc.embed.weight.detach().clone()
        model.prepare_training(inputs.tensors)
        weight = model.txt_enc.embed.weight.detach()
        assert weight[vocab.word2idx["cat"]].tolist() == [1, 2, 3, 4]
        assert weight[vocab.word2idx["bird"]].tolist() == [-1, -2, -3, -4]
        for row in (vocab.word2idx["dog"], 0, len(vocab)):                # absent word, <pad>, <mask>
            assert torch.equal(weight[row], before[row])
        assert model.txt_enc.embed.weight.requires_grad is not freeze and model.word_vectors_file.startswith("vectors")


@pytest.mark.slow
def test_report_draws_the_pooling_weights_as_rank_tables_not_on_the_image(tmp_path):
    """θ weighs ranks (k-th largest values), not regions or words: ``retr-train show`` draws both maps as plain
    matrices (a box or word drawing would put rank weights on the wrong objects)."""
    from report_synthetic import make_images, train_tiny, write_scene_boxes
    from retr.trainers.reporting import report as rp

    manifest = make_images(tmp_path / "data", images=60)
    run = train_tiny("vse-infinity", write_scene_boxes(tmp_path / "data"), manifest, tmp_path / "run", "--epochs", "1")
    index = rp.write_report([str(run)], "f30k-1k", tmp_path / "report", samples=2, top=3, attention=1,
                            allow_size_mismatch=True, quiet=True)
    page = index.read_text(encoding="utf-8")
    for name in ("image_pooling", "caption_pooling"):
        assert re.search(rf"<h4>{name} <span class='small'>\[\d+\] — matrix", page), name
    assert "— boxes" not in page and "— words" not in page
