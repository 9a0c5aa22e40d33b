"""Issue 18: ``--amp bf16|fp16`` and ``--accum-steps N``. Under accumulation a negative is another pair of the
same micro-batch; the gradient is the sum of the micro-batches' gradients."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from retr.trainers.training import checkpoint as ckpt
from retr.trainers.commands import cli
from retr.trainers.training.loop import autocast_dtype, train_step
from retr.trainers.training.losses import hinge_triplet_loss
from retr.trainers.models import create_model
from trainer_synthetic import make_synthetic


def _batch(size=8):
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 6, (size,), generator=g)
    mask = torch.ones(size, 3, dtype=torch.bool)
    mask[1, 2:] = False
    return {"features": torch.randn(size, 3, 6, generator=g), "mask": mask,
            "tokens": torch.randint(4, 20, (size, 6), generator=g), "lengths": lengths}


def _model():
    torch.manual_seed(0)
    return create_model("vsepp", vocab_size=20, img_dim=6, embed_size=8, word_dim=4)


@pytest.mark.parametrize("hardest", [True, False])
def test_accumulation_is_the_sum_of_micro_batches_with_their_own_negatives(hardest):
    batch = _batch()
    model = _model()
    model.max_violation = hardest
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = train_step(model, batch, optimizer, None, 0.0, torch.device("cpu"), accum_steps=2)
    reference = _model()
    reference.max_violation = hardest
    reference.train()
    total = 0.0
    for rows in (slice(0, 4), slice(4, 8)):               # each half scored alone: its own 3 negatives a row
        part = {k: v[rows] for k, v in batch.items()}
        images = reference.encode_images(part["features"], part["mask"])
        captions = reference.encode_captions(part["tokens"], part["lengths"])
        micro = hinge_triplet_loss(reference.score(images, captions), reference.margin, hardest)
        micro.backward()
        total += float(micro.detach())
    assert loss == pytest.approx(total, rel=1e-6)
    with torch.no_grad():
        for p in reference.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    whole = _model()
    whole.max_violation = hardest
    one_batch = train_step(whole, batch, torch.optim.SGD(whole.parameters(), lr=0.1), None, 0.0,
                           torch.device("cpu"))
    assert one_batch != pytest.approx(loss)                # the full batch has other negatives


def test_autocast_dtypes():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert autocast_dtype("bf16", cpu) is torch.bfloat16 and autocast_dtype("bf16", cuda) is torch.bfloat16
    assert autocast_dtype("fp16", cpu) is None and autocast_dtype("fp16", cuda) is torch.float16
    assert autocast_dtype("off", cuda) is None


def test_bf16_step_runs_under_autocast_on_cpu(monkeypatch):
    seen = []
    real = torch.Tensor.__matmul__

    def spy(a, b):
        out = real(a, b)
        seen.append(out.dtype)
        return out
    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    model = _model()
    loss = train_step(model, _batch(), torch.optim.Adam(model.parameters()), None, 2.0, torch.device("cpu"),
                      amp="bf16")
    assert loss == loss and torch.bfloat16 in seen


@pytest.mark.slow
def test_amp_and_accum_from_the_command_line(tmp_path):
    manifest, features = make_synthetic(tmp_path, images=40)
    common = ["--features", str(features), "--manifest", str(manifest), "--embed-size", "16", "--word-dim", "8",
              "--batch-size", "16", "--epochs", "1", "--quiet", "--device", "cpu", "--val-images", "10"]
    result = CliRunner().invoke(cli, ["vsepp", *common, "--out", str(tmp_path / "a"), "--amp", "bf16",
                                      "--accum-steps", "4"])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "a" / ckpt.CONFIG).read_text())
    assert config["amp"] == "bf16" and config["accum_steps"] == 4
    result = CliRunner().invoke(cli, ["vsepp", *common, "--out", str(tmp_path / "b"), "--amp"])
    assert result.exit_code == 0 and "--amp fp16 needs CUDA" in result.output
    assert json.loads((tmp_path / "b" / ckpt.CONFIG).read_text())["amp"] == "fp16"
    result = CliRunner().invoke(cli, ["vsepp", *common, "--out", str(tmp_path / "c"), "--accum-steps", "3"])
    assert result.exit_code != 0 and "must divide --batch-size 16" in str(result.exception)


def test_runs_from_before_amp_modes_read_as_fp16_or_off():
    assert ckpt.upgrade_config({"model": "vsepp", "amp": True, "model_args": {}})["amp"] == "fp16"
    assert ckpt.upgrade_config({"model": "vsepp", "amp": False, "model_args": {}})["amp"] == "off"


@pytest.mark.slow
def test_ema_checkpoint_follows_the_weights_resumes_and_evaluates(tmp_path):
    from retr.trainers.training.checkpoint import load_checkpoint

    manifest, features = make_synthetic(tmp_path, images=40)
    common = ["vsepp", "--features", str(features), "--manifest", str(manifest), "--embed-size", "16",
              "--word-dim", "8", "--batch-size", "16", "--quiet", "--device", "cpu", "--val-images", "10"]

    def train(out, epochs, *extra):
        result = CliRunner().invoke(cli, [*common, "--out", str(tmp_path / out), "--epochs", str(epochs), *extra])
        assert result.exit_code == 0, result.output
        return tmp_path / out
    near_zero = train("fast", 2, "--ema", "1e-12")             # decay ≈ 0: the average is the latest weights
    ema, last = load_checkpoint(near_zero / "ema.pt"), load_checkpoint(ckpt.list_checkpoints(near_zero)[-1][1])
    for k, v in last["model"].items():
        assert torch.allclose(ema["model"][k].float(), v.float(), atol=1e-6), k
    straight = train("straight", 2, "--ema", "0.9")
    split = train("split", 1, "--ema", "0.9")
    CliRunner().invoke(cli, ["vsepp", "--out", str(split), "--resume", "--epochs", "2", "--quiet"])
    a, b = load_checkpoint(straight / "ema.pt")["model"], load_checkpoint(split / "ema.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    weights = load_checkpoint(ckpt.list_checkpoints(straight)[-1][1])["model"]
    assert any(not torch.allclose(a[k].float(), weights[k].float()) for k in a if a[k].is_floating_point())
    result = CliRunner().invoke(cli, ["eval", str(straight), "--checkpoint", "ema.pt", "--protocol", "f30k-1k",
                                      "--allow-size-mismatch", "--json", "--quiet"])
    assert result.exit_code == 0 and json.loads(result.output)["models"][0]["checkpoint"] == "ema.pt"
