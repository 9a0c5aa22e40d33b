"""Operators dispatched (retr.common.op_count): what a GPU would launch, counted on any machine, one JSON line each
with its baseline counted in the same run.

* ``scoring`` — SCAN's similarity matrix of ``--images`` × ``--captions`` (36 regions, captions of 3–12 words) as
  ``retr-train eval`` scores it, at each precision, with the CPU's block sizes and with a GPU's (no chunking
  inside a score call, blocks sized to 40 GB of free memory); baseline: the authors' evaluation loop (per caption,
  blocks of 128 images, attended vectors formed: bench/eval.py's ``baseline``) on the same embeddings.
* ``train`` — one training step (forward, backward, optimiser) of each model at batch ``--batch`` on random data
  with the GPU's chunk budgets, counted as CUDA runs it: the optimiser implementation ``--optimizer-impl auto``
  picks there (fused or foreach) and each GRU/LSTM as one cuDNN call each way (a CPU's RNN kernels dispatch a
  dozen operators a time step; ``cpu_ops`` is that plain count); baseline: the same step with one optimiser
  update per parameter (the authors' style). And JGCAR's co-attentive term alone (the step with β = 0.5 minus the
  step with β = 1); baseline: the same co-attention logits written as one autograd expression (the
  ``[B, N, B, l]`` tanh formed and kept for backward).

    .venv/bin/python bench/ops.py [--images 1000 --captions 200 --dim 64 --batch 128]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval import baseline, embeddings  # noqa: E402  (bench/eval.py: the authors' loop, SCAN's encoder outputs)
from gpu import smfea_side_inputs  # noqa: E402  (bench/gpu.py: SMFEA's side data of the real shapes)

from retr.common.op_count import OpCounter, count_ops  # noqa: E402
from retr.trainers.evaluation.similarity import Scorer, combined_matrix, gpu_image_block, gpu_pair_budget  # noqa: E402
from retr.trainers.models import create_model  # noqa: E402
from retr.trainers.training.loop import train_step  # noqa: E402


def _batch(batch: int, regions: int, dim: int, seed: int = 0) -> dict:
    """A training batch as the loop hands it over: random features, captions of 8–16 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 17, (batch,), generator=g)
    return {"features": torch.rand(batch, regions, dim, generator=g),
            "mask": torch.ones(batch, regions, dtype=torch.bool),
            "tokens": torch.randint(4, 60, (batch, int(lengths.max())), generator=g), "lengths": lengths,
            "image_index": torch.arange(batch), "caption_index": torch.arange(batch)}


def _step_ops(model, batch: dict, implementation: str = "", as_on_cuda: bool = False) -> OpCounter:
    """Operators of one ``train_step`` (after a warm-up step that makes the optimiser's state), with the optimiser
    implementation ``implementation`` resolves to on CUDA ("": torch's default on this machine); ``as_on_cuda``
    counts each recurrent layer as one cuDNN call each way."""
    from retr.trainers.models.optim import apply_implementation
    optimizer = model.configure_optimizer(1e-4)
    if implementation:
        apply_implementation(optimizer, implementation, torch.device("cuda"))
    train_step(model, batch, optimizer, None, 2.0, torch.device("cpu"))
    with OpCounter(rnn_as_library_call=as_on_cuda) as counter:
        train_step(model, batch, optimizer, None, 2.0, torch.device("cpu"))
    return counter


def scoring(n_img: int, n_cap: int, dim: int) -> list[dict]:
    import retr.trainers.models.scan as xattn
    g = torch.Generator().manual_seed(0)
    norm = torch.nn.functional.normalize
    images = norm(torch.randn(n_img, 36, dim, generator=g), dim=-1)
    words = [norm(torch.randn(int(n), dim, generator=g), dim=-1) for n in torch.randint(3, 13, (n_cap,), generator=g)]
    split = embeddings(images, words)
    owner = np.arange(n_cap) // 5 * 7 % n_img
    records = []
    for direction in ("t2i", "i2t"):
        model = create_model("scan", vocab_size=8, img_dim=8, embed_size=8, word_dim=8, direction=direction,
                             agg="lse", lambda_softmax=9.0 if direction == "t2i" else 4.0).eval()
        base, _ = count_ops(baseline, images, words, direction, model.lambda_softmax, 6.0)
        for policy in ("cpu", "gpu"):
            kwargs, restore = {}, xattn.default_chunk_elements
            if policy == "gpu":
                budget = gpu_pair_budget(40 << 30, 16 * 36 * 12)
                kwargs = {"image_block": gpu_image_block(budget, 128), "pair_budget": budget}
                xattn.default_chunk_elements = lambda device: None
            try:
                for precision in ("float32", "float64", "refined"):
                    ops, _ = count_ops(combined_matrix, [Scorer(model, split)], precision, owner, **kwargs)
                    records.append({"bench": "ops", "stage": "scoring", "model": f"scan {direction} lse",
                                    "images": n_img, "captions": n_cap, "block_policy": policy,
                                    "precision": precision, "ops": ops.total, "launching": ops.launching,
                                    "host_syncs": ops.host_syncs, "ops_per_caption": round(ops.total / n_cap, 2),
                                    "baseline": {"what": "authors' loop: per caption, 128-image blocks",
                                                 "ops": base.total,
                                                 "ops_per_caption": round(base.total / n_cap, 2)}})
            finally:
                xattn.default_chunk_elements = restore
    return records


#: each model's features in the training counts ([K, D]: D small, the counts do not depend on it) and settings
TRAIN_SHAPES = {"vsepp": (36, 32), "scan": (36, 32), "seam": (10, 32), "sman": (49, 32), "jgcar": (49, 32),
                "smfea": (36, 32), "vse-infinity": (36, 32)}
TRAIN_SETTINGS = {"seam": {"text_encoder": "c"}, "jgcar": {"num_regions": 49, "hidden_size": 64, "dropout": 0.0}}


def _training_model(name: str, batch: int):
    """``name`` at its published settings but small sizes, with SMFEA's side tensors (the shapes load_smfea_inputs
    gives); seeded, so that every count of a model sees the same model."""
    torch.manual_seed(0)
    k, d = TRAIN_SHAPES[name]
    settings = {"embed_size": 32, "word_dim": 16, **TRAIN_SETTINGS.get(name, {})}
    if name != "smfea":
        return create_model(name, vocab_size=64, img_dim=d, **settings)
    sizes, tensors = smfea_side_inputs(64, batch)
    model = create_model(name, vocab_size=64, img_dim=d, **sizes, **settings)
    model.prepare_training(tensors)
    return model


def training(batch: int) -> list[dict]:
    import retr.trainers.models.jgcar as jgcar
    records = []
    jgcar.CPU_CHUNK_ELEMENTS, saved = jgcar.GPU_CHUNK_ELEMENTS, jgcar.CPU_CHUNK_ELEMENTS
    try:
        for name in TRAIN_SHAPES:
            k, d = TRAIN_SHAPES[name]
            step = _batch(batch, k, d)
            cuda = _step_ops(_training_model(name, batch), step, "auto", as_on_cuda=True)
            loop = _step_ops(_training_model(name, batch), step, "loop", as_on_cuda=True)
            cpu = _step_ops(_training_model(name, batch), step)
            records.append({"bench": "ops", "stage": "train", "model": name, "batch": batch, "features": [k, d],
                            "counted": "as on CUDA: --optimizer-impl auto there, each RNN one cuDNN call each way",
                            "ops": cuda.total, "launching": cuda.launching, "host_syncs": cuda.host_syncs,
                            "cpu_ops": cpu.total,
                            "baseline": {"what": "the same, one optimiser update per parameter (the authors' loop)",
                                         "ops": loop.total, "launching": loop.launching}})
        totals = {}
        for beta in (0.5, 1.0):
            torch.manual_seed(0)
            model = create_model("jgcar", beta=beta, vocab_size=64, img_dim=32, embed_size=32, word_dim=16,
                                 **TRAIN_SETTINGS["jgcar"])
            totals[beta] = _step_ops(model, _batch(batch, 49, 32)).total
        g = torch.Generator().manual_seed(0)
        a = torch.randn(batch, 49, 32, generator=g, requires_grad=True)
        b = torch.randn(batch, 32, 64, generator=g, requires_grad=True)
        w = torch.randn(batch, 49, 64, generator=g, requires_grad=True)
        direct, _ = count_ops(lambda: (torch.tanh(torch.einsum("pmd,cdl->pmcl", a, b)) * w.unsqueeze(2))
                              .sum(-1).sum().backward())
        ours, _ = count_ops(lambda: jgcar.TanhContraction.apply(a, b, w).sum().backward())
    finally:
        jgcar.CPU_CHUNK_ELEMENTS = saved
    records.append({"bench": "ops", "stage": "train", "model": "jgcar co-attention", "batch": batch,
                    "co_attention_ops": totals[0.5] - totals[1.0], "one_side_logits_fwd_bwd_ops": ours.total,
                    "baseline": {"what": "one side's logits as one autograd expression ([B, N, B, l] tanh kept)",
                                 "one_side_logits_fwd_bwd_ops": direct.total}})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--captions", type=int, default=200)
    parser.add_argument("--dim", type=int, default=64, help="embedding size (op counts do not depend on it)")
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    for record in scoring(args.images, args.captions, args.dim) + training(args.batch):
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
