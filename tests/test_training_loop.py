"""The training loop's options (trainers/training/loop.py, data.py, optim.py), each checked on the CPU against the
reference path it replaces:

* ``--preload gpu`` — features held as one tensor on the training device, batches gathered there: the same
  batches as host memory and as reading per batch; a set that does not fit falls back to host memory;
* batches in the stored dtype (float16 over the bus), converted on the device: the same float32 values;
* ``--optimizer-impl fused|foreach|loop`` — torch's three Adam/SGD/… updates give the same weights to rounding,
  for every model's own optimiser (JGCAR's SGD + RMSprop, SMAN's Adadelta); a resume may switch;
* ``--compile`` — the compiled training scoring function gives eager's losses and gradients;
* ``--amp bf16|fp16`` and ``--accum-steps N`` — under accumulation a negative is another pair of the same
  micro-batch; the gradient is the sum of the micro-batches' gradients; ``--ema``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from retr.store.features import FeatureSet
from retr.store.vocab import Vocabulary
from retr.trainers.commands import cli
from retr.trainers.models import create_model
from retr.trainers.runs import checkpoint as ckpt
from retr.trainers.data.splits import CaptionBatches, ImageFeatures, fits_on_device, load_split
from retr.trainers.training.loop import autocast_dtype, train_step
from retr.trainers.models.losses import hinge_triplet_loss
from retr.trainers.models.optim import apply_implementation, resolve_implementation
from retr.trainers.runs.layout import CONFIG, METRICS


CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def synthetic(synthetic_data):
    """(manifest, features) of the 40-image synthetic set (shared: read-only)."""
    return synthetic_data(images=40)


# ------------------------------------------------------------------------------------------------ features

def test_features_held_on_the_device_give_the_same_batches_as_host_memory_and_the_file(synthetic):
    manifest, path = synthetic
    fs = FeatureSet(path)
    ids = list(fs.ids)[3:31]
    held = {p: ImageFeatures(fs, ids, p, device=CPU) for p in ("gpu", "host", "off")}
    assert [held[p].where for p in ("gpu", "host", "off")] == ["gpu", "host", "file"]
    assert held["gpu"]._on_device is not None and held["gpu"]._on_device[0].dtype == torch.from_numpy(
        np.zeros(1, dtype=fs.dtype)).dtype                           # held in the stored dtype
    images = np.array([5, 0, 27, 5, 13])                               # repeats and any order, as a batch has
    for as_stored in (False, True):
        got = {p: f.get(images, as_stored=as_stored) for p, f in held.items()}
        for p in ("host", "off"):
            assert torch.equal(got["gpu"][0], got[p][0]) and torch.equal(got["gpu"][1], got[p][1])
        assert got["gpu"][0].dtype == (torch.float32 if not as_stored else got["off"][0].dtype)
    assert not held["gpu"]._on_device[1].dtype.is_floating_point
    vocab = Vocabulary(["a"])
    data, _ = load_split(manifest, ["train"], vocab, fs)
    feats = ImageFeatures(fs, data.image_ids, "gpu", device=CPU)
    batch = CaptionBatches(data, feats, as_stored=True)[[0, 7, 3]]
    reference = CaptionBatches(data, ImageFeatures(fs, data.image_ids, "off"))[[0, 7, 3]]
    assert torch.equal(batch["features"].float(), reference["features"])
    assert torch.equal(batch["mask"], reference["mask"])


def test_old_preload_values_still_mean_what_they_did(synthetic, monkeypatch):
    _, path = synthetic
    fs = FeatureSet(path)
    ids = list(fs.ids)
    assert ImageFeatures(fs, ids, True).where == "host" and ImageFeatures(fs, ids, False).where == "file"
    assert ImageFeatures(fs, ids, None).where == "host"                     # small: auto preloads
    import retr.trainers.data.splits as data_module
    monkeypatch.setattr(data_module, "ALWAYS_HELD_BYTES", 0)
    monkeypatch.setattr(data_module, "host_memory_available", lambda: 0)
    assert ImageFeatures(fs, ids, "auto").where == "file"                   # no memory free: auto reads the file
    with pytest.raises(ValueError, match="preload must be one of"):
        ImageFeatures(fs, ids, "vram")
    from retr.trainers.config import TrainConfig
    assert [TrainConfig(preload=v).preload for v in (True, False, None, "gpu")] == ["host", "off", "auto", "gpu"]


def test_features_that_do_not_fit_on_the_gpu_stay_in_host_memory(synthetic, monkeypatch):
    gib = 1 << 30
    cuda = torch.device("cuda")
    assert fits_on_device(10 * gib, cuda, (60 * gib, 80 * gib))           # 50 GiB left, 20 GiB kept free
    assert not fits_on_device(45 * gib, cuda, (60 * gib, 80 * gib))       # would leave 15 GiB < 25 % of 80
    assert fits_on_device(10 ** 15, CPU)
    import retr.trainers.data.splits as data_module
    monkeypatch.setattr(data_module, "fits_on_device", lambda nbytes, device, free_and_total=None: False)
    _, path = synthetic
    fs = FeatureSet(path)
    feats = ImageFeatures(fs, list(fs.ids), "gpu", device=CPU)
    assert feats.where == "host" and "do not fit" in feats.note and feats._on_device is None


# ------------------------------------------------------------------------------------------------ optimiser

def test_auto_picks_fused_on_cuda_and_the_loop_on_the_cpu():
    p = [torch.nn.Parameter(torch.zeros(2))]
    adam, rms = torch.optim.Adam(p), torch.optim.RMSprop(p)
    cuda = torch.device("cuda")
    assert resolve_implementation("auto", adam, cuda) == "fused"
    assert resolve_implementation("auto", rms, cuda) == "foreach"            # torch has no fused RMSprop
    assert resolve_implementation("auto", adam, CPU) == "loop"
    assert resolve_implementation("fused", rms, CPU) == "foreach"
    with pytest.raises(ValueError, match="optimizer_impl must be one of"):
        resolve_implementation("fast", adam, CPU)


def _batch(size=12, k=3, d=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(size, k, dtype=torch.bool)
    mask[1, 2:] = False
    return {"features": torch.randn(size, k, d, generator=g), "mask": mask,
            "tokens": torch.randint(4, 20, (size, 6), generator=g),
            "lengths": torch.randint(2, 7, (size,), generator=g), "image_index": torch.arange(size)}


SMALL = {
    "vsepp": dict(vocab_size=20, img_dim=6, embed_size=8, word_dim=4),
    "scan": dict(vocab_size=20, img_dim=6, embed_size=8, word_dim=4),
    "sman": dict(vocab_size=20, img_dim=6, embed_size=8, word_dim=4),          # Adadelta (no fused kernel)
    "jgcar": dict(vocab_size=20, img_dim=6, embed_size=8, word_dim=4, num_regions=3, hidden_size=8),  # SGD+RMSprop
    "seam": dict(vocab_size=20, img_dim=6, embed_size=8, word_dim=4),
}


#: The models trained in float64 here. SEAM-C's convolution biases feed ReLU → BatchNorm: in a channel whose real
#: positions are all active (46 of conv3's 100 at the first step) BatchNorm removes the bias, so its true gradient
#: is exactly 0. The computed one is rounding noise of the reductions (float32: ~1e-6 after clipping), its sign set by
#: the summation order (the thread count) and by the last bits of the weights, which the implementations round
#: differently; Adam's ε (1e-8) lies far below it, so Adam turns it into steps of ±lr that differ between
#: implementations. These stay out of the loss only while the channel's every position is active: once a real update
#: clips one, the bias shifts the active positions against the clipped one and BatchNorm passes that on (float32,
#: one thread: conv3 channel 59 loses one of its 45 positions at the third step, its bias differs by 1.7e-3 between
#: loop and fused, the loss by 2.7e-4). In float64 the noise (~1e-15) lies far below ε: these steps are ~1e-9, and
#: the whole state can be compared, running means and those biases included.
FLOAT64 = {"seam"}
#: dtype → (losses rtol, atol, state rtol, atol). float32: rounding grown through three steps (~1e-6). float64
#: (measured with 1 to 4 threads): losses agree to ≤ 1e-15, the state to ~1e-15 but for the noise-only
#: biases (≤ 3e-9 apart) and the running means they shift (≤ 3e-11); a clipped channel would carry such a bias
#: difference into the loss at ~10× (the float32 case), ≤ 1e-9 of a loss of ~45. A wrong update is off by a
#: fraction of lr = 1e-2.
_TOLERANCES = {torch.float32: (1e-5, 1e-6, 1e-4, 1e-6), torch.float64: (1e-8, 0.0, 1e-7, 1e-7)}


def _trained(name: str, impl: str, steps: int = 3, switch_to: str | None = None):
    torch.manual_seed(0)
    model = create_model(name, **SMALL[name]).to(torch.float64 if name in FLOAT64 else torch.float32)
    model.max_violation = False
    optimizer = model.configure_optimizer(1e-2)
    chosen = apply_implementation(optimizer, impl, CPU)
    losses = []
    for step in range(steps):
        if switch_to and step == steps // 2:          # a resume on another implementation: state moved over
            state = optimizer.state_dict()
            optimizer = model.configure_optimizer(1e-2)
            optimizer.load_state_dict(state)
            chosen = apply_implementation(optimizer, switch_to, CPU)
        losses.append(train_step(model, _batch(seed=step), optimizer, None, 2.0, CPU))
    return model, losses, chosen


@pytest.mark.parametrize("name", sorted(SMALL))
def test_fused_foreach_and_loop_updates_agree(name):
    reference, ref_losses, chosen = _trained(name, "loop")
    assert set(chosen) == {"loop"}
    for impl in ("foreach", "fused"):
        model, losses, chosen = _trained(name, impl)
        expected = {"vsepp": ["fused"], "scan": ["fused"], "seam": ["fused"], "sman": ["foreach"],
                    "jgcar": ["fused", "foreach"]}[name] if impl == "fused" else None
        if expected:                                    # JGCAR's SGD has a fused kernel, its RMSprop does not
            assert chosen == expected
        loss_rtol, loss_atol, rtol, atol = _TOLERANCES[next(reference.parameters()).dtype]
        np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol, atol=loss_atol)
        for (key, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
            if a.is_floating_point():
                torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=f"{name} {impl} {key}")


def test_a_resume_may_switch_implementation_and_moves_the_step_counters():
    reference, ref_losses, _ = _trained("vsepp", "loop", steps=4)
    model, losses, chosen = _trained("vsepp", "loop", steps=4, switch_to="fused")
    assert chosen == ["fused"]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    torch.manual_seed(0)
    m = create_model("vsepp", **SMALL["vsepp"])
    optimizer = m.configure_optimizer(1e-2)
    apply_implementation(optimizer, "fused", CPU)
    train_step(m, _batch(), optimizer, None, 2.0, CPU)
    group = optimizer.param_groups[0]
    assert group["fused"] and not group["foreach"]
    steps = [s["step"] for s in optimizer.state.values()]
    assert all(s.dtype == torch.float32 and s.device == CPU for s in steps)
    apply_implementation(optimizer, "foreach", CPU)
    assert optimizer.param_groups[0]["foreach"] and not optimizer.param_groups[0]["fused"]
    train_step(m, _batch(seed=2), optimizer, None, 2.0, CPU)
    assert all(float(s["step"]) == 2 for s in optimizer.state.values())


# ------------------------------------------------------------------------------------------------ compile

def _losses_and_grads(model, batches):
    torch.manual_seed(5)                    # the same dropout masks for both models
    out = []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss = model(batch["features"], batch["mask"], batch["tokens"], batch["lengths"],
                     **{k: batch[k] for k in model.batch_extras})
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((float(loss.detach()), grads))
    return out


def _compare_compiled(name, backend, dtype=torch.float32):
    """Compiled and eager training scoring on the same batches and weights. In float32 the two may differ by
    rounding only: losses to 1e-5, gradients to 1e-4. In float64 (``dtype``), which no reordering of inductor's
    generated code can move by more than ~1e-13 relative here, losses and gradients to 1e-10."""
    torch.manual_seed(0)
    eager = create_model(name, **SMALL[name]).to(dtype)
    compiled = create_model(name, **SMALL[name]).to(dtype)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_scoring(backend=backend)
    eager.train()
    compiled.train()
    # three batches of other sizes and caption lengths: the second recompiles, dynamic in both, and SCAN's and
    # VSE++'s third reuses that graph (with the first two of equal size, as in an epoch, the smaller last batch
    # compiled a third time: inductor's C++ code for SCAN 13 s more, cold)
    batches = [_batch(12, seed=1), _batch(10, seed=2), _batch(7, seed=3)]
    batches[1]["tokens"] = batches[1]["tokens"][:, :4]
    batches[1]["lengths"] = batches[1]["lengths"].clamp(max=4)
    for batch in batches:
        batch["features"] = batch["features"].to(dtype)
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (1e-10, 1e-12)
    for (loss_e, grads_e), (loss_c, grads_c) in zip(_losses_and_grads(eager, batches),
                                                    _losses_and_grads(compiled, batches)):
        assert loss_c == pytest.approx(loss_e, rel=rtol, abs=atol)
        assert grads_c.keys() == grads_e.keys()
        for key in grads_e:
            torch.testing.assert_close(grads_c[key], grads_e[key], rtol=10 * rtol, atol=atol, msg=f"{name} {key}")


def test_compiled_scan_scoring_equals_eager_with_inductor():
    """The real compiler (inductor, C++ code on the CPU), compared in float64: inductor's generated code differs
    by CPU (on an AVX-512 Xeon its float32 gradients left 1e-4 of eager's), and only float64 keeps that rounding
    from deciding the test on any machine."""
    torch._dynamo.reset()
    _compare_compiled("scan", "inductor", torch.float64)


@pytest.mark.parametrize("name", ["vsepp", "sman", "jgcar", "seam"])
def test_every_models_training_scoring_compiles_and_equals_eager(name):
    """The graph capture of each model's scoring function (``aot_eager``: dynamo + autograd tracing, eager
    kernels; inductor's code generation is SCAN's test above, one compile being ~30 s on two cores)."""
    torch._dynamo.reset()
    _compare_compiled(name, "aot_eager")


@pytest.mark.parametrize("name", sorted(SMALL))
def test_scoring_compiles_into_one_graph(name):
    """No graph break: a break splits the compiled function into several graphs, each compiled on its own (SCAN's
    eager shortcut for full masks, ``bool(mask.all())``, split its scoring into four and cost inductor 13 s a run)."""
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = create_model(name, **SMALL[name]).train()
    counter = CompileCounter()
    model.compile_scoring(backend=counter)
    batch = _batch(12, seed=1)
    model(batch["features"], batch["mask"], batch["tokens"], batch["lengths"],
          **{k: batch[k] for k in model.batch_extras}).backward()
    assert counter.frame_count == len(model.compiled_functions)


def test_a_compiled_model_copies_and_saves_like_an_eager_one():
    import copy
    torch.manual_seed(0)
    model = create_model("scan", **SMALL["scan"])
    model.compile_scoring(backend="aot_eager")
    assert set(model.state_dict()) == set(create_model("scan", **SMALL["scan"]).state_dict())
    wide = copy.deepcopy(model).to(torch.float64)
    images = wide.encode_images(torch.randn(2, 3, 6, dtype=torch.float64), torch.ones(2, 3, dtype=torch.bool))
    captions = wide.encode_captions(torch.randint(4, 20, (2, 5)), torch.tensor([5, 3]))
    assert wide.score(images, captions, dtype=torch.float64).dtype == torch.float64   # evaluation stays eager


# ------------------------------------------------------------------------------------------------ the command

@pytest.mark.slow
def test_gpu_options_from_the_command_line_train_the_same_run(synthetic, run_cli, tmp_path):
    manifest, features = synthetic
    common = ["vsepp", "--features", str(features), "--manifest", str(manifest), "--embed-size", "16",
              "--word-dim", "8", "--batch-size", "16", "--epochs", "2", "--device", "cpu", "--val-images", "10",
              "--sum-violation"]
    plain = tmp_path / "plain"
    fast = tmp_path / "fast"
    run_cli("train", *common, "--out", str(plain), "--preload", "off", "--optimizer-impl", "loop")
    result = run_cli("train", *common, "--out", str(fast), "--preload", "gpu", "--optimizer-impl", "foreach",
                     "--workers", "2")
    assert "held on the device" in result.output and "optimizer foreach" in result.output
    assert "--workers is ignored" in result.output
    result = run_cli("train", *common, "--out", str(tmp_path / "bare"), "--preload", "--epochs", "1")
    assert "(preloaded)" in result.output                  # --preload alone: host memory, as before
    assert json.loads((tmp_path / "bare" / CONFIG).read_text())["preload"] == "host"
    result = run_cli("train", *common, "--out", str(tmp_path / "older"), "--no-preload", "--epochs", "1")
    assert "(read per batch)" in result.output             # the older spelling still works, hidden from --help
    assert "training features: " in result.output and "read from the file per batch with pread (as asked)" in (
        result.output)                                     # one line: where the features are, and why
    assert json.loads((tmp_path / "older" / CONFIG).read_text())["preload"] == "off"
    config = json.loads((fast / CONFIG).read_text())
    assert (config["preload"], config["optimizer_impl"], config["compile"]) == ("gpu", "foreach", "off")

    def losses(run):
        return [r["loss"] for r in map(json.loads, (run / METRICS).read_text().splitlines())
                if r.get("type") == "step"]
    assert losses(fast) and np.allclose(losses(fast), losses(plain), rtol=1e-5)
    # a resume may move the features and change the update's implementation (resume_applies)
    result = run_cli("train", "vsepp", "--out", str(fast), "--resume", "--epochs", "3", "--preload", "host",
                     "--optimizer-impl", "fused")
    assert "preloaded" in result.output and "optimizer fused" in result.output
    assert json.loads((fast / CONFIG).read_text())["optimizer_impl"] == "fused"
    # VSE++ scores a batch with one matrix product: --compile compiles nothing and says so
    result = run_cli("train", *common, "--out", str(tmp_path / "eager"), "--epochs", "1", "--compile")
    assert "nothing to compile, training runs eager" in result.output and "compiled (" not in result.output


def test_the_prefetcher_moves_the_model_inputs_and_leaves_the_extras():
    """The loop wraps its loader in common.prefetch.DevicePrefetcher with loop.to_device: on CUDA the next batch's
    copy runs on a side stream during the current step; on the CPU the same batches come out, in order."""
    from retr.common.prefetch import DevicePrefetcher
    from retr.trainers.training.loop import DEVICE_KEYS, to_device

    batches = [_batch(4, seed=s) for s in range(3)]
    for b in batches:
        b["caption_index"] = torch.arange(4)
    moved = list(DevicePrefetcher(batches, lambda b: to_device(b, CPU), CPU))
    assert len(moved) == 3
    for got, want in zip(moved, batches):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert got["caption_index"] is want["caption_index"] and set(DEVICE_KEYS) < set(got)
        assert got["lengths"] is want["lengths"]           # lengths stay on the host: models pack from them there


# ----------------------------------------------------------------------------------------------- amp, accumulation, EMA
# ``--amp bf16|fp16`` and ``--accum-steps N``. Under accumulation a negative is another pair of the
# same micro-batch; the gradient is the sum of the micro-batches' gradients.

def _amp_batch(size=8):
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
    batch = _amp_batch()
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
    loss = train_step(model, _amp_batch(), torch.optim.Adam(model.parameters()), None, 2.0, torch.device("cpu"),
                      amp="bf16")
    assert loss == loss and torch.bfloat16 in seen


@pytest.mark.slow
def test_amp_and_accum_from_the_command_line(tmp_path, synthetic):
    manifest, features = synthetic
    common = ["--features", str(features), "--manifest", str(manifest), "--embed-size", "16", "--word-dim", "8",
              "--batch-size", "16", "--epochs", "1", "--quiet", "--device", "cpu", "--val-images", "10"]
    result = CliRunner().invoke(cli, ["vsepp", *common, "--out", str(tmp_path / "a"), "--amp", "bf16",
                                      "--accum-steps", "4"])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "a" / CONFIG).read_text())
    assert config["amp"] == "bf16" and config["accum_steps"] == 4
    result = CliRunner().invoke(cli, ["vsepp", *common, "--out", str(tmp_path / "b"), "--amp"])
    assert result.exit_code == 0 and "--amp fp16 needs CUDA" in result.output
    assert json.loads((tmp_path / "b" / CONFIG).read_text())["amp"] == "fp16"
    result = CliRunner().invoke(cli, ["vsepp", *common, "--out", str(tmp_path / "c"), "--accum-steps", "3"])
    assert result.exit_code != 0 and "must divide --batch-size 16" in str(result.exception)


def test_runs_from_before_amp_modes_read_as_fp16_or_off():
    from retr.trainers.config import settings_from_stored, upgrade_stored
    from retr.trainers.models import get_spec

    spec = get_spec("vsepp")
    assert upgrade_stored(spec, {"model": "vsepp", "amp": True, "model_args": {}})["amp"] == "fp16"
    assert upgrade_stored(spec, {"model": "vsepp", "amp": False, "model_args": {}})["amp"] == "off"
    assert settings_from_stored(spec, {"model": "vsepp", "amp": True, "model_args": {}}).amp == "fp16"


@pytest.mark.slow
def test_ema_checkpoint_follows_the_weights_resumes_and_evaluates(tmp_path, synthetic):
    from retr.trainers.runs.checkpoint import load_checkpoint

    manifest, features = synthetic
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


def _progress_lines(synthetic, tmp_path, seconds: str) -> list[str]:
    """The progress lines ``retr-train vsepp`` writes to a log file (stderr redirected, as under nohup or SLURM)
    when progress is drawn every ``seconds`` seconds: 2 epochs (of 20 batches of 8 on this set)."""
    import os
    import subprocess
    import sys

    manifest, features = synthetic
    log = tmp_path / f"train-{seconds}.log"
    with open(log, "w") as stderr:
        subprocess.run([str(Path(sys.executable).parent / "retr-train"), "vsepp", "--features", str(features),
                        "--manifest", str(manifest), "--out", str(tmp_path / f"run-{seconds}"), "--embed-size", "16",
                        "--word-dim", "8", "--batch-size", "8", "--epochs", "2", "--val-images", "10",
                        "--device", "cpu"], stdout=subprocess.DEVNULL, stderr=stderr, check=True,
                       env={**os.environ, "RETR_PROGRESS_SECONDS": seconds})
    return [line for line in log.read_text().splitlines() if line.startswith("epoch ") and "batch" in line]


def test_training_progress_in_a_log_file_is_a_line_per_interval_not_per_batch(synthetic, tmp_path):
    # an interval longer than the run: no progress line at all (each batch's loss used to redraw the bar, a line a
    # batch whose counter stood at 0)
    assert _progress_lines(synthetic, tmp_path, "3600") == []
    # an interval of 0 draws every update: the bar's first line and one per batch with its counter and loss; the
    # bar closing where its last line left it says nothing more (no count twice)
    lines = _progress_lines(synthetic, tmp_path, "0")
    for epoch in (1, 2):
        counts = [tuple(map(int, re.search(r" (\d+)/(\d+) ", line).groups()))
                  for line in lines if line.startswith(f"epoch {epoch}/2")]
        total = counts[0][1]
        assert total > 1 and counts == [(n, total) for n in range(total + 1)], lines
    assert all("loss=" in line for line in lines if not re.search(r" 0/\d+ ", line)), lines


# ------------------------------------------------------------------------------------------------ start-up

def test_a_training_start_reads_the_manifest_and_tokenises_each_caption_once(tmp_path, synthetic, monkeypatch):
    """The checks before any work and the run's vocabulary, training and validation splits all come from one
    parse of the manifest and one tokenising pass over the captions of the splits it uses."""
    import retr.manifests.schema as schema
    import retr.store.vocab as vocab_module
    from retr.manifests.schema import read_manifest

    manifest, features = synthetic
    used = [c for r in read_manifest(manifest) if r.split in ("train", "restval", "val") for c in r.captions]
    tokenised, parsed = [], []
    real_tokenize, real_iter = vocab_module.tokenize, schema.iter_manifest
    monkeypatch.setattr(vocab_module, "tokenize", lambda caption: tokenised.append(caption) or real_tokenize(caption))
    monkeypatch.setattr(schema, "iter_manifest", lambda path: parsed.append(path) or real_iter(path))
    monkeypatch.setattr(schema, "_last_parsed", None)
    result = CliRunner().invoke(cli, ["vsepp", "--features", str(features), "--manifest", str(manifest),
                                      "--out", str(tmp_path / "run"), "--embed-size", "16", "--word-dim", "8",
                                      "--batch-size", "16", "--epochs", "1", "--quiet", "--device", "cpu",
                                      "--val-images", "10"])
    assert result.exit_code == 0, result.output
    assert len(parsed) == 1
    assert sorted(tokenised) == sorted(used) and len(tokenised) == len(used)
