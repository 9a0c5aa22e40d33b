"""``retr-train`` commands: one training command per model (same options for every model), ``eval``,
``table`` and ``import-scan-checkpoint``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import click
import numpy as np

from retr.common.cli import quiet_option
from retr.common.errors import UserError
from retr.trainers import checkpoint as ckpt
from retr.trainers.loop import TrainConfig, train
from retr.trainers.models import preset as model_preset

DATASETS = ("coco", "f30k")
#: training hyperparameters every model takes (None = from the preset)
TRAIN_KEYS = ("epochs", "batch_size", "lr", "lr_update", "grad_clip", "early_stop")


def common_train_options(f: Callable) -> Callable:
    """The options of every model's training command (later models reuse them)."""
    options = [
        click.option("--features", required=True, type=click.Path(dir_okay=False), help="Feature set (.h5)."),
        click.option("--manifest", required=True, type=click.Path(dir_okay=False), help="Manifest (.jsonl)."),
        click.option("--out", required=True, type=click.Path(file_okay=False), help="Run directory."),
        click.option("--preset", type=click.Choice(DATASETS), default=None,
                     help="Published hyperparameters for COCO or Flickr30K (default: Flickr30K's); "
                          "explicit options override it."),
        click.option("--epochs", type=int, default=None),
        click.option("--batch-size", type=int, default=None, help="Global batch (split over DDP ranks)."),
        click.option("--lr", type=float, default=None, help="Adam learning rate."),
        click.option("--lr-update", type=int, default=None, help="Multiply the lr by 0.1 every N epochs."),
        click.option("--grad-clip", type=float, default=None, help="Gradient-norm clip (0 = off)."),
        click.option("--early-stop", type=int, default=None,
                     help="Stop after N epochs without a better validation rSum (0 = never; default: the "
                          "preset's, 0 for most models, 5 for JGCAR)."),
        click.option("--margin", type=float, default=None, help="Hinge margin."),
        click.option("--max-violation/--sum-violation", default=None,
                     help="Hardest negatives (default) or the sum over all negatives."),
        click.option("--embed-size", type=int, default=None, help="Joint embedding size d."),
        click.option("--word-dim", type=int, default=None, help="Word embedding size."),
        click.option("--vocab", type=click.Path(dir_okay=False), default=None,
                     help="Use this vocabulary (SCAN's {name}_vocab.json) instead of building one."),
        click.option("--train-split", "train_splits", multiple=True, default=("train", "restval"), show_default=True),
        click.option("--val-split", default="val", show_default=True),
        click.option("--val-images", type=int, default=1000, show_default=True,
                     help="Validate on the first N validation images (0 = all)."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:1 … (auto: cuda if any)."),
        click.option("--workers", type=int, default=0, show_default=True, help="DataLoader worker processes."),
        click.option("--preload/--no-preload", default=None,
                     help="Hold the features in memory (default: only when they take < 2 GiB)."),
        click.option("--amp", is_flag=True, help="Mixed precision (CUDA only)."),
        click.option("--log-every", type=int, default=10, show_default=True, help="Steps between metrics lines."),
        click.option("--resume", is_flag=True, help="Continue the run in --out from its newest checkpoint."),
        quiet_option,
    ]
    for option in reversed(options):
        f = option(f)
    return f


def run_training(model: str, options: dict, model_keys: tuple[str, ...], direction: str | None = None) -> None:
    """Merge preset and explicit options into a :class:`TrainConfig` and train."""
    values = model_preset(model, options["preset"], direction)
    for key in (*TRAIN_KEYS, *model_keys):
        if options.get(key) is not None:
            values[key] = options[key]
    model_args = {k: values[k] for k in model_keys if k in values}
    cfg = TrainConfig(model=model, model_args=model_args, features=options["features"],
                      manifest=options["manifest"], out=options["out"], epochs=values["epochs"],
                      batch_size=values["batch_size"], lr=values["lr"], lr_update=values["lr_update"],
                      grad_clip=values["grad_clip"], seed=options["seed"], device=options["device"],
                      workers=options["workers"], preload=options["preload"], amp=options["amp"],
                      train_splits=list(options["train_splits"]), val_split=options["val_split"],
                      val_images=options["val_images"], vocab=options["vocab"], log_every=options["log_every"],
                      preset=options["preset"], early_stop=int(values.get("early_stop") or 0))
    if cfg.epochs < 1 or cfg.batch_size < 2:
        raise UserError("--epochs must be ≥ 1 and --batch-size ≥ 2")
    train(cfg, resume=options["resume"], quiet=options["quiet"], log=lambda m: click.echo(m, err=True))
    click.echo(f"run written to {cfg.out} (evaluate: retr-train eval {cfg.out} --protocol f30k-1k)")


SCAN_KEYS = ("embed_size", "word_dim", "direction", "agg", "norm", "lambda_softmax", "lambda_lse", "bi_gru",
             "no_imgnorm", "precomp_enc_type", "margin", "max_violation")


@click.command("scan")
@common_train_options
@click.option("--direction", type=click.Choice(["t2i", "i2t"]), default=None,
              help="t2i: words attend to regions (default); i2t: regions attend to words.")
@click.option("--agg", type=click.Choice(["lse", "avg", "max", "sum"]), default=None, help="Aggregation (lse).")
@click.option("--norm", type=click.Choice(["clipped_l2norm", "l2norm", "clipped", "softmax", "no_norm"]),
              default=None, help="Normalisation of the attention logits (clipped_l2norm).")
@click.option("--lambda-softmax", type=float, default=None, help="Inverse temperature λ1 of the attention.")
@click.option("--lambda-lse", type=float, default=None, help="λ2 of LogSumExp aggregation.")
@click.option("--bi-gru/--uni-gru", default=None, help="Bidirectional GRU, directions averaged (default).")
@click.option("--no-imgnorm", is_flag=True, default=None, help="Do not l2-normalise region vectors.")
@click.option("--precomp-enc-type", type=click.Choice(["basic", "weight_norm"]), default=None)
def scan_command(**options) -> None:
    """Train SCAN (stacked cross attention) on region features.

    \b
    Example:
      retr-train scan --features data/f30k/features/butd-regions.h5 --manifest data/f30k/manifest.jsonl \\
          --preset f30k --direction i2t --agg avg --out runs/scan-f30k-i2t-avg
    """
    options["no_imgnorm"] = options["no_imgnorm"] or None
    run_training("scan", options, SCAN_KEYS, options["direction"])


VSEPP_KEYS = ("embed_size", "word_dim", "bi_gru", "margin", "max_violation")


@click.command("vsepp")
@common_train_options
@click.option("--bi-gru/--uni-gru", default=None, help="Caption GRU direction (VSE++: unidirectional).")
def vsepp_command(**options) -> None:
    """Train the VSE++ baseline on any feature kind (vectors averaged over regions/grid cells/crops).

    \b
    Example:
      retr-train vsepp --features data/coco/features/tencrop-resnet152.h5 --manifest data/coco/manifest.jsonl \\
          --preset coco --out runs/vsepp-coco
    """
    run_training("vsepp", options, VSEPP_KEYS)
