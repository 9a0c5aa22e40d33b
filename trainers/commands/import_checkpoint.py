"""``retr-train import-scan-checkpoint`` and ``import-vsepp-checkpoint``: the authors' released checkpoints as runs
(:mod:`retr.trainers.runs.official_checkpoints`)."""
from __future__ import annotations

from dataclasses import fields

import click

from retr.common.cli import InputPath, OutputPath

from retr.common.paths import check_folder_holds_only
from retr.trainers.models.vse_infinity import VSEInfinityConfig
from retr.trainers.runs.checkpoint import holds_run
from retr.trainers.runs.official_checkpoints import (import_scan_checkpoint, import_vse_infinity_checkpoint,
                                                     import_vsepp_checkpoint)


def _import_options(f):
    """The options both importers take: the vocabulary, the run to create, the trust opt-in."""
    for option in reversed([
            click.option("--vocab", "vocab_path", required=True, type=InputPath("file", "a vocabulary JSON file"),
                         help="The {name}_vocab.json the model was trained with."),
            click.option("--out", required=True, type=OutputPath("folder"), help="Run directory to create."),
            click.option("--allow-nonempty-out", is_flag=True,
                         help="Write the run into a non-empty --out that holds no run (refused otherwise)."),
            click.option("--trust-checkpoint", is_flag=True,
                         help="Read a checkpoint that holds Python objects besides tensors and the official "
                              "argparse Namespace (they can run code: only for files you trust).")]):
        f = option(f)
    return f


def _check_out(out, allow_nonempty_out: bool) -> None:
    """A non-empty --out that holds no run is refused unless --allow-nonempty-out (a run already there: the
    importer's own line)."""
    if not allow_nonempty_out:
        check_folder_holds_only(out, "--out", "a run", holds_run)


@click.command("import-scan-checkpoint")
@click.argument("checkpoint", type=InputPath("file", "a checkpoint file"))
@_import_options
def import_scan_command(checkpoint, vocab_path, out, allow_nonempty_out, trust_checkpoint) -> None:
    """Turn an official SCAN checkpoint into a run that `retr-train eval` can evaluate.

    The file is read without running code (tensors and the official argparse Namespace only).

    \b
    Example:
      retr-train import-scan-checkpoint runs/coco_scan/model_best.pth.tar --vocab vocab/coco_precomp_vocab.json \\
          --out runs/scan-official-coco
      retr-train eval runs/scan-official-coco --protocol coco-1k --features data/coco/features/butd-regions.h5 \\
          --manifest data/coco/manifest.jsonl
    """
    _check_out(out, allow_nonempty_out)
    import_scan_checkpoint(checkpoint, vocab_path, out, trust_checkpoint)
    click.echo(f"imported {checkpoint} → {out}")


@click.command("import-vsepp-checkpoint")
@click.argument("checkpoint", type=InputPath("file", "a checkpoint file"))
@_import_options
def import_vsepp_command(checkpoint, vocab_path, out, allow_nonempty_out, trust_checkpoint) -> None:
    """Turn an official VSE++ checkpoint (fartashf/vsepp, *_precomp model) into a run `retr-train eval` evaluates.

    A command of its own (not an option of import-scan-checkpoint): the two files look alike but hold other
    encoders and options, and a wrong guess would load silently.

    \b
    Example:
      retr-train import-vsepp-checkpoint runs/coco_vse++_resnet_restval/model_best.pth.tar \\
          --vocab vocab/coco_precomp_vocab.json --out runs/vsepp-official-coco
      retr-train eval runs/vsepp-official-coco --protocol coco-1k --features data/coco/features/resnet-precomp.h5 \\
          --manifest data/coco/manifest.jsonl
    """
    _check_out(out, allow_nonempty_out)
    import_vsepp_checkpoint(checkpoint, vocab_path, out, trust_checkpoint)
    click.echo(f"imported {checkpoint} → {out}")


def _bert_model_option(f):
    """``--bert-model``: VSE∞'s setting of that name (its default and help are the model's, said once there)."""
    field = next(f for f in fields(VSEInfinityConfig) if f.name == "bert_model")
    return click.option("--bert-model", default=field.default, show_default=True,
                        help=f"{field.metadata['help'].removeprefix('With --text-encoder bert: ').capitalize()} A BERT checkpoint (master branch) takes its configuration and "
                             "vocabulary from it; the checkpoint's BERT must have its sizes.")(f)


@click.command("import-vse-infinity-checkpoint")
@click.argument("checkpoint", type=InputPath("any", "a checkpoint file or a released model's folder",
                                             takes=lambda v: v.startswith("hf-hub:")))
@click.option("--vocab", "vocab_path", type=InputPath("file", "a vocabulary JSON file"),
              help="BiGRU models (bigru branch): the {name}_vocab.json the model was trained with. BERT models "
                   "(master branch) take none: their vocabulary is --bert-model's.")
@_bert_model_option
@click.option("--out", required=True, type=OutputPath("folder"), help="Run directory to create.")
@click.option("--allow-nonempty-out", is_flag=True,
              help="Write the run into a non-empty --out that holds no run (refused otherwise).")
@click.option("--trust-checkpoint", is_flag=True,
              help="Read a checkpoint that holds Python objects besides tensors and the official argparse Namespace "
                   "(they can run code: only for files you trust).")
def import_vse_infinity_command(checkpoint, vocab_path, bert_model, out, allow_nonempty_out,
                                trust_checkpoint) -> None:
    """Turn the authors' VSE∞ checkpoint (woodfrog/vse_infty; BUTD regions, GPO on both sides) into a run that
    `retr-train eval` can evaluate: the bigru branch's (BiGRU text, with --vocab) or the master branch's (BERT
    text; BERT's configuration and WordPiece vocabulary from --bert-model, read from the Hugging Face cache).
    CHECKPOINT is a model_best.pth, a released model's folder holding one, or a folder of a Hub repository,
    hf-hub:ORG/NAME/FOLDER (the authors' BERT models: hf-hub:cccjc/vse-infty/f30k_butd_region_bert and
    …/coco_butd_region_bert), fetched into the Hugging Face cache on first use. Their grid models (a CNN backbone
    fine-tuned on raw images) are refused in one line: retr works from cached features.

    The file is read without running code (tensors and the official argparse Namespace only).

    \b
    Example:
      retr-train import-vse-infinity-checkpoint hf-hub:cccjc/vse-infty/f30k_butd_region_bert \\
          --out runs/vse-infinity-bert-official-f30k
      retr-train import-vse-infinity-checkpoint runs/f30k_butd_region_bigru/model_best.pth \\
          --vocab vocab/f30k_precomp_vocab.json --out runs/vse-infinity-official-f30k
      retr-train eval runs/vse-infinity-official-f30k --protocol f30k-1k \\
          --features data/f30k/features/butd-regions.h5 --manifest data/f30k/manifest.jsonl
    """
    _check_out(out, allow_nonempty_out)
    import_vse_infinity_checkpoint(checkpoint, vocab_path, out, trust_checkpoint, bert_model)
    click.echo(f"imported {checkpoint} → {out}")
