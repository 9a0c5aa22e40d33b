"""``retr-train jgcar``: JGCAR's training command — the shared options and loop plus JGCAR's own settings."""
from __future__ import annotations

import click

from retr.trainers.commands import common_train_options, run_training
from retr.trainers.models.jgcar import GLOBAL_SIMILARITIES, INTRA_REDUCTIONS, NEGATIVE_MINING, OPTIMIZERS

JGCAR_KEYS = ("embed_size", "word_dim", "hidden_size", "max_words", "dropout", "position_bias", "global_similarity",
              "margin", "max_violation", "lambda2", "lambda3", "lambda4", "intra_reduction", "gamma",
              "num_negatives", "negative_mining", "beta", "labels", "concept_min_captions", "shortlist",
              "optimizer", "momentum", "weight_decay", "num_regions")


@click.command("jgcar")
@common_train_options
@click.option("--labels", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Image labels for the intra-modal losses (JSON {id: [labels]} or .jsonl {id, labels}), e.g. "
                   "COCO instance categories; default: shared caption concepts (see docs/models-jgcar.md).")
@click.option("--shortlist", type=int, default=None, help="Two-step retrieval: candidates re-ranked per query (100).")
@click.option("--gamma", type=float, default=None, help="Bi-rank softmax scale γ (10; the paper also says 20).")
@click.option("--num-negatives", type=int, default=None, help="M′, negatives per comparison set (30).")
@click.option("--negative-mining", type=click.Choice(NEGATIVE_MINING), default=None,
              help="Pick the M′ least (paper) or most similar negatives by the global score.")
@click.option("--beta", type=float, default=None, help="J = β·J_G + (1 − β)·J_C (0.5).")
@click.option("--lambda2", type=float, default=None, help="Weight of the image intra-modal loss J2 (1).")
@click.option("--lambda3", type=float, default=None, help="Weight of the text intra-modal loss J3 (1).")
@click.option("--lambda4", type=float, default=None, help="Weight of the de-correlation loss J4 (1).")
@click.option("--intra-reduction", type=click.Choice(INTRA_REDUCTIONS), default=None,
              help="J2/J3: mean over positives (default, J1's scale) or the literal sum over all triplets.")
@click.option("--global-similarity", type=click.Choice(GLOBAL_SIMILARITIES), default=None,
              help="Ω = V̂ᵀŜ as printed (dot) or on l2-normalised vectors (cosine).")
@click.option("--hidden-size", type=int, default=None, help="Co-attention / phrase hidden size l (512).")
@click.option("--max-words", type=int, default=None, help="Tokens kept per caption (20 COCO, 15 Flickr30K).")
@click.option("--num-regions", type=int, default=None,
              help="Map cells N per image (196 = 14×14 from a 448 input; 49 for --image-size 224 maps).")
@click.option("--dropout", type=float, default=None, help="Dropout on features, words and phrases (0.5).")
@click.option("--position-bias/--shared-bias", default=None,
              help="Per-region/per-word biases b_v, b_s as printed (default) or one bias vector each.")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default=None,
              help="paper: SGD on the encoders + RMSprop on the co-attention; adam: Adam on everything.")
def jgcar_command(**options) -> None:
    """Train JGCAR (joint global and co-attentive representations) on VGG-16 14×14 maps.

    Validation and `retr-train eval` use two-step retrieval: a global shortlist of --shortlist candidates per
    query, re-ranked by the co-attentive score; both steps' numbers and times are reported.

    \b
    Example:
      retr-train jgcar --features data/coco/features/vgg16-maps.h5 --manifest data/coco/manifest.jsonl \\
          --preset coco --labels data/coco/instance_labels.json --out runs/jgcar-coco
      retr-train eval runs/jgcar-coco --protocol coco-1k
    """
    run_training("jgcar", options, JGCAR_KEYS)
