"""The public ``retr`` facade (api/__init__.py): its names are pinned, each is the library's own function, and
``import retr`` stays cheap."""
from __future__ import annotations

import subprocess
import sys

import retr

PUBLIC = {"__version__", "create_model", "list_models", "load_model", "FeatureSet", "read_manifest",
          "build_extractor", "available_extractors", "TrainConfig", "train", "evaluate", "PROTOCOLS", "Retriever",
          "GalleryIndex", "image_files", "read_trees", "list_recipes", "get_recipe", "reproduce"}


def test_the_public_names_are_pinned_and_resolve():
    assert set(retr.__all__) == PUBLIC and set(dir(retr)) >= PUBLIC
    from retr.trainers.evaluation.runs import evaluate_runs
    from retr.trainers.runs.checkpoint import load_run_model

    assert retr.evaluate is evaluate_runs and retr.load_model is load_run_model
    for name in PUBLIC:
        assert getattr(retr, name) is not None, name
    assert "scan" in retr.list_models() and "f30k-1k" in retr.PROTOCOLS
    assert retr.get_recipe("scan-f30k-t2i-avg").protocol == "f30k-1k"


def test_an_unknown_name_is_an_attribute_error():
    try:
        retr.no_such_thing
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("retr.no_such_thing resolved")


def test_import_retr_does_not_import_torch():
    code = "import sys, retr; assert 'torch' not in sys.modules, 'torch imported'; print(retr.__version__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_model_made_through_the_facade_scores_a_pair():
    import torch

    model = retr.create_model("vsepp", vocab_size=20, img_dim=8, embed_size=4, word_dim=4)
    images = model.encode_images(torch.randn(2, 3, 8), torch.ones(2, 3, dtype=torch.bool))
    captions = model.encode_captions(torch.tensor([[1, 5, 2], [1, 6, 2]]), torch.tensor([3, 3]))
    assert model.score(images, captions).shape == (2, 2)


def test_the_docs_python_examples_import_the_facade_only():
    """Every Python example of README.md and docs/*.md imports ``retr`` (the facade), never a module path inside it."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = {}
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), flags=re.S):
            imports = [line.strip() for line in block.splitlines() if re.match(r"\s*(import|from) ", line)]
            found[doc.name] = found.get(doc.name, []) + imports
    assert found and {line for lines in found.values() for line in lines} == {"import retr"}, found
