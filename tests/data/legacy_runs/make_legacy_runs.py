"""How ``tests/data/legacy_runs/`` was made: run directories written by retr before the ModelSpec registry
(commit 8c160cb), kept so that ``tests/test_legacy_runs.py`` can check that older runs still load and evaluate
to the same numbers.

Run against a checkout of that commit (its packages importable as ``retr.*``), from this folder::

    PYTHONPATH=<old checkout as retr/> python make_legacy_runs.py <scratch dir>

Each run is a tiny model trained for one epoch on the synthetic dataset (60 images, seed 0) with the
scene-description region features of ``tests/trainer_synthetic.py``; ``eval.json`` holds the old code's
``f30k-1k`` numbers on the test split. Only ``config.json``, ``vocab.json``, ``best.pt`` and ``eval.json`` are
kept; the data is made again by the test (the generators are seeded).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from click.testing import CliRunner


def main(scratch: str) -> None:
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here.parent.parent))              # tests/, for trainer_synthetic
    from trainer_synthetic import make_synthetic
    from retr.pipeline.commands import cli as pipeline
    from retr.trainers.commands import cli as train

    scratch = Path(scratch)
    manifest, features = make_synthetic(scratch / "s", images=60, seed=0)
    conllu = scratch / "s" / "captions.conllu"
    invoke = lambda cli, args: CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)  # noqa: E731
    invoke(pipeline, ["parse-trees", "--manifest", manifest, "--conllu", conllu, "--out", scratch / "trees.h5"])
    invoke(pipeline, ["build-concepts", "--manifest", manifest, "--conllu", conllu, "--out", scratch / "concepts.h5"])
    scenes = [json.loads(line) for line in (scratch / "s" / "scenes.jsonl").read_text().splitlines()]
    (scratch / "labels.json").write_text(json.dumps({s["id"]: sorted({o["shape"] for o in s["objects"]})
                                                     for s in scenes}))
    common = ["--features", features, "--manifest", manifest, "--epochs", "1", "--batch-size", "16",
              "--train-split", "train", "--device", "cpu", "--quiet", "--embed-size", "16", "--word-dim", "8"]
    runs = {
        "scan": ["scan", "--direction", "i2t", "--agg", "avg", "--lambda-softmax", "5"],
        "smfea": ["smfea", "--trees", scratch / "trees.h5", "--concepts", scratch / "concepts.h5",
                  "--tree-hidden", "8"],
        "jgcar": ["jgcar", "--labels", scratch / "labels.json", "--num-regions", "4", "--hidden-size", "8",
                  "--shortlist", "5", "--max-words", "15"],
    }
    for name, args in runs.items():
        out = scratch / "runs" / name
        result = invoke(train, [*args, *common, "--out", out])
        assert result.exit_code == 0, result.output
        result = invoke(train, ["eval", out, "--protocol", "f30k-1k", "--device", "cpu", "--quiet"])
        assert result.exit_code == 0, result.output
        keep = here / name
        keep.mkdir(exist_ok=True)
        for file in ("config.json", "vocab.json", "best.pt", "eval.json"):
            shutil.copy(out / file, keep / file)


if __name__ == "__main__":
    main(sys.argv[1])
