"""Import official SCAN / VSE++ / VSE∞ checkpoints (``model_best.pth(.tar)``) as retr runs.

Read with ``weights_only=True`` allowing exactly ``argparse.Namespace`` (else ``--trust-checkpoint``); the run gets
``config.json``, ``vocab.json`` and ``best.pt``, but no features or manifest."""
from __future__ import annotations

import argparse
from pathlib import Path


from retr.common.errors import MissingResourceError, UserError
from retr.common.optional import require
from retr.common.version import __version__
from retr.store.vocab import Vocabulary
from retr.trainers.config import settings_from_stored
from retr.trainers.models import get_spec
from retr.trainers.models.pretrained_bert import DEFAULT_BERT, hub_offline, pretrained_bert
from retr.trainers.runs import checkpoint as ckpt
from retr.trainers.runs.hub import HUB_PREFIX, hub_cache
from retr.trainers.runs.layout import BEST, CONFIG, VOCAB

AGG_NAMES = {"LogSumExp": "lse", "Mean": "avg", "Max": "max", "Sum": "sum"}
#: ``opt`` fields that decide the scores, each mapped to a SCAN setting by :func:`scan_args_from_opt`
HONOURED = ("img_dim", "embed_size", "word_dim", "num_layers", "cross_attn", "agg_func", "raw_feature_norm",
            "lambda_softmax", "lambda_lse", "bi_gru", "no_imgnorm", "no_txtnorm", "precomp_enc_type", "margin",
            "max_violation", "measure")
#: ``opt`` fields that do not change a trained model's scores: paths, logging, the schedule, the CNN options of
#: the raw-image code path (the precomputed-feature model has no CNN)
IRRELEVANT = ("data_path", "data_name", "vocab_path", "num_epochs", "batch_size", "grad_clip", "crop_size",
              "learning_rate", "lr_update", "workers", "log_step", "val_step", "logger_name", "model_name", "resume",
              "reset_train", "finetune", "cnn_type", "use_restval", "vocab_size", "use_abs")


def _check_fields(opt: dict) -> None:
    """Refuse, by name, an ``opt`` field retr does not know (it might change the scores)."""
    unknown = sorted(set(opt) - set(HONOURED) - set(IRRELEVANT))
    if unknown:
        raise UserError(f"the checkpoint's options have field(s) retr does not know: "
                        f"{', '.join(f'{k}={opt[k]!r}' for k in unknown)}; cannot tell whether they change the scores")


def scan_args_from_opt(opt) -> dict:
    """SCAN settings from the official ``opt`` Namespace: each field honoured (:data:`HONOURED`), irrelevant
    (:data:`IRRELEVANT`) or refused by name, as are values retr cannot reproduce."""
    fields = dict(vars(opt)) if not isinstance(opt, dict) else dict(opt)
    _check_fields(fields)
    get = fields.get
    agg = get("agg_func", "LogSumExp")
    if agg not in AGG_NAMES:
        raise UserError(f"unknown agg_func {agg!r} in the checkpoint's options")
    norm = get("raw_feature_norm", "clipped_l2norm")
    if norm in ("l1norm", "clipped_l1norm"):
        raise UserError(f"raw_feature_norm={norm!r}: the official code cannot run it (NameError on l1norm), so "
                        "there are no scores to reproduce")
    if get("measure", "cosine") != "cosine":
        raise UserError(f"measure={get('measure')!r}: SCAN scores with cosine only; retr cannot reproduce it")
    direction = get("cross_attn", "t2i")
    lambda_lse = get("lambda_lse")
    return {"img_dim": int(get("img_dim", 2048)), "embed_size": int(get("embed_size", 1024)),
            "word_dim": int(get("word_dim", 300)), "direction": direction, "agg": AGG_NAMES[agg],
            "norm": norm, "num_layers": int(get("num_layers", 1)), "no_txtnorm": bool(get("no_txtnorm", False)),
            "lambda_softmax": float(get("lambda_softmax", 9.0)),
            "lambda_lse": float(lambda_lse if lambda_lse is not None else 6.0),   # the authors' fallback
            "bi_gru": bool(get("bi_gru", False)), "no_imgnorm": bool(get("no_imgnorm", False)),
            "precomp_enc_type": get("precomp_enc_type", "basic"), "margin": float(get("margin", 0.2)),
            "max_violation": bool(get("max_violation", False))}


def _load_official(checkpoint: Path, out: Path, trust_checkpoint: bool, kind: str) -> dict:
    """The official ``{'model': [img_enc, txt_enc], 'opt', 'epoch', …}`` file, read without running code."""
    if not checkpoint.is_file():
        raise UserError(f"checkpoint {checkpoint} does not exist")
    if (out / BEST).exists():
        raise UserError(f"{out} already holds a run; choose another --out")
    state = ckpt.load_checkpoint(checkpoint, trust=trust_checkpoint, allow=(argparse.Namespace,))
    if not isinstance(state, dict) or "model" not in state or "opt" not in state \
            or not isinstance(state["model"], (list, tuple)) or len(state["model"]) != 2:
        raise UserError(f"{checkpoint} is not an official {kind} checkpoint "
                        "(expected {'model': [img_enc, txt_enc], 'opt': …, 'epoch': …})")
    if not all(isinstance(part, dict) for part in state["model"]):
        raise UserError(f"{checkpoint} is not an official {kind} checkpoint (its 'model' holds no state dicts)")
    return state


def _word_vocabulary(vocab_path: str | Path, state: dict, extra_rows: int = 0) -> Vocabulary:
    """The BiGRU checkpoint's word vocabulary ``vocab_path``, checked against its embedding's rows (``extra_rows``
    beyond the vocabulary: VSE∞'s ``<mask>``)."""
    vocab = Vocabulary.load(vocab_path)
    txt_state = state["model"][1]
    vocab_rows = txt_state["embed.weight"].shape[0] if "embed.weight" in txt_state else None
    if vocab_rows != len(vocab) + extra_rows:
        raise UserError(f"{vocab_path} has {len(vocab)} words but the checkpoint's embedding has {vocab_rows} rows"
                        + (f" ({extra_rows} beyond the vocabulary expected)" if extra_rows else "")
                        + "; use the vocabulary the model was trained with")
    return vocab


def _write_run(checkpoint: Path, vocab, out: Path, state: dict, model_name: str, args: dict, rename=None) -> Path:
    """Load the official encoders' states into retr's model and write the run directory. ``vocab``: the run's
    caption vocabulary (checked against the checkpoint by the caller); ``rename``: official parameter name → retr's
    (None: not loaded)."""
    img_state, txt_state = state["model"]
    args["vocab_size"] = len(vocab)
    stored = {"model": model_name, "model_args": args, "features": None, "manifest": None}
    model = ckpt.build_model(settings_from_stored(get_spec(model_name), stored))
    merged = {f"img_enc.{k}": v for k, v in img_state.items()}
    merged.update({f"txt_enc.{k}": v for k, v in txt_state.items()})
    if rename is not None:
        merged = {rename(k): v for k, v in merged.items() if rename(k) is not None}
    try:
        model.load_state_dict(merged)
    except RuntimeError as exc:
        raise UserError(f"{checkpoint} does not match {model_name} with its own options: "
                        f"{' '.join(str(exc).split())}") from None
    out.mkdir(parents=True, exist_ok=True)
    vocab.save(out / VOCAB)
    epoch = int(state.get("epoch", 0))
    ckpt.write_json(out / CONFIG, {**stored, "imported_from": str(checkpoint), "epoch": epoch,
                                   "best_rsum": float(state.get("best_rsum", 0.0) or 0.0), "retr_version": __version__})
    ckpt.save_checkpoint(out / BEST, {"model": model.state_dict(), "vocab": vocab.to_json(), "epoch": epoch,
                                      "imported_from": str(checkpoint)})
    return out


def import_scan_checkpoint(checkpoint: str | Path, vocab_path: str | Path, out: str | Path,
                           trust_checkpoint: bool = False) -> Path:
    """Write a run directory ``out`` from an official SCAN checkpoint and its vocabulary.

    The file is read without running code: tensors, plain types and exactly ``argparse.Namespace`` (the
    official ``opt``); anything else needs ``trust_checkpoint``."""
    checkpoint, out = Path(checkpoint), Path(out)
    state = _load_official(checkpoint, out, trust_checkpoint, "SCAN")
    args = scan_args_from_opt(state["opt"])
    return _write_run(checkpoint, _word_vocabulary(vocab_path, state), out, state, "scan", args)


#: fartashf/vsepp ``opt`` fields that decide the scores (the rest: :data:`IRRELEVANT`)
VSEPP_HONOURED = ("img_dim", "embed_size", "word_dim", "num_layers", "no_imgnorm", "margin", "max_violation",
                  "measure", "use_abs")
VSEPP_IRRELEVANT = tuple(f for f in IRRELEVANT if f != "use_abs") + ("precomp_enc_type",)


def vsepp_args_from_opt(opt) -> dict:
    """VSE++ settings from fartashf/vsepp's ``opt`` (precomputed-feature models only); ``measure`` other than
    cosine, ``use_abs``, raw-image models and unknown fields are refused by name."""
    fields = dict(vars(opt)) if not isinstance(opt, dict) else dict(opt)
    unknown = sorted(set(fields) - set(VSEPP_HONOURED) - set(VSEPP_IRRELEVANT))
    if unknown:
        raise UserError(f"the checkpoint's options have field(s) retr does not know: "
                        f"{', '.join(f'{k}={fields[k]!r}' for k in unknown)}; cannot tell whether they change the scores")
    if fields.get("measure", "cosine") != "cosine":
        raise UserError(f"measure={fields['measure']!r}: retr's VSE++ scores with cosine only")
    if fields.get("use_abs"):
        raise UserError("use_abs=True: retr's VSE++ takes no absolute value of the embeddings")
    data_name = str(fields.get("data_name", "_precomp"))
    if not data_name.endswith("_precomp"):
        raise UserError(f"data_name={data_name!r}: a VSE++ model on raw images (its CNN is in the checkpoint); retr "
                        "imports the precomputed-feature model (*_precomp)")
    return {"img_dim": int(fields.get("img_dim", 4096)), "embed_size": int(fields.get("embed_size", 1024)),
            "word_dim": int(fields.get("word_dim", 300)), "num_layers": int(fields.get("num_layers", 1)),
            "no_imgnorm": bool(fields.get("no_imgnorm", False)), "bi_gru": False,
            "margin": float(fields.get("margin", 0.2)), "max_violation": bool(fields.get("max_violation", False))}


def import_vsepp_checkpoint(checkpoint: str | Path, vocab_path: str | Path, out: str | Path,
                            trust_checkpoint: bool = False) -> Path:
    """Write a run directory ``out`` from an official VSE++ (fartashf/vsepp) precomputed-feature checkpoint."""
    checkpoint, out = Path(checkpoint), Path(out)
    state = _load_official(checkpoint, out, trust_checkpoint, "VSE++")
    args = vsepp_args_from_opt(state["opt"])
    return _write_run(checkpoint, _word_vocabulary(vocab_path, state), out, state, "vsepp", args)




#: woodfrog/vse_infty ``opt`` fields that decide the scores of a precomputed-region model (``bigru`` branch; the
#: ``master`` branch has the same but ``num_layers`` and ``drop``, and its ``vocab_size`` is BERT's)
VSE_INFINITY_HONOURED = ("img_dim", "embed_size", "word_dim", "num_layers", "no_imgnorm", "no_txtnorm",
                         "precomp_enc_type", "margin", "max_violation", "vocab_size")
#: its fields that do not change a trained model's scores: paths, logging, the schedule and the backbone's
#: schedule (used only with ``precomp_enc_type=backbone``, which is refused)
VSE_INFINITY_IRRELEVANT = ("data_path", "data_name", "vocab_path", "num_epochs", "batch_size", "grad_clip",
                           "learning_rate", "lr_update", "workers", "log_step", "val_step", "logger_name",
                           "model_name", "resume", "optim", "drop", "vse_mean_warmup_epochs", "reset_start_epoch",
                           "embedding_warmup_epochs", "backbone_warmup_epochs", "backbone_lr_factor",
                           "backbone_source", "backbone_path", "input_scale_factor")
#: the authors' parameter names → retr's; their MLP's second batch norm is never applied (no retr counterpart)
VSE_INFINITY_RENAMES = (("img_enc.mlp.layers.0.", "img_enc.mlp.0."), ("img_enc.mlp.bns.0.", "img_enc.mlp.1."),
                        ("img_enc.mlp.layers.1.", "img_enc.mlp.3."), ("txt_enc.gpool.", "txt_pool."))
#: parameters and buffers of theirs retr's model has no counterpart for: their MLP's second batch norm (built, never
#: applied), BERT's pooler (their ``EncoderText`` reads the token states only) and the ``position_ids`` buffer some
#: transformers versions save (``0 … P−1``, which retr's BERT makes itself)
VSE_INFINITY_UNUSED = ("img_enc.mlp.bns.1.", "txt_enc.bert.pooler.", "txt_enc.bert.embeddings.position_ids")
#: the file of a released model's folder (their eval.py: ``<folder>/model_best.pth``)
MODEL_BEST = "model_best.pth"


def vse_infinity_name(name: str) -> str | None:
    """retr's name of the authors' VSE∞ parameter ``name`` (None: one retr has no counterpart for,
    :data:`VSE_INFINITY_UNUSED`)."""
    if name.startswith(VSE_INFINITY_UNUSED):
        return None
    for old, new in VSE_INFINITY_RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def is_bert_checkpoint(text_state: dict) -> bool:
    """Whether the text encoder's state is the ``master`` branch's ``EncoderText`` (BERT + linear + GPO)."""
    return any(k.startswith("bert.") for k in text_state)


def vse_infinity_args_from_opt(opt, text_state: dict, image_state: dict | None = None) -> dict:
    """VSE∞ settings from woodfrog/vse_infty's ``opt`` (precomputed regions; BiGRU or BERT text, from the text
    encoder's state): every field honoured or irrelevant, else refused by name; the fine-tuned backbone (their grid
    rows, ``precomp_enc_type=backbone``) and turned-off normalisation cannot be expressed and are refused."""
    fields = dict(vars(opt)) if not isinstance(opt, dict) else dict(opt)
    unknown = sorted(set(fields) - set(VSE_INFINITY_HONOURED) - set(VSE_INFINITY_IRRELEVANT))
    if unknown:
        raise UserError(f"the checkpoint's options have field(s) retr does not know: "
                        f"{', '.join(f'{k}={fields[k]!r}' for k in unknown)}; cannot tell whether they change the scores")
    enc = fields.get("precomp_enc_type", "basic")
    backbone = any(k.startswith("backbone.") for k in image_state or {})
    if enc == "backbone" or backbone:
        raise UserError(f"{'precomp_enc_type=' + repr(enc) if enc != 'basic' else 'a CNN backbone in its image encoder'}"
                        ": a VSE∞ model over a CNN backbone it fine-tunes end to end on raw images (the authors' "
                        "BUTD grid and WSL grid models); retr trains and evaluates from cached features")
    if enc != "basic":
        raise UserError(f"precomp_enc_type={enc!r}: a VSE∞ model over an image encoder retr does not know")
    for flag in ("no_imgnorm", "no_txtnorm"):
        if fields.get(flag):
            raise UserError(f"{flag}=True: retr's VSE∞ always normalises its embeddings (as the authors' runs did)")
    args = {"img_dim": int(fields.get("img_dim", 2048)), "embed_size": int(fields.get("embed_size", 1024)),
            "image_mlp": True, "margin": float(fields.get("margin", 0.2)),
            "max_violation": bool(fields.get("max_violation", False))}
    if is_bert_checkpoint(text_state):
        return {**args, "text_encoder": "bert"}
    return {**args, "word_dim": int(fields.get("word_dim", 300)), "num_layers": int(fields.get("num_layers", 1))}


#: BertConfig fields and the checkpoint tensor whose shape gives each (``[rows, columns]``: which of the two)
BERT_SHAPES = (("vocab_size", "bert.embeddings.word_embeddings.weight", 0),
               ("hidden_size", "bert.embeddings.word_embeddings.weight", 1),
               ("max_position_embeddings", "bert.embeddings.position_embeddings.weight", 0),
               ("type_vocab_size", "bert.embeddings.token_type_embeddings.weight", 0),
               ("intermediate_size", "bert.encoder.layer.0.intermediate.dense.weight", 0))


def bert_sizes(text_state: dict) -> dict:
    """BERT's sizes as the ``master`` checkpoint's text state holds them (:data:`BERT_SHAPES`, and its layers)."""
    sizes = {}
    for name, key, axis in BERT_SHAPES:
        if key not in text_state:
            raise UserError(f"the checkpoint's BERT has no {key}: not the authors' EncoderText")
        sizes[name] = int(text_state[key].shape[axis])
    sizes["num_hidden_layers"] = len({k.split(".")[3] for k in text_state if k.startswith("bert.encoder.layer.")})
    return sizes


def check_bert_matches(text_state: dict, bert_model: str, config: dict, opt_vocab_size) -> None:
    """The checkpoint's BERT has ``bert_model``'s sizes (the configuration the run stores, whose attention heads,
    activation and norms the weights do not show), and ``opt.vocab_size`` (their ``train.py``: the tokenizer's)
    is its vocabulary's; one line naming the first size that differs."""
    found = bert_sizes(text_state)
    for name, value in found.items():
        if int(config[name]) != value:
            raise UserError(f"the checkpoint's BERT has {name} {value} but --bert-model {bert_model} has "
                            f"{config[name]}: give --bert-model the BERT the model was trained from "
                            "(the authors': bert-base-uncased)")
    if opt_vocab_size is not None and int(opt_vocab_size) != found["vocab_size"]:
        raise UserError(f"the checkpoint's options say vocab_size={opt_vocab_size} but its BERT has "
                        f"{found['vocab_size']} token embeddings")


def official_checkpoint_file(source: str | Path) -> Path:
    """The checkpoint file ``source`` names: the file itself, a released model's folder holding
    :data:`MODEL_BEST` (as ``hf download`` leaves it), or ``hf-hub:ORG/NAME/FOLDER``: that file of the Hub
    repository's folder (``hf-hub:cccjc/vse-infty/f30k_butd_region_bert``), from the Hugging Face cache,
    downloaded there first unless offline."""
    text = str(source)
    if not text.startswith(HUB_PREFIX):
        path = Path(source)
        if path.is_dir():
            if not (path / MODEL_BEST).is_file():
                raise UserError(f"checkpoint folder {path} holds no {MODEL_BEST} (a released model's folder, as "
                                "`hf download` leaves it)")
            return path / MODEL_BEST
        if not path.is_file():
            raise UserError(f"checkpoint {path} does not exist")
        return path
    repo, _, revision = text[len(HUB_PREFIX):].partition("@")
    parts = repo.split("/")
    if len(parts) < 3 or not all(parts):
        raise UserError(f"{text!r} names no folder of a Hub repository: write hf-hub:ORG/NAME/FOLDER "
                        "(e.g. hf-hub:cccjc/vse-infty/f30k_butd_region_bert)")
    repo_id, folder = "/".join(parts[:2]), "/".join(parts[2:])
    what = "released checkpoints on the Hugging Face Hub (hf-hub:…)"
    hub = require("huggingface_hub", "hub", what)
    errors = require("huggingface_hub.errors", "hub", what)
    try:
        return Path(hub.hf_hub_download(repo_id, MODEL_BEST, subfolder=folder, revision=revision or None,
                                        cache_dir=hub_cache(), local_files_only=hub_offline()))
    except errors.LocalEntryNotFoundError:
        raise MissingResourceError(f"checkpoint {repo_id}/{folder}/{MODEL_BEST}", hub_cache(),
                                   f"run the command on a connected machine (retr downloads it into the Hugging "
                                   f"Face cache), or `hf download {repo_id} {folder}/{MODEL_BEST}`") from None
    except errors.EntryNotFoundError:
        raise UserError(f"{text}: the repository has no {folder}/{MODEL_BEST}") from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.GatedRepoError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{text}: no such repository on the Hub, or not readable with your token ({reason})") from None
    except (errors.HfHubHTTPError, OSError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{text} could not be fetched ({reason})") from None


def import_vse_infinity_checkpoint(checkpoint: str | Path, vocab_path: str | Path | None, out: str | Path,
                                   trust_checkpoint: bool = False, bert_model: str = DEFAULT_BERT) -> Path:
    """Write a run directory ``out`` from the authors' VSE∞ checkpoint (woodfrog/vse_infty:
    ``{'model': [img_enc, txt_enc], 'opt', …}``), a file, a released model's folder or ``hf-hub:ORG/NAME/FOLDER``
    (:func:`official_checkpoint_file`).

    ``bigru`` branch (BiGRU text): ``vocab_path`` is its word vocabulary (their embedding has one row more:
    ``<mask>``). ``master`` branch (BERT text): no ``vocab_path``; BERT's configuration and WordPiece vocabulary are
    ``bert_model``'s (the authors': ``bert-base-uncased``, from the Hugging Face cache; its weights are not read,
    the checkpoint holds BERT's trained ones), and the checkpoint's BERT must have its sizes."""
    out = Path(out)
    checkpoint = official_checkpoint_file(checkpoint)
    state = _load_official(checkpoint, out, trust_checkpoint, "VSE∞")
    img_state, txt_state = state["model"]
    args = vse_infinity_args_from_opt(state["opt"], txt_state, img_state)
    if args.get("text_encoder") == "bert":
        if vocab_path:
            raise UserError(f"--vocab {vocab_path}: {checkpoint} is a BERT model (the authors' master branch), which "
                            f"tokenises captions with --bert-model {bert_model}'s WordPiece vocabulary (a vocabulary "
                            "file is for a BiGRU model); leave --vocab out")
        bert = pretrained_bert(bert_model)
        fields = dict(vars(state["opt"])) if not isinstance(state["opt"], dict) else dict(state["opt"])
        check_bert_matches(txt_state, bert_model, bert.config, fields.get("vocab_size"))
        args.update(bert_model=bert_model, bert_config=dict(bert.config))
        return _write_run(checkpoint, bert.vocabulary, out, state, "vse-infinity", args, rename=vse_infinity_name)
    if not vocab_path:
        raise UserError(f"{checkpoint} is a BiGRU model (the authors' bigru branch): give --vocab, the "
                        "{name}_vocab.json it was trained with")
    vocab = _word_vocabulary(vocab_path, state, extra_rows=1)
    return _write_run(checkpoint, vocab, out, state, "vse-infinity", args, rename=vse_infinity_name)
