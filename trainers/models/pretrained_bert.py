"""BERT for VSE∞'s BERT text encoder: the network built from a stored configuration, and a pretrained model's
files — its configuration, WordPiece vocabulary and weights — from a local folder or from the Hugging Face Hub
through the libraries' own cache (``bert-base-uncased``, the authors' model: downloaded there on first use).

Offline (``RETR_OFFLINE=1``, or huggingface_hub's ``HF_HUB_OFFLINE``) only the cache is read, and a model not in it
is one line naming it and ``hf download``. Everything here needs transformers (the ``bert`` extra); without it, one
line naming the extra. A run stores what it needs (the configuration in its settings' sizes, the vocabulary in its
``vocab.json``), so evaluating, searching or exporting it never looks for the pretrained model again.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from retr.common.downloads import is_offline
from retr.common.errors import MissingResourceError, UserError
from retr.common.optional import require
from retr.store.wordpiece import WordPieceVocabulary

#: the extra that installs transformers (and with it tokenizers and huggingface_hub)
EXTRA = "bert"
WHAT = "--text-encoder bert, VSE∞'s BERT text encoder"
#: the authors' pretrained BERT (their EncoderText and BertTokenizer load it by this name)
DEFAULT_BERT = "bert-base-uncased"
#: ``BertConfig`` fields that decide BERT's shapes and arithmetic: what a run stores of its configuration
CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
               "type_vocab_size", "initializer_range", "layer_norm_eps", "pad_token_id")
#: the files of a pretrained BERT: configuration, vocabulary, the tokenizer's settings (optional), weights (either)
CONFIG_FILE, VOCAB_FILE, TOKENIZER_FILE = "config.json", "vocab.txt", "tokenizer_config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def transformers():
    """The transformers package, or one line naming the ``bert`` extra."""
    return require("transformers", EXTRA, WHAT)


def hub_offline() -> bool:
    """Whether only the Hugging Face cache may be read (``RETR_OFFLINE`` or ``HF_HUB_OFFLINE``)."""
    return is_offline() or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")


def hub_cache() -> str:
    """huggingface_hub's cache folder (``HF_HUB_CACHE``, else ``~/.cache/huggingface/hub``), read at call time."""
    return str(require("huggingface_hub.constants", EXTRA, WHAT).HF_HUB_CACHE)


def missing_model(name: str, filename: str) -> MissingResourceError:
    """The one line for a pretrained BERT absent from the Hugging Face cache while offline."""
    folder = Path(hub_cache()) / ("models--" + name.replace("/", "--"))
    return MissingResourceError(f"BERT model {name} ({filename})", str(folder),
                                f"on a connected machine run `hf download {name}` (or let retr download it there: "
                                f"leave RETR_OFFLINE/HF_HUB_OFFLINE unset), and copy {folder.name} into the cache "
                                "(HF_HUB_CACHE or HF_HOME name another one), or give --bert-model FOLDER holding its "
                                "config.json, vocab.txt and weights")


def model_file(name: str, filename: str, optional: bool = False) -> Path | None:
    """``filename`` of the pretrained BERT ``name``: a local folder's file, or the Hub model's from the Hugging Face
    cache (downloaded into it first unless offline). ``optional``: None when the model has no such file."""
    folder = Path(name)
    if folder.is_dir():
        path = folder / filename
        if path.is_file() or optional:
            return path if path.is_file() else None
        raise UserError(f"--bert-model {name}: the folder has no {filename} (a BERT model folder holds config.json, "
                        "vocab.txt and model.safetensors or pytorch_model.bin)")
    hub = require("huggingface_hub", EXTRA, WHAT)
    errors = require("huggingface_hub.errors", EXTRA, WHAT)
    offline = hub_offline()
    try:
        return Path(hub.hf_hub_download(name, filename, cache_dir=hub_cache(), local_files_only=offline))
    except errors.LocalEntryNotFoundError:          # (a subclass of EntryNotFoundError: first)
        if optional and offline and model_file_cached(name, CONFIG_FILE):
            return None                     # cached without it: the model has none
        raise missing_model(name, filename) from None
    except errors.EntryNotFoundError:
        if optional:
            return None
        raise UserError(f"--bert-model {name}: the model has no {filename}") from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.GatedRepoError) as exc:
        raise UserError(f"--bert-model {name}: no such folder, nor a model on the Hub readable with your token "
                        f"({_first_line(exc)})") from None
    except (errors.HfHubHTTPError, OSError, ValueError) as exc:
        raise UserError(f"--bert-model {name}: {filename} could not be fetched ({_first_line(exc)})") from None


def model_file_cached(name: str, filename: str) -> bool:
    found = require("huggingface_hub", EXTRA, WHAT).try_to_load_from_cache(name, filename, cache_dir=hub_cache())
    return isinstance(found, str) and Path(found).is_file()


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


@dataclass(frozen=True)
class PretrainedBert:
    """A pretrained BERT's configuration (:data:`CONFIG_KEYS`) and WordPiece vocabulary."""

    name: str
    config: dict
    vocabulary: WordPieceVocabulary


def pretrained_bert(name: str) -> PretrainedBert:
    """The configuration and vocabulary of the pretrained BERT ``name`` (a Hub name or a folder): its
    ``config.json``, ``vocab.txt`` and, where it has one, ``tokenizer_config.json`` (lower-casing, accents). Read
    once per name and Hugging Face cache (a name means another model in another cache)."""
    transformers()
    return _pretrained_bert(name, "" if Path(name).is_dir() else hub_cache())


@functools.lru_cache(maxsize=4)
def _pretrained_bert(name: str, cache: str) -> PretrainedBert:
    """:func:`pretrained_bert` of ``name`` read from the Hugging Face cache ``cache`` ("" for a folder)."""
    config = read_config(model_file(name, CONFIG_FILE), name)
    tokenizer_file = model_file(name, TOKENIZER_FILE, optional=True)
    settings = _read_json(tokenizer_file, name) if tokenizer_file is not None else {}
    vocabulary = WordPieceVocabulary.read_txt(
        model_file(name, VOCAB_FILE), lowercase=bool(settings.get("do_lower_case", True)),
        strip_accents=settings.get("strip_accents"), chinese_chars=bool(settings.get("tokenize_chinese_chars", True)),
        max_length=int(config["max_position_embeddings"]), source=name)
    if len(vocabulary) != config["vocab_size"]:
        raise UserError(f"--bert-model {name}: its vocab.txt has {len(vocabulary)} tokens but its config.json "
                        f"{config['vocab_size']} embedding rows")
    return PretrainedBert(name, config, vocabulary)


def _read_json(path: Path, name: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"--bert-model {name}: {path.name} is not readable JSON ({_first_line(exc)})") from None
    if not isinstance(data, dict):
        raise UserError(f"--bert-model {name}: {path.name} holds no mapping")
    return data


def read_config(path: Path, name: str) -> dict:
    """The :data:`CONFIG_KEYS` of a BERT ``config.json`` (transformers' defaults where it leaves one out); a model
    other than BERT, or relative position embeddings, are refused in one line."""
    data = _read_json(path, name)
    if data.get("model_type", "bert") != "bert":
        raise UserError(f"--bert-model {name} is a {data['model_type']} model, not BERT")
    if data.get("position_embedding_type", "absolute") != "absolute":
        raise UserError(f"--bert-model {name} uses {data['position_embedding_type']} position embeddings; retr's "
                        "BERT encoder (transformers' BertModel) has absolute ones")
    defaults = transformers().BertConfig().to_dict()
    return {k: data.get(k, defaults[k]) for k in CONFIG_KEYS}


def check_weights(name: str) -> None:
    """That the pretrained BERT ``name`` has weights to start from: a local folder's file, or, offline, a weight
    file in the Hugging Face cache (online, loading downloads them). One line otherwise."""
    folder = Path(name)
    if folder.is_dir():
        if not any((folder / f).is_file() for f in WEIGHT_FILES):
            raise UserError(f"--bert-model {name}: the folder has no weights ({' or '.join(WEIGHT_FILES)})")
        return
    if hub_offline() and not any(model_file_cached(name, f) for f in WEIGHT_FILES):
        raise missing_model(name, WEIGHT_FILES[0])


def pretrained_state(name: str) -> dict[str, torch.Tensor]:
    """The pretrained weights of BERT ``name`` in float32, as ``BertModel`` (no pooler) names them: transformers'
    ``from_pretrained`` (its checkpoint formats and old key names), from the folder or the Hugging Face cache."""
    check_weights(name)
    library = transformers()
    verbosity, bars = library.logging.get_verbosity(), library.logging.is_progress_bar_enabled()
    library.logging.set_verbosity_error()    # its load report lists the pre-training heads left out, on every load
    library.logging.disable_progress_bar()
    try:
        model = library.BertModel.from_pretrained(name, cache_dir=hub_cache(), local_files_only=hub_offline(),
                                                  add_pooling_layer=False, dtype=torch.float32)
    except OSError as exc:
        if hub_offline() and not Path(name).is_dir():
            raise missing_model(name, WEIGHT_FILES[0]) from None
        raise UserError(f"--bert-model {name}: its weights could not be loaded ({_first_line(exc)})") from None
    finally:
        library.logging.set_verbosity(verbosity)
        if bars:
            library.logging.enable_progress_bar()
    return {k: v.detach() for k, v in model.state_dict().items()}


def bert_network(config: dict) -> torch.nn.Module:
    """transformers' ``BertModel`` of a stored configuration (:data:`CONFIG_KEYS`), without the pooler (its output is
    not used), attention through PyTorch's ``scaled_dot_product_attention`` (which takes the boolean key mask the
    encoder makes on the device: transformers' own mask would read the mask back to see whether it can skip it)."""
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"bert_config has key(s) that are no BERT configuration retr stores: {', '.join(unknown)}")
    bert_config = transformers().BertConfig(**config, attn_implementation="sdpa")
    return transformers().BertModel(bert_config, add_pooling_layer=False)
