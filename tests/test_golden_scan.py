"""Parity with the authors' SCAN code (kuanghuei/SCAN) through stored figures (``tests/data/golden/scan/``).

``tools/golden/scan.py`` ran the authors' code — patched only so that it runs on Python 3 and torch 2.x (the
patches and their reasons are in ``provenance.json``) — in float64 on the CPU, from a small seeded initial state
and stored batches. Here the same state enters retr the way a user's official checkpoint does: written as their
``model_best.pth.tar`` (``{'model': [img_enc, txt_enc], 'opt': Namespace, …}``) and turned into a run by
``import_scan_checkpoint``, whose option mapping (direction, aggregation, λs, bi-GRU, margin, hardest negatives)
is then what decides every number below. The model is cast to float64 after the import (the stored states are
float32 values, so the importer's float32 model holds them exactly).

Compared, for t-i LSE, t-i AVG, i-t LSE and i-t AVG (the figures' docstring in the generator says what each is):

* the similarity matrix of the 40-image / 200-caption split through retr's evaluator (``similarity_matrix``,
  float64) against their ``encode_data`` + ``shard_xattn_*``;
* R@1/5/10, medr, meanr of three protocols (whole split, first fold, mean over five folds) through
  ``protocol_metrics``, from their matrices and from retr's, and of the ensemble of a t-i and an i-t model
  (``combined_matrix``);
* ``ContrastiveLoss(max_violation=True)``'s value and every parameter's gradient on one batch;
* 16 steps of ``train_step`` (Adam, grad-norm clip 2.0, all 16 steps clipped) with the loop's ``StepLR``
  stepped once per epoch, against their ``train``/``train_emb`` with ``adjust_learning_rate``: the loss and
  learning rate of every step and the parameters at the end.

Tolerances: both sides run float64 with the same operations in a different order (retr scores a block at once with
a Gram-matrix form of the attended vector and a max-subtracted logsumexp; the authors loop over captions and form
every attended vector), so their results differ by rounding only: a few units of 1e-16 per operation. Measured
(OMP_NUM_THREADS 1, 2 and 4 alike): scores ≤ 3.4e-15, losses ≤ 9e-16, gradients (up to 8 in size) ≤ 1.2e-14.
``SCORE_TOL`` = 1e-12 leaves a factor of ~100 for other BLAS builds and CPUs, and is still 1e4–1e5 times below
float32 rounding of these numbers and 1e5 below the smallest gap between two scores a rank depends on (4.7e-7); any
change to the arithmetic — an ε, a normalisation axis, λ, the aggregation — fails it (a 1e-8 → 1e-7 ε moves scores
by ~2e-8). Recalls are exact (ratios of integer counts: ranks do not move at that distance from a tie). Training
compounds rounding over 16 Adam steps (Adam divides by √v, so a relative gradient error passes into the update and
adds up, and the loss of ~6 is a sum of 20 hinges): measured parameters ≤ 3.2e-14, losses ≤ 1.2e-12; ``TRAIN_TOL``
= 1e-10 leaves ~100×, while a 1 % change of the clip threshold already moves the losses by ~8e-6.
"""
from __future__ import annotations

import argparse
import copy
import json
from collections import OrderedDict

import numpy as np
import pytest
import torch

from golden_support import GOLDEN, load_golden
from retr.store.vocab import Vocabulary
from retr.trainers.runs.checkpoint import load_run_model
from retr.trainers.data.splits import ImageFeatures, SplitData
from retr.trainers.evaluation.metrics import protocol_metrics
from retr.trainers.training.loop import lr_schedule, train_step
from retr.trainers.models.optim import apply_implementation
from retr.trainers.runs.official_checkpoints import import_scan_checkpoint
from retr.trainers.evaluation.similarity import Scorer, SplitEmbeddings, combined_matrix, similarity_matrix

SETTINGS = ("t2i_lse", "t2i_avg", "i2t_lse", "i2t_avg")
ENSEMBLE = ("t2i_lse", "i2t_lse")        # the paper's ensemble: a t-i and an i-t model, matrices averaged
TRAINED = ("t2i_lse", "i2t_avg")
#: float64 vs float64 in another operation order (module docstring): rounding only, measured ≤ 1.2e-14
SCORE_TOL = 1e-12
#: 16 Adam steps compound the rounding (module docstring): measured ≤ 1.2e-12 (losses), 3.2e-14 (parameters)
TRAIN_TOL = 1e-10
#: recalls are ratios of counts, medr/meanr means of integer ranks: equal up to the last bit of a mean
RECALL_TOL = 1e-12
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def golden():
    return load_golden("scan")


def _config(inputs: dict, name: str) -> dict:
    return json.loads(str(inputs[f"config.{name}"]))


@pytest.fixture(scope="module")
def imported(golden, tmp_path_factory) -> dict:
    """Each setting's model, imported from an official-format checkpoint of the stored state, in float64."""
    _, inputs, _ = golden
    folder = tmp_path_factory.mktemp("official")
    vocab_path = folder / "precomp_vocab.json"
    Vocabulary([f"w{i}" for i in range(4, _config(inputs, SETTINGS[0])["opt"]["vocab_size"])]).save(vocab_path)
    models = {}
    for name in SETTINGS:
        config = _config(inputs, name)
        state = config["state"]
        encoders = [OrderedDict((key[len(f"state.{state}.{part}."):], torch.from_numpy(inputs[key]))
                                for key in inputs if key.startswith(f"state.{state}.{part}."))
                    for part in ("img_enc", "txt_enc")]
        checkpoint = folder / f"{name}.pth.tar"
        torch.save({"epoch": 0, "model": encoders, "best_rsum": 0.0, "opt": argparse.Namespace(**config["opt"]),
                    "Eiters": 0}, checkpoint)
        import_scan_checkpoint(checkpoint, vocab_path, folder / name)
        model, _, _ = load_run_model(folder / name)
        models[name] = model.double().eval()
    return models


class _Float64Features(ImageFeatures):
    """The stored rows, served in float64: ``ImageFeatures.get`` serves float32 (the encoders then run in float32,
    as retr's evaluator and the authors' ``evalrank`` both do in practice); the figures are float64 throughout.
    The stored values are float32, so the cast is exact."""

    def __init__(self, array: np.ndarray):
        self._memory, self.feature_shape = array, array.shape[1:]
        self.rows = np.arange(len(array))
        self.num_boxes = np.full(len(array), array.shape[1], dtype=np.int64)

    def get(self, images, as_stored: bool = False):
        features, mask = super().get(images, as_stored=True)
        return features.double(), mask


def _split(inputs: dict) -> tuple[SplitData, _Float64Features]:
    tokens = [row[:length].tolist() for row, length in zip(inputs["eval.tokens"], inputs["eval.lengths"])]
    data = SplitData([f"img{i}" for i in range(len(inputs["eval.features"]))],
                     [" ".join(map(str, t)) for t in tokens], inputs["eval.caption_image"].astype(np.int64), tokens)
    return data, _Float64Features(inputs["eval.features"])


@pytest.fixture(scope="module")
def retr_sims(golden, imported) -> dict:
    """retr's float64 similarity matrix of every setting, and of the ensemble."""
    _, inputs, _ = golden
    data, features = _split(inputs)
    sims = {name: similarity_matrix(imported[name], data, features, precision="float64", quiet=True)
            for name in SETTINGS}
    scorers = [Scorer(imported[name], SplitEmbeddings.encode(imported[name], data, features, quiet=True))
               for name in ENSEMBLE]
    sims["ensemble"] = combined_matrix(scorers, "float64", data.caption_image)
    return sims


def _batch(inputs: dict, step: int) -> dict:
    """Training batch ``step`` as the loop hands it to ``train_step`` (stored features are float32)."""
    images = inputs["train.images"][step]
    lengths = torch.from_numpy(inputs["train.lengths"][step])
    features = torch.from_numpy(inputs["train.pool"][images])
    return {"features": features, "mask": torch.ones(features.shape[:2], dtype=torch.bool),
            "tokens": torch.from_numpy(inputs["train.tokens"][step][:, :int(lengths.max())]), "lengths": lengths}


def _metric_rows(result: dict) -> tuple[np.ndarray, np.ndarray]:
    keys = ("r1", "r5", "r10", "medr", "meanr")
    return (np.array([result["i2t"][k] for k in keys]), np.array([result["t2i"][k] for k in keys]))


# ------------------------------------------------------------------------------------------------ the set

def test_golden_set_is_plain_small_and_traceable(golden):
    provenance, inputs, figures = golden
    assert provenance["repository"] == "https://github.com/kuanghuei/SCAN"
    assert len(provenance["commit"]) == 40 and provenance["patches"]
    assert all(p["why"] for p in provenance["patches"])
    assert sum(f.stat().st_size for f in (GOLDEN / "scan").iterdir()) < 1 << 20
    assert {f"sims.{n}" for n in SETTINGS} <= set(figures)


@pytest.mark.parametrize("name", SETTINGS)
def test_importer_maps_the_authors_options_and_state(golden, imported, name):
    _, inputs, _ = golden
    config = _config(inputs, name)
    opt, model = config["opt"], imported[name]
    assert (model.direction, model.agg, model.norm) == (opt["cross_attn"],
                                                        {"LogSumExp": "lse", "Mean": "avg"}[opt["agg_func"]],
                                                        opt["raw_feature_norm"])
    assert (model.lambda_softmax, model.lambda_lse) == (opt["lambda_softmax"], opt["lambda_lse"])
    assert (model.margin, model.max_violation, model.txt_enc.bidirectional) == (opt["margin"], True, True)
    state = {k: v for k, v in model.state_dict().items()}
    stored = {k[len(f"state.{config['state']}."):]: v for k, v in inputs.items()
              if k.startswith(f"state.{config['state']}.")}
    assert set(state) == set(stored)
    for key, value in stored.items():
        assert torch.equal(state[key], torch.from_numpy(value).double()), key


# ------------------------------------------------------------------------------------------------ evaluation

@pytest.mark.parametrize("name", SETTINGS)
def test_similarity_matrix_matches_the_authors(golden, retr_sims, name):
    _, _, figures = golden
    ours, theirs = retr_sims[name], figures[f"sims.{name}"]
    assert ours.shape == theirs.shape == (40, 200)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=SCORE_TOL)


def test_ensemble_matrix_is_the_mean_of_the_authors_matrices(golden, retr_sims):
    _, _, figures = golden
    theirs = (figures[f"sims.{ENSEMBLE[0]}"] + figures[f"sims.{ENSEMBLE[1]}"]) / 2
    np.testing.assert_allclose(retr_sims["ensemble"], theirs, rtol=0, atol=SCORE_TOL)


@pytest.mark.parametrize("ties", ["pessimistic", "official"])
@pytest.mark.parametrize("source", ["authors", "retr"])
@pytest.mark.parametrize("name", [*SETTINGS, "ensemble"])
def test_recalls_match_the_authors_protocols(golden, retr_sims, name, source, ties):
    """From the authors' matrix (retr's metrics alone) and from retr's (end to end); no score is near a tie
    (the nearest is 4.7e-7 away), so both tie rules give the authors' ranks."""
    _, inputs, figures = golden
    data, _ = _split(inputs)
    if source == "retr":
        sims = retr_sims[name]
    elif name == "ensemble":
        sims = (figures[f"sims.{ENSEMBLE[0]}"] + figures[f"sims.{ENSEMBLE[1]}"]) / 2
    else:
        sims = figures[f"sims.{name}"]
    prefix = f"recall.{name}"
    whole = protocol_metrics(sims, data, "f30k-1k", allow_size_mismatch=True, ties=ties)
    first = protocol_metrics(sims, data, "coco-1k-first", allow_size_mismatch=True, ties=ties)
    folds = protocol_metrics(sims, data, "coco-1k", allow_size_mismatch=True, ties=ties)
    for result, key in ((whole, "1k"), (first, "first")):
        i2t, t2i = _metric_rows(result)
        np.testing.assert_allclose(i2t, figures[f"{prefix}.{key}.i2t"], rtol=0, atol=RECALL_TOL)
        np.testing.assert_allclose(t2i, figures[f"{prefix}.{key}.t2i"], rtol=0, atol=RECALL_TOL)
    mean = figures[f"{prefix}.fold5"]              # their mean_metrics: r[5], ri[5], ar, ari, rsum
    i2t, t2i = _metric_rows(folds)
    np.testing.assert_allclose(i2t, mean[:5], rtol=0, atol=RECALL_TOL)
    np.testing.assert_allclose(t2i, mean[5:10], rtol=0, atol=RECALL_TOL)
    assert folds["rsum"] == pytest.approx(mean[12], abs=RECALL_TOL)   # the true sum, not their printed 6 × ar
    assert whole["rsum"] == pytest.approx(sum(figures[f"{prefix}.1k.{d}"][:3].sum() for d in ("i2t", "t2i")),
                                          abs=RECALL_TOL)


@pytest.mark.parametrize("name", [*SETTINGS, "ensemble"])
def test_refined_precision_gives_the_authors_recalls(golden, imported, name):
    """The default precision (float32 pass, float64 for every rank-deciding pair) ranks as float64 does."""
    _, inputs, figures = golden
    data, features = _split(inputs)
    members = ENSEMBLE if name == "ensemble" else (name,)
    scorers = [Scorer(imported[m], SplitEmbeddings.encode(imported[m], data, features, quiet=True)) for m in members]
    sims = combined_matrix(scorers, "refined", data.caption_image)
    i2t, t2i = _metric_rows(protocol_metrics(sims, data, "f30k-1k", allow_size_mismatch=True))
    np.testing.assert_allclose(i2t, figures[f"recall.{name}.1k.i2t"], rtol=0, atol=RECALL_TOL)
    np.testing.assert_allclose(t2i, figures[f"recall.{name}.1k.t2i"], rtol=0, atol=RECALL_TOL)


# ------------------------------------------------------------------------------------------------ training

@pytest.mark.parametrize("name", SETTINGS)
def test_hardest_negative_loss_and_gradients_match(golden, imported, name):
    _, inputs, figures = golden
    model = copy.deepcopy(imported[name]).train()
    batch = _batch(inputs, 0)
    loss = model(batch["features"].double(), batch["mask"], batch["tokens"], batch["lengths"])
    loss.backward()
    assert loss.item() == pytest.approx(float(figures[f"loss.{name}"]), rel=0, abs=SCORE_TOL)
    grads = {k: p.grad for k, p in model.named_parameters()}
    assert set(grads) == {k[len(f"grad.{name}."):] for k in figures if k.startswith(f"grad.{name}.")}
    for key, grad in grads.items():
        np.testing.assert_allclose(grad.numpy(), figures[f"grad.{name}.{key}"], rtol=0, atol=SCORE_TOL,
                                   err_msg=key)


class _Float64Inputs(torch.nn.Module):
    """``train_step`` hands the model float32 features (``.float()``: the loader may serve float16); this passes
    them on in float64 to the float64 model. Everything else of the step — zero_grad, forward, backward, the
    gradient-norm clip over all parameters, the optimiser step — is ``train_step``'s."""

    batch_extras: tuple[str, ...] = ()

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, features, mask, tokens, lengths, gather=None):
        return self.model(features.double(), mask, tokens, lengths, gather=gather)


@pytest.mark.parametrize("name", TRAINED)
def test_training_steps_match_the_authors_loop(golden, imported, name):
    """``train_step`` per batch and the learning-rate schedule the loop builds (``build_run``: ``StepLR`` with
    ``step_size=lr_update``, ``gamma=0.1``, stepped after each epoch by ``save_epoch``), against their
    ``adjust_learning_rate`` before each epoch and ``train_emb`` per batch."""
    _, inputs, figures = golden
    opt = _config(inputs, name)["opt"]
    model = copy.deepcopy(imported[name])
    optimizer = model.configure_optimizer(opt["learning_rate"])
    apply_implementation(optimizer, "auto", CPU)
    scheduler = lr_schedule(optimizer, opt["lr_update"])           # what build_run uses
    net = _Float64Inputs(model)
    epochs = inputs["train.epoch"]
    losses, rates = [], []
    for step, epoch in enumerate(epochs):
        rates.append(optimizer.param_groups[0]["lr"])
        losses.append(train_step(net, _batch(inputs, step), optimizer, None, opt["grad_clip"], CPU))
        if step + 1 == len(epochs) or epochs[step + 1] != epoch:
            scheduler.step()
    np.testing.assert_allclose(rates, figures[f"train.{name}.lr"], rtol=1e-15, atol=0)
    np.testing.assert_allclose(losses, figures[f"train.{name}.loss"], rtol=0, atol=TRAIN_TOL)
    params = dict(model.named_parameters())
    assert set(params) == {k[len(f"train.{name}.param."):] for k in figures if k.startswith(f"train.{name}.param.")}
    for key, value in params.items():
        np.testing.assert_allclose(value.detach().numpy(), figures[f"train.{name}.param.{key}"], rtol=0,
                                   atol=TRAIN_TOL, err_msg=key)
