"""Parity of retr's VSE∞ with the authors' code (woodfrog/vse_infty, bigru branch), from figures their code computed.

``tests/data/golden/vse_infinity/`` holds a seeded float32 initial state of the authors' ``VSEModel`` (BUTD-region
encoder + BiGRU text, both with GPO), stored inputs, and what their code computed from them in float64 on the CPU
(``tools/golden/vse_infinity.py``, run by hand; ``provenance.json`` names the commit and the patch). Here the state
is renamed to retr's parameters (``official_checkpoints.VSE_INFINITY_RENAMES``, the importer's), and retr's GPO, encoders, loss, and training (the loop's
``train_step``, the model's AdamW, the loop's ``StepLR`` and warm-up flag) run in float64 on the same inputs.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from golden_support import WidenFeatures, assert_relative_gap, load_golden, one_torch_thread  # noqa: F401 (a fixture)
from retr.trainers.models import create_model
from retr.trainers.models.layers import lengths_mask
from retr.trainers.training.loop import lr_schedule, train_step
from retr.trainers.models.optim import apply_implementation
from retr.trainers.runs.official_checkpoints import vse_infinity_name

PROVENANCE, INPUTS, FIGURES = load_golden("vse_infinity")
OPT = json.loads(str(INPUTS["opt_json"]))
CPU = torch.device("cpu")

#: Largest relative gap (max |retr − authors| / max |authors|) and why: the arithmetic is the same, operation by
#: operation (the positional encoding computed in float32 on both sides); what is left is float64 rounding where
#: a reduction runs in another order (packed GRU batches sorted otherwise, the gradient-norm sum, AdamW's foreach
#: kernels; AdamW's first step normalises tiny GPO gradients): measured ≤ 1e-13 with 1, 2 and 4 threads. 1e-12
#: leaves room for other BLAS builds and still catches a real change: a float64 positional encoding, a temperature
#: of 0.11, an l2norm without its 1e-8 or a weight decay of 1e-3 each fails these tests.
TOL = 1e-12
#: The bias of the MLP's first Linear feeds a batch norm, which removes it: its gradient is 0 in exact arithmetic
#: (~1e-17 of rounding on both sides, compared against the largest gradient's scale). AdamW turns that noise into
#: steps of up to lr·|g|/eps ≈ 1e-11, so after training this bias, and the batch norm's running mean that adds it,
#: differ by ~4e-10 relative; 1e-8 bounds that and is still far below any real difference in the update.
NOISE_DRIVEN = {"img_enc.mlp.0.bias": 1e-8, "img_enc.mlp.1.running_mean": 1e-8}


def assert_close(got, want, what: str, tol: float = TOL, scale: float | None = None) -> float:
    return assert_relative_gap(got, want, what, tol, scale)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Every test here on one thread (golden_support.one_torch_thread)."""


def authors_model():
    """retr's VSE∞ in float64 holding the stored initial state, size augmentation off (it is random)."""
    torch.manual_seed(0)
    model = create_model("vse-infinity", vocab_size=OPT["vocab_size"] - 1, img_dim=OPT["img_dim"],
                         embed_size=OPT["embed_size"], word_dim=OPT["word_dim"], margin=OPT["margin"],
                         drop_regions=0.0, augment_words=0.0)
    state = {vse_infinity_name(k[len("init."):]): torch.from_numpy(v) for k, v in INPUTS.items()
             if k.startswith("init.")}
    state.pop(None)
    model.load_state_dict(state, strict=True)
    return model.double()


def train_batch(b: int) -> dict:
    lengths = torch.from_numpy(INPUTS["train.lengths"][b])
    features = torch.from_numpy(INPUTS["train.images"][b])
    return {"features": features, "mask": torch.ones(features.shape[:2], dtype=torch.bool),
            "tokens": torch.from_numpy(INPUTS["train.tokens"][b])[:, :int(lengths.max())], "lengths": lengths}


def test_golden_set_is_what_the_generator_describes():
    assert PROVENANCE["repository"] == "https://github.com/woodfrog/vse_infty"
    assert PROVENANCE["commit"] == "8600f891e143bda1a33d2228999d0d4c63acd4fd"
    assert all(p["why"] for p in PROVENANCE["patches"])
    norms = FIGURES["train.grad_norm"]
    assert (norms > OPT["grad_clip"]).any() and (norms < OPT["grad_clip"]).any()
    assert len(set(FIGURES["train.lr"].tolist())) == 2 and OPT["vse_mean_warmup_epochs"] == 1
    assert sorted(set(INPUTS["gpo.lengths"].tolist())) == [1, 2, 3, 5, 7]


@pytest.mark.parametrize("side", ["image", "caption"])
def test_gpo_weights_and_pooled_vectors(side):
    """Both GPOs on a set with 1 to 7 real rows: the weights over the ranks and the pooled vectors."""
    model = authors_model()
    gpo = model.img_enc.gpool if side == "image" else model.txt_pool
    lengths = torch.from_numpy(INPUTS["gpo.lengths"])
    with torch.no_grad():
        pooled, theta, size = gpo(torch.from_numpy(INPUTS["gpo.x"]).double(), lengths_mask(lengths, 7))
    assert torch.equal(size, lengths)
    assert_close(theta, FIGURES[f"gpo.{side}.weights"], f"{side} GPO weights")
    assert_close(pooled, FIGURES[f"gpo.{side}.pooled"], f"{side} pooled vectors")


def assert_their_eval_embeddings(model, what: str) -> None:
    """``model`` (float64, eval mode) embeds the stored eval images and captions as the authors' code did."""
    counts = torch.from_numpy(INPUTS["eval.counts"])
    with torch.no_grad():
        images = model.encode_images(torch.from_numpy(INPUTS["eval.images"]).double(), lengths_mask(counts, 6))
        captions = model.encode_captions(torch.from_numpy(INPUTS["eval.tokens"]),
                                         torch.from_numpy(INPUTS["eval.lengths"]))
    assert_close(images["vector"], FIGURES["eval.img_emb"], f"{what} image embeddings")
    assert_close(captions["vector"], FIGURES["eval.cap_emb"], f"{what} caption embeddings")


def test_eval_embeddings_with_varying_set_sizes():
    """Eval mode (batch norm on its stored running statistics): images of 1 to 6 regions, captions of 3 to 9
    tokens."""
    assert_their_eval_embeddings(authors_model().eval(), "retr's")


def authors_checkpoint(folder, opt: dict | None = None, text_state: dict | None = None):
    """The stored initial state as a file in the authors' checkpoint layout (their ``save_checkpoint``:
    ``{'model': [img_enc.state_dict(), txt_enc.state_dict()], 'opt': Namespace, 'epoch', 'best_rsum'}``) and a
    vocabulary of the size their embedding was built for (one row less: their ``<mask>``)."""
    import argparse

    from retr.store.vocab import Vocabulary

    state = {k[len("init."):]: torch.from_numpy(v) for k, v in INPUTS.items() if k.startswith("init.")}
    parts = [{k[len(side):]: v for k, v in state.items() if k.startswith(side)} for side in ("img_enc.", "txt_enc.")]
    if text_state is not None:
        parts[1] = text_state
    checkpoint = folder / "model_best.pth"
    torch.save({"model": parts, "opt": argparse.Namespace(**(opt or OPT)), "epoch": 3, "best_rsum": 12.5},
               checkpoint)
    vocab = Vocabulary([f"word{i}" for i in range(OPT["vocab_size"] - 1 - 4)])      # 4 specials come first
    assert len(vocab) == OPT["vocab_size"] - 1
    return checkpoint, vocab.save(folder / "f30k_precomp_vocab.json")


def test_an_imported_authors_checkpoint_gives_their_embeddings(tmp_path, run_cli):
    """import-vse-infinity-checkpoint on a checkpoint in the authors' layout holding the state their code
    computed the figures from: the run's model gives their eval embeddings (as above)."""
    from retr.trainers.runs.checkpoint import load_run_model

    checkpoint, vocab = authors_checkpoint(tmp_path)
    run_cli("train", "import-vse-infinity-checkpoint", checkpoint, "--vocab", vocab, "--out", tmp_path / "run")
    model, _, config = load_run_model(tmp_path / "run")
    assert config["model"] == "vse-infinity" and config["model_args"]["embed_size"] == OPT["embed_size"]
    assert_their_eval_embeddings(model.double().eval(), "imported")


REFUSED = {"no-vocab": "is a BiGRU model (the authors' bigru branch): give --vocab",
           "backbone": "precomp_enc_type='backbone'",
           "unknown-field": "field(s) retr does not know: temperature=0.1",
           "no-txtnorm": "no_txtnorm=True",
           "vocabulary": "has 29 words but the checkpoint's embedding has 31 rows (1 beyond the vocabulary expected)"}


@pytest.mark.parametrize("case", list(REFUSED))
def test_checkpoints_retr_cannot_express_are_refused_in_one_line(tmp_path, run_cli, case):
    from test_pipeline_wrong_inputs import assert_one_error_line

    expected = REFUSED[case]
    opt, text_state = dict(OPT), None
    if case == "backbone":
        opt["precomp_enc_type"] = "backbone"
    elif case == "unknown-field":
        opt["temperature"] = 0.1
    elif case == "no-txtnorm":
        opt["no_txtnorm"] = True
    checkpoint, vocab = authors_checkpoint(tmp_path, opt, text_state)
    if case == "vocabulary":
        from retr.store.vocab import Vocabulary
        vocab = Vocabulary([f"word{i}" for i in range(25)]).save(tmp_path / "small_vocab.json")
    code, stdout, stderr = run_cli.as_user("train", "import-vse-infinity-checkpoint", checkpoint,
                                           *(["--vocab", vocab] if case != "no-vocab" else []),
                                           "--out", tmp_path / "run")
    assert_one_error_line(code, stdout, stderr)
    assert expected in stderr and not (tmp_path / "run").exists()


def test_loss_and_every_gradient():
    """Batch 0 in train mode: the sum-of-violations loss (the loop's warm-up flag) and the hardest-negative loss
    with every parameter's gradient."""
    model = authors_model().train()
    b = train_batch(0)
    args = (b["features"].double(), b["mask"], b["tokens"], b["lengths"])
    model.warming_up = True
    assert_close(model(*args).item(), FIGURES["loss.sum"], "loss (sum of violations)")
    model.warming_up = False
    model.zero_grad()
    loss = model(*args)
    loss.backward()
    assert_close(loss.item(), FIGURES["loss.max"], "loss (hardest negatives)")
    theirs = {vse_infinity_name(k[len("grad."):]) for k in FIGURES if k.startswith("grad.")}
    assert theirs == {n for n, _ in model.named_parameters()}
    largest = max(float(np.abs(FIGURES[k]).max()) for k in FIGURES if k.startswith("grad."))
    for key in (k for k in FIGURES if k.startswith("grad.")):   # on the largest gradient's scale: see NOISE_DRIVEN
        assert_close(dict(model.named_parameters())[vse_infinity_name(key[5:])].grad, FIGURES[key], key, scale=largest)


def test_training_steps():
    """Their ``main``/``train`` (AdamW, clip, ×0.1 at ``lr_update``, one warm-up epoch of summed violations) against
    retr's ``train_step`` with ``configure_optimizer``, ``lr_schedule`` and the loop's ``warming_up`` per epoch:
    loss, learning rate and gradient norm of every step, the whole state (batch-norm statistics too) after step 1
    and after the last."""
    model = authors_model()
    optimizer = model.configure_optimizer(OPT["learning_rate"])
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["weight_decay"] == 0.01
    apply_implementation(optimizer, "auto", CPU)
    scheduler = lr_schedule(optimizer, OPT["lr_update"])
    norms, clip = [], torch.nn.utils.clip_grad_norm_
    losses, lrs, after_first = [], [], None

    def recording_clip(params, max_norm, *a, **k):
        norms.append(float(clip(params, max_norm, *a, **k)))
        return norms[-1]
    torch.nn.utils.clip_grad_norm_ = recording_clip
    try:
        for epoch in range(OPT["num_epochs"]):
            model.warming_up = epoch < OPT["vse_mean_warmup_epochs"]          # what train_one_epoch sets
            for b in range(INPUTS["train.images"].shape[0]):
                lrs.append(optimizer.param_groups[0]["lr"])
                losses.append(train_step(WidenFeatures(model), train_batch(b), optimizer, None, OPT["grad_clip"], CPU))
                if after_first is None:
                    after_first = {k: v.clone() for k, v in model.state_dict().items()}
            scheduler.step()
    finally:
        torch.nn.utils.clip_grad_norm_ = clip
    np.testing.assert_allclose(lrs, FIGURES["train.lr"], rtol=1e-15, atol=0)
    assert_close(losses, FIGURES["train.loss"], "loss per step")
    assert_close(norms, FIGURES["train.grad_norm"], "gradient norm per step")
    for key in (k for k in FIGURES if k.startswith("trained.")):
        name = vse_infinity_name(key[len("trained."):])
        if name is None or name.endswith("num_batches_tracked"):
            continue
        tol = NOISE_DRIVEN.get(name, TOL)
        assert_close(after_first[name], FIGURES[f"step1.{key[8:]}"], f"{name} after step 1", tol)
        assert_close(model.state_dict()[name], FIGURES[key], f"{name} after {len(losses)} steps", tol)
