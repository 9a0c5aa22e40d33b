"""retr's SEAM against figures the authors' public code computed (``jwehrmann/seam-retrieval``).

The figures and the state both sides start from are in ``tests/data/golden/seam/`` (made by hand with
``tools/golden/seam.py``, which lists its patches to the authors' code in ``provenance.json``). Here the same
initial state is loaded into retr's SEAM-E, SEAM-C (``padding="authors"``) and SEAM-G, in float64, and every
figure is recomputed through retr's own paths: ``model(…)`` and ``loss.backward()`` for one training batch, the
loop's ``train_step`` (Adam, gradient-norm clip 1.0) for the steps, and the evaluator's
``SplitEmbeddings.encode`` / ``similarity_matrix`` / ``retrieval_metrics`` for the evaluation.

Tolerances (measured with OMP_NUM_THREADS=1, 2, 4). Both sides compute in float64 from the same float64 state and
float32-exact inputs; what differs is only the order of floating-point operations (BatchNorm and clip-norm
reductions, the GRU over a sorted or an unsorted batch, matmul blocking, which varies with the thread count):

* forward quantities (embeddings, scores, losses, similarity matrices): measured ≤ 7e-16 → ``RTOL``/``ATOL``
  1e-12/1e-13;
* gradients: measured ≤ 3e-14 absolute on gradients up to 40; rounding noise grows with the size of the terms
  summed, so ``atol`` is ``RTOL`` × the largest entry of that gradient;
* after the Adam steps: ≤ 1e-15, except where Adam amplifies rounding noise (:data:`ADAM_ATOL`);
* ranks and recalls: equal. The generator checks that no two scores of a row or column are closer than 1e-9
  (the smallest gap is 1.9e-6).

The smallest real difference these tests exist to catch is nine orders of magnitude above them: SEAM-C's padding
in evaluation moved the batch's longest captions by 5.4e-3, and retr's former l2norm ε (1e-8) every embedding by
1.2e-8 relative — both found by this file and fixed in ``trainers/models/seam.py``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from retr.trainers.data.splits import ImageFeatures, SplitData
from retr.trainers.evaluation.metrics import i2t_ranks, retrieval_metrics, t2i_ranks
from retr.trainers.training.loop import train_step
from retr.trainers.models import create_model
from retr.trainers.models.seam import SEAM, attention_penalty
from retr.trainers.evaluation.similarity import SplitEmbeddings, similarity_matrix
from tests.conftest import in_memory_features
from tests.golden_support import load_golden

PROVENANCE, INPUTS, FIGURES = load_golden("seam")
KINDS = ("e", "c", "g")
RTOL, ATOL = 1e-12, 1e-13
#: After the Adam steps. Adam's step is lr·m̂/(√v̂ + ε), ε = 1e-8: for an entry whose gradient is far below ε —
#: mathematically 0 and numerically rounding noise, different on each side, e.g. SEAM-C's convolution biases of
#: filters whose ReLU passes every position, which BatchNorm cancels — the step is ≈ lr·g/ε, so rounding noise
#: |δg| ≤ 3e-14 (the largest gradient difference measured) becomes a parameter difference of up to
#: steps × lr × |δg| / ε = 3 × 1e-3 × 3e-14 / 1e-8 ≈ 1e-8 (measured: 1.8e-10 on SEAM-C's conv biases, 2.5e-13
#: on its conv weights, 8.4e-12 on the BatchNorm running means that average them in, ≤ 1e-15 elsewhere). The
#: parameters move by 3e-3 in these steps, and a wrong step shows far above ADAM_ATOL (tried: no clipping moves
#: them by ≥ 3e-4, lr 1.1e-3 by ≥ 6e-4, BatchNorm momentum 0.2 the running variances by 0.2).
ADAM_ATOL = 1e-8
#: the later steps' losses see those parameters: measured ≤ 3.9e-12 on losses of ~7 (SEAM-C), ≤ 4e-15 (E, G)
LATER_LOSS_RTOL = 1e-10
SIZE = {k.split("/", 1)[1]: int(v) for k, v in INPUTS.items() if k.startswith("sizes/")}
LR, GRAD_CLIP = 1e-3, 1.0                      # the authors' train.py defaults the generator ran with

#: the authors' parameter names → retr's (first matching prefix)
RENAME = {
    "e": {"img_enc.fc.": "img_fc.", "txt_enc.attention.": "txt_enc.attention.0."},
    "g": {"img_enc.fc.": "img_fc.", "txt_enc.attention.": "txt_enc.attention.0."},
    "c": {"img_enc.fc.": "img_fc.", "txt_enc.conv1.conv.conv.": "txt_enc.conv2.",
          "txt_enc.conv1.conv.bn.": "txt_enc.bn2.", "txt_enc.conv2.conv.conv.": "txt_enc.conv3.",
          "txt_enc.conv2.conv.bn.": "txt_enc.bn3.", "txt_enc.att_conv1.": "txt_enc.attention.0.",
          "txt_enc.att_conv2.": "txt_enc.attention.1.", "txt_enc.att_emb.": "txt_enc.attention.2."},
}


def retr_name(kind: str, name: str) -> str:
    for old, new in RENAME[kind].items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def authors_state(kind: str, where: str) -> dict[str, torch.Tensor]:
    """The authors' model state ``where`` = ``init`` (inputs) or ``steps`` (figures), under retr's names."""
    source = INPUTS if where == "init" else FIGURES
    prefix = f"{kind}/{where}/"
    return {retr_name(kind, k[len(prefix):]): torch.from_numpy(v.copy()) for k, v in source.items()
            if k.startswith(prefix) and k != f"{kind}/steps/loss"}


def build(kind: str, where: str = "init") -> SEAM:
    """retr's SEAM with the authors' settings and state, float64."""
    model = create_model("seam", vocab_size=SIZE["vocab_size"], img_dim=SIZE["img_dim"], text_encoder=kind,
                 embed_size=SIZE["embed_size"], word_dim=SIZE["word_dim"], hops=SIZE["att_hops"],
                 attention_hidden=SIZE["att_units"], conv_filters=SIZE["conv_filters"],
                 gru_size=SIZE["embed_size"],            # the public code's GRU is embed_size wide (generator)
                 penalty_weight=0.0,                     # the public code never adds the penalty
                 padding="authors" if kind == "c" else "masked", margin=0.05, max_violation=False).double()
    state = authors_state(kind, where)
    assert set(state) == set(model.state_dict()), "the authors' and retr's parameters must pair one to one"
    model.load_state_dict(state)
    return model


def close(got, want, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    got = got.detach().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def train_batch(step: int) -> dict[str, torch.Tensor]:
    n = int(INPUTS["train/lengths"][step].max())
    features = torch.from_numpy(INPUTS["train/features"][INPUTS["train/image"][step]])
    return {"features": features, "mask": torch.ones(features.shape[:2], dtype=torch.bool),
            "tokens": torch.from_numpy(INPUTS["train/tokens"][step, :, :n]),
            "lengths": torch.from_numpy(INPUTS["train/lengths"][step])}


def eval_split() -> tuple[SplitData, ImageFeatures]:
    """The stored eval split; its crops as an in-memory feature set (float32, as the stores hand them over)."""
    tokens = [list(map(int, t[:n])) for t, n in zip(INPUTS["eval/tokens"], INPUTS["eval/lengths"])]
    images = INPUTS["eval/features"]
    data = SplitData([f"i{j}" for j in range(len(images))], [f"c{m}" for m in range(len(tokens))],
                     INPUTS["eval/caption_image"], tokens)
    return data, in_memory_features(images)


def test_provenance_names_the_authors_commit_and_every_patch_with_its_reason():
    assert PROVENANCE["repository"].endswith("jwehrmann/seam-retrieval")
    assert len(PROVENANCE["commit"]) == 40
    assert PROVENANCE["patches"] and all(p["why"] and p["path"] for p in PROVENANCE["patches"])


@pytest.mark.parametrize("kind", KINDS)
def test_one_training_batch_embeddings_scores_loss_and_gradients(kind):
    model = build(kind).train()
    batch = train_batch(0)
    images = model.encode_images(batch["features"], batch["mask"])["vector"]
    captions = model.encode_captions(batch["tokens"], batch["lengths"])["vector"]
    close(images, FIGURES[f"{kind}/train/img_emb"], "image embeddings")
    close(captions, FIGURES[f"{kind}/train/cap_emb"], "caption embeddings")
    close(model.score({"vector": images}, {"vector": captions}), FIGURES[f"{kind}/train/scores"], "scores")

    model = build(kind).train()                        # a fresh copy: the encoding above moved BatchNorm's stats
    loss = model(batch["features"], batch["mask"], batch["tokens"], batch["lengths"])
    close(loss, FIGURES[f"{kind}/train/loss"], "loss")
    loss.backward()
    for name, p in model.named_parameters():
        authors = next(k for k in FIGURES if k.startswith(f"{kind}/grad/")
                       and retr_name(kind, k.split("/", 2)[2]) == name)
        want = FIGURES[authors]            # rounding noise scales with the gradient's size: atol relative to it
        close(p.grad, want, f"gradient of {name}", atol=RTOL * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("kind", KINDS)
def test_training_steps_through_the_loop_step(kind):
    model = build(kind)
    optimizer = model.configure_optimizer(LR)
    losses = [train_step(model, train_batch(step), optimizer, None, GRAD_CLIP, torch.device("cpu"))
              for step in range(SIZE["steps"])]
    close(losses[0], FIGURES[f"{kind}/steps/loss"][0], "loss of the first step")
    close(losses[1:], FIGURES[f"{kind}/steps/loss"][1:], "loss per later step",
          rtol=LATER_LOSS_RTOL)
    after = authors_state(kind, "steps")
    for name, value in model.state_dict().items():
        close(value, after[name].numpy(), f"{name} after {SIZE['steps']} steps", atol=ADAM_ATOL)


@pytest.mark.parametrize("where,prefix", [("init", "eval"), ("steps", "eval_trained")])
@pytest.mark.parametrize("kind", KINDS)
def test_evaluation_embeddings_matrix_ranks_and_recalls(kind, where, prefix):
    model = build(kind, where).eval()
    data, features = eval_split()
    batch = SIZE["batch_size"]                          # the authors evaluate in batches of --batch_size
    embeddings = SplitEmbeddings.encode(model, data, features, batch_size=batch, quiet=True)
    captions = np.zeros((data.num_captions, SIZE["embed_size"]))
    for idx, block in embeddings.caption_blocks:
        captions[idx] = block["vector"].numpy()
    close(embeddings.images["vector"], FIGURES[f"{kind}/{prefix}/img_emb"], "image embeddings")
    close(captions, FIGURES[f"{kind}/{prefix}/cap_emb"], "caption embeddings")
    sims = similarity_matrix(model, data, features, precision="float64", encode_batch=batch, quiet=True)
    close(sims, FIGURES[f"{kind}/{prefix}/sims"], "similarity matrix")
    np.testing.assert_array_equal(i2t_ranks(sims, data.caption_image), FIGURES[f"{kind}/{prefix}/i2t_ranks"])
    np.testing.assert_array_equal(t2i_ranks(sims, data.caption_image), FIGURES[f"{kind}/{prefix}/t2i_ranks"])
    metrics = retrieval_metrics(sims, data.caption_image)
    for direction in ("i2t", "t2i"):
        got = [metrics[direction][k] for k in ("r1", "r5", "r10", "medr", "meanr")]
        close(got, FIGURES[f"{kind}/{prefix}/{direction}"], f"{direction} R@1/5/10, medr, meanr")


@pytest.mark.parametrize("kind", ["e", "g"])
def test_plain_penalty_is_the_authors_unused_frobenius_term(kind):
    """``penalty_norm="plain"``: the batch mean of ‖AAᵀ − I‖_F, which the public code computes as
    ``Frobenius`` (in a branch that never runs for seam-*; the generator calls it directly). Their ``+ 1e-10``
    under the root moves the value by 1e-10 / (2·‖AAᵀ − I‖_F): measured 2.3e-11 relative, hence rtol 1e-9."""
    model = build(kind).train()
    batch = train_batch(0)
    attention = model.encode_captions(batch["tokens"], batch["lengths"])["attention"]
    close(attention_penalty(attention, squared=False).mean(), FIGURES[f"{kind}/train/frobenius"],
          "the authors' Frobenius", rtol=1e-9)
