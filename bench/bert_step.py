"""A training step of VSE∞ with the BERT text encoder against the BiGRU one: CPU time and operators dispatched, one
JSON line for BERT with the BiGRU step measured in the same run as its baseline.

Both models at the authors' published sizes (joint space 1024; BiGRU: 300-d words, a 10,000-word vocabulary;
BERT: bert-base-uncased's configuration, transformers' defaults, with random weights: nothing is downloaded and the
arithmetic is the pretrained model's), batch ``--batch`` (128, the authors') of 36 × 2048 region features and
captions of 8–16 tokens (BERT's pieces: ``[CLS]`` and ``[SEP]`` included), the optimiser the model configures
(AdamW; BERT's parameters in their own group), gradient clip 2.0, through the loop's ``train_step``:

* ``seconds_per_step`` — the median of ``--steps`` timed steps after one warm-up step, on ``--device`` (``cpu``:
  with torch's threads, ``threads``; ``cuda``: each step synchronised before its clock stops);
* ``ops_as_cuda`` (``launching``) — one step's operators counted as CUDA runs it (retr.common.op_count: each
  GRU one cuDNN call each way, each attention one fused kernel each way, the optimiser's foreach/fused update);
  ``cpu_ops`` — the plain CPU count.

    .venv/bin/python bench/bert_step.py [--batch 128 --steps 3 --device cpu|cuda]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from retr.common.op_count import OpCounter
from retr.trainers.models import create_model
from retr.trainers.models.optim import apply_implementation
from retr.trainers.training.loop import train_step

VOCAB, REGIONS, IMG_DIM = 10_000, 36, 2048


def batch_of(size: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 17, (size,), generator=g)
    tokens = torch.randint(5, vocab, (size, int(lengths.max())), generator=g)
    tokens = tokens * (torch.arange(tokens.shape[1]) < lengths.view(-1, 1))
    return {"features": torch.rand(size, REGIONS, IMG_DIM, generator=g),
            "mask": torch.ones(size, REGIONS, dtype=torch.bool), "tokens": tokens, "lengths": lengths,
            "image_index": torch.arange(size), "caption_index": torch.arange(size)}


def model_of(text_encoder: str, device: torch.device):
    torch.manual_seed(0)
    if text_encoder == "bigru":
        return create_model("vse-infinity", vocab_size=VOCAB, img_dim=IMG_DIM).to(device), VOCAB
    import transformers

    config = transformers.BertConfig().to_dict()                 # bert-base-uncased's shapes
    from retr.trainers.models.pretrained_bert import CONFIG_KEYS
    bert_config = {k: config[k] for k in CONFIG_KEYS}
    model = create_model("vse-infinity", vocab_size=bert_config["vocab_size"], img_dim=IMG_DIM, text_encoder="bert",
                         bert_config=bert_config).to(device)
    continues = torch.zeros(bert_config["vocab_size"], dtype=torch.bool)
    continues[-5000:] = True                                     # some ids continue a word (its ## pieces)
    model.prepare_training({"word_continues": continues, "mask_token": torch.tensor(103)})
    return model, bert_config["vocab_size"]


def measure(text_encoder: str, size: int, steps: int, device: torch.device) -> dict:
    model, vocab = model_of(text_encoder, device)
    batch = batch_of(size, vocab)
    optimizer = model.configure_optimizer(5e-4)
    apply_implementation(optimizer, "auto", device)
    train_step(model, batch, optimizer, None, 2.0, device)       # warm-up: the optimiser's state
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step(model, batch, optimizer, None, 2.0, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    with OpCounter() as plain:
        train_step(model, batch, optimizer, None, 2.0, device)
    apply_implementation(optimizer, "auto", torch.device("cuda"))  # what --optimizer-impl auto picks on CUDA
    with OpCounter(rnn_as_library_call=True, attention_as_library_call=True) as cuda:
        train_step(model, batch, optimizer, None, 2.0, device)
    return {"text_encoder": text_encoder, "parameters": sum(p.numel() for p in model.parameters()),
            "seconds_per_step": round(statistics.median(times), 3), "steps_timed": [round(t, 3) for t in times],
            "ops_as_cuda": cuda.total, "launching": cuda.launching, "cpu_ops": plain.total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    args = parser.parse_args()
    device = torch.device(args.device)
    baseline = measure("bigru", args.batch, args.steps, device)
    bert = measure("bert", args.batch, args.steps, device)
    print(json.dumps({"bench": "bert_step", "model": "vse-infinity", "batch": args.batch, "device": str(device),
                      "threads": torch.get_num_threads(), **bert, "baseline": baseline,
                      "time_ratio": round(bert["seconds_per_step"] / baseline["seconds_per_step"], 1),
                      "ops_ratio": round(bert["ops_as_cuda"] / baseline["ops_as_cuda"], 1)}))


if __name__ == "__main__":
    main()
