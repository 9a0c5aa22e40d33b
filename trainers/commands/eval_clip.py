"""``retr-train eval-clip``: zero-shot CLIP on a protocol (:mod:`retr.trainers.evaluation.clip_zero_shot`)."""
from __future__ import annotations

import json

import click

from retr.common.cli import InputPath, quiet_option
from retr.trainers.commands.options import FEATURES, MANIFEST, no_verify_option
from retr.trainers.commands.evaluate import echo_numbers
from retr.trainers.evaluation.clip_zero_shot import DEFAULT_PROMPT, evaluate_clip
from retr.trainers.evaluation.metrics import PROTOCOLS, TIE_RULES
from retr.trainers.training.preflight import check_feature_rows


@click.command("eval-clip")
@click.option("--features", required=True, type=FEATURES,
              help="A clip feature set (retr-pipeline extract --extractor clip-…): its row 0 is the image embedding.")
@click.option("--manifest", required=True, type=MANIFEST)
@click.option("--protocol", type=click.Choice(PROTOCOLS), required=True,
              help="f30k-1k / coco-5k: the split as given; coco-1k: five folds, averaged; coco-1k-first: fold one.")
@click.option("--split", default="test", show_default=True)
@click.option("--weights", type=InputPath("file", "a weights file"), default=None,
              help="The weights file the features were extracted with, when they were (its sha256 is checked); "
                   "otherwise the recorded pretrained tag or random seed is used.")
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True,
              help="Text put before every caption (the CLIP paper's zero-shot retrieval); '' for none.")
@click.option("--device", default="auto", show_default=True)
@click.option("--batch-size", type=int, default=256, show_default=True, help="Captions per text-tower call.")
@click.option("--ties", type=click.Choice(TIE_RULES), default="pessimistic", show_default=True)
@click.option("--allow-size-mismatch", is_flag=True,
              help="Evaluate a split whose size is not the protocol's (e.g. the synthetic data); recorded.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with every number.")
@no_verify_option
@quiet_option
def eval_clip_command(features, manifest, protocol, split, weights, prompt, device, batch_size, ties,
                      allow_size_mismatch, as_json, no_verify, quiet) -> None:
    """Evaluate CLIP itself, zero-shot: captions through CLIP's text tower, scored against the stored image
    embeddings, with the same protocols as `retr-train eval`.

    \b
    Example:
      retr-pipeline extract --manifest data/f30k/manifest.jsonl --extractor clip-vit-l-14-336 \\
          --out data/f30k/features
      retr-train eval-clip --features data/f30k/features/clip-vit-l-14-336.h5 \\
          --manifest data/f30k/manifest.jsonl --protocol f30k-1k
    """
    if not no_verify:
        check_feature_rows(features, "--features", quiet)
    result, _ = evaluate_clip(features, manifest, protocol, split, weights, prompt, device, allow_size_mismatch,
                              ties, batch_size, quiet)
    if as_json:
        click.echo(json.dumps(result))
        return
    echo_numbers(result, f"zero-shot CLIP {result['clip_model']} ({result['weights']}), prompt {prompt!r}")
