"""``retr-train sman`` and ``retr-train seam``: the shared training options and loop plus each model's own."""
from __future__ import annotations

import click

from retr.trainers.commands import common_train_options, run_training
from retr.trainers.models.seam import CROP_MODES, PENALTY_NORMS, TEXT_ENCODERS
from retr.trainers.models.sman import EVAL_SCORES, INTRA_PAIR_LEVELS, OPTIMIZERS, TEXT_RNNS

SMAN_KEYS = ("embed_size", "word_dim", "alpha", "use_location", "multimodal_step", "intra_pair_weight",
             "intra_pair_margin", "intra_pair_level", "eval_score", "divide_by_cells", "text_rnn", "dropout",
             "optimizer", "rho", "weight_decay", "shortlist", "margin", "max_violation")


@click.command("sman")
@common_train_options
@click.option("--alpha", type=float, default=None,
              help="Fusion gate α of Eq. 12 (0.9); 1 = stacked intra-modal attention (SMAN-SIM).")
@click.option("--location/--no-location", "use_location", default=None,
              help="GRU location vector in the visual query (default on; off = SMAN-IM).")
@click.option("--multimodal-step/--intra-only", "multimodal_step", default=None,
              help="Second, multi-modal attention step (default on; off = SMAN-IM[-LOC]).")
@click.option("--intra-pair-weight", type=float, default=None, help="λ of Eq. 23 (1); 0 = SMAN-inter.")
@click.option("--intra-pair-margin", type=float, default=None, help="m2 of Eq. 22 (0.25).")
@click.option("--intra-pair-level", type=click.Choice(INTRA_PAIR_LEVELS), default=None,
              help="Eq. 22 per level and summed (each, default) or once on the summed distance.")
@click.option("--eval-score", type=click.Choice(EVAL_SCORES), default=None,
              help="Evaluation score: sum of per-level cosines (default) or cosine of the raw concatenation.")
@click.option("--divide-by-cells", is_flag=True, default=None,
              help="Keep the 1/M printed in Eq. 7/15 (default: dropped).")
@click.option("--text-rnn", type=click.Choice(TEXT_RNNS), default=None, help="Bi-LSTM (paper) or bi-GRU.")
@click.option("--dropout", type=float, default=None, help="Dropout on grid features and word embeddings (0.3).")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default=None, help="Adadelta (paper) or Adam.")
@click.option("--weight-decay", type=float, default=None, help="Adadelta weight decay (5e-4).")
@click.option("--shortlist", type=int, default=None,
              help="Evaluate in two steps: shortlist K by the pair-independent levels, re-score them with all "
                   "three (default 0: score every pair, as the paper).")
def sman_command(**options) -> None:
    """Train SMAN (stacked multi-modal attention) on ResNet-152 7×7 grid features.

    Pair-specific: validation and `retr-train eval` score every image–caption pair, in blocks.

    \b
    Example:
      retr-train sman --features data/f30k/features/resnet152-grid.h5 --manifest data/f30k/manifest.jsonl \\
          --preset f30k --out runs/sman-f30k
      retr-train sman --features data/f30k/features/resnet152-grid.h5 --manifest data/f30k/manifest.jsonl \\
          --preset f30k --alpha 1 --intra-pair-weight 0 --out runs/sman-f30k-sim-inter
    """
    options["divide_by_cells"] = options["divide_by_cells"] or None
    run_training("sman", options, SMAN_KEYS)


SEAM_KEYS = ("embed_size", "word_dim", "text_encoder", "hops", "attention_hidden", "conv_filters", "gru_size",
             "penalty_weight", "penalty_norm", "order_squared", "crops", "input_l2norm", "margin", "max_violation")


@click.command("seam")
@common_train_options
@click.option("--text-encoder", type=click.Choice(TEXT_ENCODERS), default="c", show_default=True,
              help="SEAM-E (attention over embeddings), SEAM-C (convolutions) or SEAM-G (GRU).")
@click.option("--hops", type=int, default=None, help="Attention hops (E/G: 30, C: 10 per module).")
@click.option("--gru-size", type=int, default=None, help="SEAM-G's GRU size (512, the paper's reported model).")
@click.option("--penalty-weight", type=float, default=None, help="λ of the attention penalty (0.5; 0 = off).")
@click.option("--penalty-norm", type=click.Choice(PENALTY_NORMS), default=None,
              help="‖AAᵀ − I‖_F squared (paper, default) or plain (the authors' code).")
@click.option("--order-squared", is_flag=True, default=None,
              help="Square the order violation (original order embeddings); default: its norm.")
@click.option("--crops", type=click.Choice(CROP_MODES), default=None,
              help="Average the 10 crops (default) or train on one random crop per image.")
def seam_command(**options) -> None:
    """Train SEAM-E/C/G (self-attentive caption embeddings, order violation) on 10-crop features.

    \b
    Example:
      retr-train seam --features data/coco/features/tencrop-vgg19.h5 --manifest data/coco/manifest.jsonl \\
          --preset coco --text-encoder c --out runs/seam-c-coco
      retr-train eval runs/seam-c-coco --protocol coco-1k
    """
    options["order_squared"] = options["order_squared"] or None
    run_training("seam", options, SEAM_KEYS)
