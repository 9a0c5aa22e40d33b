"""Test helper: a tiny pretrained BERT written by the tests (nothing is downloaded), laid out as a model folder or as
a Hugging Face cache entry.

* :func:`wordpiece_tokens` — a small WordPiece vocabulary for some captions: BERT's special tokens, punctuation,
  every word of the captions, except that each word of more than five letters is only there cut in two (``circ``,
  ``##le``), so captions hold words of several pieces;
* :func:`write_tiny_bert` — a folder as ``hf download`` leaves one: ``config.json`` (a small random
  ``BertConfig``), ``vocab.txt``, ``tokenizer_config.json`` and ``model.safetensors`` saved from a seeded
  ``BertForPreTraining`` (``bert.``-prefixed names and the pre-training heads, as ``bert-base-uncased``'s file);
* :func:`cached_bert` — the same files in a Hugging Face cache under a Hub name (``tests/test_hub.py``'s layout).
"""
from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Iterable

import pytest

pytest.importorskip("transformers", reason="the bert extra is not installed: pip install 'retr[bert]'")

#: a small BERT: the shapes of bert-base-uncased, shrunk (counts of operators do not depend on them)
TINY_CONFIG = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32,
               "max_position_embeddings": 64, "type_vocab_size": 2}
SPECIALS = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def wordpiece_tokens(captions: Iterable[str]) -> list[str]:
    """A vocabulary (id order) covering ``captions`` lower-cased (see the module docstring)."""
    words: dict[str, None] = {}
    for caption in captions:
        for word in caption.lower().replace(".", " . ").replace(",", " , ").split():
            words[word] = None
    pieces: dict[str, None] = {}
    for word in words:
        for piece in ((word[:4], "##" + word[4:]) if len(word) > 5 and word.isalpha() else (word,)):
            pieces[piece] = None
    punctuation = [c for c in string.punctuation if c not in pieces]
    return list(dict.fromkeys([*SPECIALS, *punctuation, *pieces, "##s"]))


def write_tiny_bert(folder: Path, tokens: list[str], seed: int = 0, dropout: float = 0.1, **config) -> Path:
    """``folder`` holding a tiny pretrained BERT over ``tokens`` (module docstring); returns it."""
    import torch
    import transformers

    tokens = list(dict.fromkeys(tokens))
    folder.mkdir(parents=True, exist_ok=True)
    settings = {**TINY_CONFIG, "vocab_size": len(tokens), "hidden_dropout_prob": dropout,
                "attention_probs_dropout_prob": dropout, **config}
    torch.manual_seed(seed)
    model = transformers.BertForPreTraining(transformers.BertConfig(**settings))
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "vocab.txt").write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "model_max_length": 64}))
    return folder


def cached_bert(cache: Path, repo: str, model_folder: Path) -> Path:
    """``model_folder``'s files as the Hugging Face cache entry of ``repo`` in ``cache``; returns the snapshot."""
    from test_hub import hub_cache

    return hub_cache(cache, repo, model_folder)


#: bert-base-uncased's structure (12 layers of 12 heads) at a tiny width: a training step dispatches the operators of
#: bert-base's (what the operator counts are about) at a fraction of its arithmetic
BASE_STRUCTURE = {"hidden_size": 24, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 48}


def bert_config(vocab_size: int, dropout: float = 0.1, **changes) -> dict:
    """A stored BERT configuration (every key a run stores) of :data:`TINY_CONFIG`'s sizes, ``changes`` applied."""
    return {**TINY_CONFIG, "vocab_size": vocab_size, "hidden_act": "gelu", "hidden_dropout_prob": dropout,
            "attention_probs_dropout_prob": dropout, "initializer_range": 0.02, "layer_norm_eps": 1e-12,
            "pad_token_id": 0, **changes}


def prepare_word_pieces(model, vocab_size: int, continuations: int = 16, mask_token: int = 3) -> None:
    """What a BERT run's ``load_inputs`` hands ``prepare_training`` besides the weights: the last ``continuations``
    ids of a ``vocab_size`` vocabulary continue a word (``##…``), and ``[MASK]`` is ``mask_token``."""
    import torch

    continues = torch.zeros(vocab_size, dtype=torch.bool)
    continues[vocab_size - continuations:] = True
    model.prepare_training({"word_continues": continues, "mask_token": torch.tensor(mask_token)})
