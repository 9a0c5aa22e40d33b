"""Import official SCAN / VSE++ / VSE∞ checkpoints (``model_best.pth(.tar)``) as retr runs.

Read with ``weights_only=True`` allowing exactly ``argparse.Namespace`` (else ``--trust-checkpoint``); the run gets
``config.json``, ``vocab.json`` and ``best.pt``, but no features or manifest."""
from __future__ import annotations

import argparse
from pathlib import Path


from retr.common.errors import UserError
from retr.common.version import __version__
from retr.store.vocab import Vocabulary
from retr.trainers.config import settings_from_stored
from retr.trainers.models import get_spec
from retr.trainers.runs import checkpoint as ckpt
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


def _write_run(checkpoint: Path, vocab_path: str | Path, out: Path, state: dict, model_name: str, args: dict,
               extra_rows: int = 0, rename=None) -> Path:
    """Load the official encoders' states into retr's model and write the run directory. ``extra_rows``: word
    embedding rows beyond the vocabulary (VSE∞'s ``<mask>``); ``rename``: official parameter name → retr's (None:
    not loaded)."""
    vocab = Vocabulary.load(vocab_path)
    img_state, txt_state = state["model"]
    vocab_rows = txt_state["embed.weight"].shape[0] if "embed.weight" in txt_state else None
    if vocab_rows != len(vocab) + extra_rows:
        raise UserError(f"{vocab_path} has {len(vocab)} words but the checkpoint's embedding has {vocab_rows} rows"
                        + (f" ({extra_rows} beyond the vocabulary expected)" if extra_rows else "")
                        + "; use the vocabulary the model was trained with")
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
    return _write_run(checkpoint, vocab_path, out, state, "scan", scan_args_from_opt(state["opt"]))


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
    return _write_run(checkpoint, vocab_path, out, state, "vsepp", vsepp_args_from_opt(state["opt"]))




#: woodfrog/vse_infty ``opt`` fields (``bigru`` branch) that decide the scores of a precomputed-region model
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


def vse_infinity_name(name: str) -> str | None:
    """retr's name of the authors' VSE∞ parameter ``name`` (None: a parameter their forward never uses: their MLP's
    second batch norm, BERT's pooler, whose output their ``EncoderText`` does not read)."""
    if name.startswith(("img_enc.mlp.bns.1.", "txt_enc.bert.pooler.")):
        return None
    for old, new in VSE_INFINITY_RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def vse_infinity_args_from_opt(opt, text_state: dict) -> dict:
    """VSE∞ settings from woodfrog/vse_infty's ``opt`` (BiGRU text, precomputed regions): every field honoured or
    irrelevant, else refused by name; the BERT text encoder (their ``master`` branch), the fine-tuned backbone
    (``precomp_enc_type=backbone``) and turned-off normalisation cannot be expressed and are refused."""
    fields = dict(vars(opt)) if not isinstance(opt, dict) else dict(opt)
    if any(k.startswith("bert.") for k in text_state) or "bert" in str(fields.get("text_encoder", "")):
        raise UserError("a VSE∞ checkpoint with the BERT text encoder (the authors' master branch): retr's VSE∞ has "
                        "their BiGRU text encoder (the bigru branch) and cannot express it")
    unknown = sorted(set(fields) - set(VSE_INFINITY_HONOURED) - set(VSE_INFINITY_IRRELEVANT))
    if unknown:
        raise UserError(f"the checkpoint's options have field(s) retr does not know: "
                        f"{', '.join(f'{k}={fields[k]!r}' for k in unknown)}; cannot tell whether they change the scores")
    enc = fields.get("precomp_enc_type", "basic")
    if enc != "basic":
        raise UserError(f"precomp_enc_type={enc!r}: a VSE∞ model over "
                        + ("a CNN backbone it fine-tunes (raw images); retr trains from cached features"
                           if enc == "backbone" else "an image encoder retr does not know"))
    for flag in ("no_imgnorm", "no_txtnorm"):
        if fields.get(flag):
            raise UserError(f"{flag}=True: retr's VSE∞ always normalises its embeddings (as the authors' runs did)")
    return {"img_dim": int(fields.get("img_dim", 2048)), "embed_size": int(fields.get("embed_size", 1024)),
            "word_dim": int(fields.get("word_dim", 300)), "num_layers": int(fields.get("num_layers", 1)),
            "image_mlp": True, "margin": float(fields.get("margin", 0.2)),
            "max_violation": bool(fields.get("max_violation", False))}


def import_vse_infinity_checkpoint(checkpoint: str | Path, vocab_path: str | Path, out: str | Path,
                                   trust_checkpoint: bool = False) -> Path:
    """Write a run directory ``out`` from the authors' VSE∞ checkpoint (woodfrog/vse_infty, ``bigru`` branch:
    ``{'model': [img_enc, txt_enc], 'opt', …}``) and its vocabulary (their embedding has one row more: ``<mask>``)."""
    checkpoint, out = Path(checkpoint), Path(out)
    state = _load_official(checkpoint, out, trust_checkpoint, "VSE∞")
    args = vse_infinity_args_from_opt(state["opt"], state["model"][1])
    return _write_run(checkpoint, vocab_path, out, state, "vse-infinity", args, extra_rows=1,
                      rename=vse_infinity_name)
