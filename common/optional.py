"""Packages that only some users need: each comes with an extra of ``pyproject.toml`` and is imported where it is
used, through :func:`require`, never at a module's top.

* ``pipeline`` — stanza (parsing raw captions: ``parse-trees``, ``show-tree`` without ``--conllu``; CoNLL-U is read
  without it), opencv-python-headless and timm (extractors; timm brings huggingface_hub);
* ``clip`` — open_clip_torch (extractors, ``retr-train eval-clip``);
* ``report`` — matplotlib (``retr-train show``'s drawings, ``retr-train plot``) and jinja2 (``show``'s HTML
  templates);
* ``search`` — faiss-cpu (faiss's exact index in search; without it, blockwise matrix products);
* ``serve`` — flask and waitress (``retr-train serve``, the search page);
* ``hub`` — huggingface_hub (models named ``hf-hub:ORG/NAME``, ``retr-train push``; timm brings it too);
* ``tensorboard`` — tensorboard (``--log tensorboard``);
* ``bert`` — transformers, with tokenizers and huggingface_hub (``vse-infinity --text-encoder bert``: BERT, its
  WordPiece tokenizer, its weights from the Hub's cache; a BERT run's eval, search, serve and export);
* ``eccv`` — eccv-caption (``retr-train eval --extended``: the ECCV Caption and CxC annotations it ships are read
  from its folder, :func:`locate`, never imported or copied).

Which extractor needs which extra is said once, in its spec (``ExtractorSpec.extra`` and ``requires``,
:mod:`retr.extractors.spec`): the extractors' registry checks it before building one, so the line names the extractor.

nltk is no extra: the trainer's caption tokenizer (:mod:`retr.store.vocab`) uses it, so every user needs it.

``all`` installs every extra; ``dev`` (what ``make setup`` installs) is ``all`` plus the test tools. Without an
extra, ``import retr``, every command's ``--help`` and everything else work; what needs the package stops with
one line naming the extra::

    matplotlib is not installed (needed by the report's drawings): pip install 'retr[report]' (or make setup)
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

from retr.common.errors import RetrError

#: top-level import name → the pip package that provides it (where the two differ). ``huggingface_hub`` comes
#: with timm (and stanza), so the ``pipeline`` extra installs it; ``safetensors`` is a base dependency (exports).
DISTRIBUTIONS: dict[str, str] = {"cv2": "opencv-python-headless", "faiss": "faiss-cpu", "open_clip": "open_clip_torch",
                                 "eccv_caption": "eccv-caption"}


class MissingExtraError(RetrError):
    """A package of an extra (:func:`require`) is not installed, or cannot be imported; one line naming the extra."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """``importlib.import_module(module)``, or :class:`MissingExtraError` when it (or a package it needs) is missing.

    ``extra``: the extra of ``pyproject.toml`` that installs it (``"report"``); ``what``: what needs it, for the
    message (``"the report's drawings"``). An installed package that fails to import (a missing system library)
    is reported with its own reason, in the same one line.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = (exc.name or module).split(".")[0]
        problem = f"{DISTRIBUTIONS.get(missing, missing)} is not installed"
        raise MissingExtraError(_message(problem, extra, what)) from exc
    except ImportError as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise MissingExtraError(_message(f"{module} cannot be imported ({reason})", extra, what)) from exc


def locate(module: str, extra: str, what: str) -> Path:
    """The folder of the installed package ``module``, found without importing it (for the data files a package
    ships), or :class:`MissingExtraError` naming ``extra`` when it is not installed."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        problem = f"{DISTRIBUTIONS.get(module, module)} is not installed"
        raise MissingExtraError(_message(problem, extra, what))
    return Path(next(iter(spec.submodule_search_locations)))


def _message(problem: str, extra: str, what: str) -> str:
    return f"{problem} (needed by {what}): pip install 'retr[{extra}]' (or make setup)"
