"""``retr-pipeline build-concepts``: SMFEA/CVSE concept data of a dataset (the stage: :mod:`retr.pipeline.concepts`)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import click
import numpy as np

from retr.common.cli import InputPath, OutputPath, quiet_option, splits_option
from retr.common.errors import UserError
from retr.pipeline.concepts import DEFAULT_ADJECTIVES, DEFAULT_NOUNS, DEFAULT_VERBS, build_concepts_file


@click.command("build-concepts")
@click.option("--manifest", "manifest", required=True, type=InputPath("file", "a JSON Lines manifest", path_type=Path),
              help="The dataset's manifest.jsonl (labels are written for every caption of every split).")
@click.option("--out", required=True, type=OutputPath("file", path_type=Path), help="concepts.h5 to write.")
@click.option("--conllu", type=InputPath("file", "a CoNLL-U file", path_type=Path), default=None,
              help="CoNLL-U of every caption (# sent_id = <image id>#<k>): lemmas and POS. "
                   "Required unless --select frequency.")
@click.option("--nouns", type=click.IntRange(min=0), default=DEFAULT_NOUNS, show_default=True)
@click.option("--adjectives", type=click.IntRange(min=0), default=DEFAULT_ADJECTIVES, show_default=True)
@click.option("--verbs", type=click.IntRange(min=0), default=DEFAULT_VERBS, show_default=True)
@splits_option("--train-split", "--train-splits", "train_splits", default=("train", "restval"),
               help="Splits whose captions define the vocabulary and the graph.")
@click.option("--select", type=click.Choice(["pos", "frequency"]), default="pos", show_default=True,
              help="pos: CVSE's nouns/adjectives/verbs from --conllu (the reading that reproduces CVSE/SMFEA); "
                   "frequency: the most frequent non-function words, without part-of-speech tags or lemmas.")
@quiet_option
def build_concepts_command(manifest: Path, out: Path, conllu: Path | None, nouns: int, adjectives: int,
                           verbs: int, train_splits: tuple[str, ...], select: str, quiet: bool) -> None:
    """Build SMFEA/CVSE concept data: vocabulary, caption/image multi-hot labels, co-occurrence graph.

    The vocabulary is the most frequent training nouns, adjectives and verbs (CVSE: 210/60/30); the graph is
    CVSE's thresholded conditional-probability graph. Every `retr-train smfea` run reuses the file.

    \b
    Example:
      retr-pipeline build-concepts --manifest data/synthetic/manifest.jsonl \\
          --conllu data/synthetic/captions.conllu --out data/synthetic/concepts.h5
    """
    if select == "pos" and conllu is None:
        raise UserError("build-concepts needs part-of-speech tags for CVSE's 210 nouns / 60 adjectives / 30 verbs: "
                        "give --conllu FILE (the captions tagged with UPOS and lemmas, e.g. by stanza's "
                        "tokenize,pos,lemma with the models of `retr-pipeline fetch-parser-models`), or "
                        "--select frequency for the POS-free fallback")
    if select == "frequency":
        conllu = None
    splits = train_splits
    data = build_concepts_file(manifest, out, conllu, nouns, adjectives, verbs, splits)
    parts = Counter(data.pos)
    edges = int(((data.adjacency > 0) & ~np.eye(len(data.concepts), dtype=bool)).sum())
    click.echo(f"wrote {out}: {len(data.concepts)} concepts ("
               + ", ".join(f"{n} {p}" for p, n in parts.items())
               + f"; POS from {data.attrs['pos_source']}), {edges} graph edges, labels for "
               f"{len(data.caption_keys)} captions / {len(data.image_ids)} images")
    if select == "frequency":  # said once the inputs were read: a bad input is then one error line, alone
        click.echo("note: --select frequency: concepts are the most frequent words, not CVSE's POS split", err=True)
