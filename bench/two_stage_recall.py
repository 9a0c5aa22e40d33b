"""Benchmark: how much of the exhaustive top k two-stage search keeps, per cross-attention model, on trained
tiny runs.

Makes a synthetic dataset (``--images``, with the scene-region features of ``tests/trainer_synthetic.py``: one
region per drawn object, so a trained model ranks by content), trains SCAN, SEAM and SMAN on it with
``retr-train`` (``--epochs``, small sizes), encodes the ``--split`` split with each run's best checkpoint and,
for every ``--shortlists`` size S, compares :class:`~retr.trainers.search.two_stage.TwoStageSearch` (shortlist
S by the model's shortlist vectors, exact index, then ``score``) with the exhaustive ranking (``score`` over
the whole gallery): recall@1/5/10 (share of the exhaustive top k found) for text → image (every caption of
the split queries its images) and image → text (every image queries the captions). One JSON line per model,
direction and S.

    python bench/two_stage_recall.py --out /tmp/two-stage          # reuses runs already in --out
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from trainer_synthetic import make_synthetic  # noqa: E402

from retr.trainers.commands import cli  # noqa: E402
from retr.trainers.evaluation.two_step import encode_all  # noqa: E402
from retr.trainers.search.two_stage import TwoStageSearch  # noqa: E402
from retr.trainers.data.splits import ImageFeatures  # noqa: E402
from retr.trainers.runs.split import open_run_split

COMMON = ["--embed-size", "64", "--word-dim", "32", "--batch-size", "64", "--val-images", "20", "--device", "cpu",
          "--quiet"]
RUNS = {"scan": ["--direction", "t2i", "--lr", "2e-3"],
        "seam": ["--hops", "4", "--lr", "2e-3"],
        "sman": ["--optimizer", "adam", "--lr", "2e-3", "--grad-clip", "2.0"]}


def train(folder: Path, model: str, epochs: int, manifest: Path, features: Path) -> Path:
    run = folder / model
    if not (run / "best.pt").is_file():
        args = [model, "--features", features, "--manifest", manifest, "--out", run, "--epochs", epochs,
                *COMMON, *RUNS[model]]
        result = CliRunner().invoke(cli, [str(a) for a in args])
        if result.exit_code != 0:
            raise SystemExit(f"training {model} failed: {result.output}{result.exception}")
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the dataset and the runs")
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--models", default=",".join(RUNS))
    parser.add_argument("--split", default="test")
    parser.add_argument("--shortlists", default="5,10,20,50")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    manifest, features = args.out / "manifest.jsonl", args.out / "scene-regions.h5"
    if not features.is_file():
        manifest, features = make_synthetic(args.out, images=args.images)
    device = torch.device("cpu")
    for model_name in args.models.split(","):
        t = time.perf_counter()
        run = train(args.out, model_name, args.epochs, manifest, features)
        train_s = time.perf_counter() - t
        opened = open_run_split(run, args.split, device=device)
        model, data = opened.model.eval(), opened.data
        images, captions = encode_all(model, data, ImageFeatures(opened.features, data.image_ids), device,
                                      dtype=torch.float32)
        for direction, gallery, side, queries in (("t2i", images, "image", captions),
                                                  ("i2t", captions, "caption", images)):
            for s in (int(x) for x in args.shortlists.split(",")):
                search = TwoStageSearch(model, gallery, side, shortlist=s)
                recall = search.recall(queries)
                print(json.dumps({"bench": "two_stage_recall", "model": model_name, "direction": direction,
                                  "gallery": len(search.index), "queries": len(next(iter(queries.values()))),
                                  "shortlist": s, **{f"recall@{k}": round(v, 4) for k, v in recall.items()},
                                  "baseline": "exhaustive score over the gallery", "epochs": args.epochs,
                                  "images": args.images, "split": args.split, "train_s": round(train_s, 1)}),
                      flush=True)


if __name__ == "__main__":
    main()
