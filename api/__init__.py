"""retr: image–text retrieval research — cached features, matching models, the field's protocols.

The names a script needs, in one place (each is the library function the commands use)::

    import retr

    model, vocab, config = retr.load_model("runs/scan-f30k")              # a trained run
    result, sims = retr.evaluate(["runs/scan-f30k"], "f30k-1k")            # R@K, medr, meanr, rSum
    hits = retr.Retriever.from_run("runs/scan-f30k").text_to_images(["a dog on a beach"], k=5)
    hits = retr.Retriever.from_run("runs/scan-f30k", images="photos/").image_to_texts(["photos/dog.jpg"])
    features = retr.FeatureSet("data/f30k/features/butd-regions.h5")      # [N, K, D] rows by image id
    keys, nodes, entities, relations = retr.read_trees("data/f30k/trees.h5")  # referral trees
    model = retr.create_model("scan", vocab_size=10_000, img_dim=2048)     # an untrained model
    report = retr.reproduce(retr.get_recipe("scan-f30k-t2i-avg"), {...}, out=Path("runs"), overrides={})

Names are imported on first use, so ``import retr`` itself is cheap (no torch).
"""
from __future__ import annotations

import importlib
from typing import Any

from retr.common.version import __version__

#: public name → (module, attribute)
_PUBLIC = {
    # models
    "create_model": ("retr.trainers.models", "create_model"),
    "list_models": ("retr.trainers.models", "list_models"),
    "load_model": ("retr.trainers.runs.checkpoint", "load_run_model"),
    # data
    "FeatureSet": ("retr.store.features", "FeatureSet"),
    "read_trees": ("retr.store.trees", "read_trees"),
    "read_manifest": ("retr.manifests.schema", "read_manifest"),
    "build_extractor": ("retr.extractors.base", "build_extractor"),
    "available_extractors": ("retr.extractors.base", "available_extractors"),
    # training
    "TrainConfig": ("retr.trainers.config", "TrainConfig"),
    "train": ("retr.trainers.training.loop", "train"),
    # evaluation and search
    "evaluate": ("retr.trainers.evaluation.runs", "evaluate_runs"),
    "PROTOCOLS": ("retr.trainers.evaluation.metrics", "PROTOCOLS"),
    "Retriever": ("retr.trainers.search.retrieval", "Retriever"),
    "GalleryIndex": ("retr.trainers.search.index", "GalleryIndex"),
    "image_files": ("retr.trainers.search.images", "image_files"),
    # published rows
    "list_recipes": ("retr.trainers.reproduction.recipes", "list_recipes"),
    "get_recipe": ("retr.trainers.reproduction.recipes", "get_recipe"),
    "reproduce": ("retr.trainers.reproduction.reproduce", "reproduce"),
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'retr' has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
