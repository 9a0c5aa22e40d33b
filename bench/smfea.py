"""What SMFEA's tree encoders and concept branch cost, against VSE++ on the same inputs, in one run.

Published sizes (d = 1024, word 300, 36 regions × 2048, tree hidden 128, 1,440 entities / 247 relations,
300 concepts), random weights and inputs, on the chosen device:

* ``train_step`` — forward + backward + Adam step of one batch (SMFEA's Eq. 20 loss vs VSE++'s hinge);
* ``encode`` — evaluation-mode encoding throughput (images/s and captions/s);
* ``smfea-no-trees`` — the "w/o trees" ablation, to separate the trees' cost from the concept branch's.

Scoring is a dot product of fused vectors for both models, so evaluation cost differs only in encoding.
Prints one JSON line per result with the VSE++ baseline measured in the same run.

    .venv/bin/python bench/smfea.py [--batch 128] [--steps 3] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from retr.trainers.models import create_model


def make(name: str, vocab: int, **extra):
    torch.manual_seed(0)
    if name == "vsepp":
        return create_model("vsepp", vocab_size=vocab, img_dim=2048)
    return create_model("smfea", vocab_size=vocab, num_entities=1440, num_relations=247, num_concepts=300,
                        img_dim=2048, **extra)


def batch(b: int, vocab: int, device: torch.device):
    g = torch.Generator().manual_seed(1)
    features = torch.randn(b, 36, 2048, generator=g).to(device)
    mask = torch.ones(b, 36, dtype=torch.bool, device=device)
    lengths = torch.randint(8, 16, (b,), generator=g)
    tokens = torch.randint(4, vocab, (b, int(lengths.max())), generator=g).to(device)
    nodes = torch.stack([torch.randint(0, 1440 if s % 2 == 0 else 247, (b,), generator=g) for s in range(7)], 1)
    labels = (torch.rand(b, 300, generator=g) < 0.02).float()
    return features, mask, tokens, lengths.to(device), nodes.to(device), labels.to(device)


def time_train(model, data, steps: int, smfea: bool) -> float:
    features, mask, tokens, lengths, nodes, labels = data
    opt = torch.optim.Adam(model.parameters(), lr=2e-4)
    model.train()
    times = []
    for _ in range(steps + 1):                         # the first step warms up allocations
        start = time.perf_counter()
        opt.zero_grad()
        extra = {"nodes": nodes, "image_concept_labels": labels} if smfea else {}
        model(features, mask, tokens, lengths, **extra).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return min(times[1:])


@torch.no_grad()
def time_encode(model, data, steps: int) -> tuple[float, float]:
    features, mask, tokens, lengths, _, _ = data
    model.eval()
    img, cap = [], []
    for _ in range(steps + 1):
        start = time.perf_counter()
        model.encode_images(features, mask)
        img.append(time.perf_counter() - start)
        start = time.perf_counter()
        model.encode_captions(tokens, lengths)
        cap.append(time.perf_counter() - start)
    return min(img[1:]), min(cap[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=8481)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    data = batch(args.batch, args.vocab, device)
    baseline = make("vsepp", args.vocab).to(device)
    base_step = time_train(baseline, data, args.steps, smfea=False)
    base_img, base_cap = time_encode(baseline, data, args.steps)
    for name, extra in (("smfea", {}), ("smfea-no-trees", {"use_trees": False})):
        model = make("smfea", args.vocab, **extra).to(device)
        step = time_train(model, data, args.steps, smfea=True)
        img, cap = time_encode(model, data, args.steps)
        print(json.dumps({"bench": "smfea_train_step", "model": name, "batch": args.batch, "device": str(device),
                          "seconds": round(step, 4), "baseline": "vsepp", "baseline_seconds": round(base_step, 4),
                          "ratio": round(step / base_step, 2)}), flush=True)
        print(json.dumps({"bench": "smfea_encode", "model": name, "batch": args.batch, "device": str(device),
                          "images_per_s": round(args.batch / img, 1), "captions_per_s": round(args.batch / cap, 1),
                          "baseline": "vsepp", "baseline_images_per_s": round(args.batch / base_img, 1),
                          "baseline_captions_per_s": round(args.batch / base_cap, 1)}), flush=True)


if __name__ == "__main__":
    main()
