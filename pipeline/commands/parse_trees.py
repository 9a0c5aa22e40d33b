"""``retr-pipeline parse-trees`` and ``show-tree``: referral trees of a manifest's captions, or of one caption.

The stage (sharding, resume, dictionaries, the failure threshold): :mod:`retr.pipeline.parse_trees`; the tree
rules: :mod:`retr.parsers.referral_tree`. ``fetch-parser-models`` (stanza's models) is in
:mod:`retr.pipeline.commands.fetch`.
"""
from __future__ import annotations

import click
from nltk.tree import TreePrettyPrinter

from retr.common.cli import InputPath, OutputPath, quiet_option
from retr.common.errors import UserError
from retr.parsers.backends import CaptionItem, ConlluBackend, ParserBackend, StanzaBackend
from retr.parsers.dictionaries import DEFAULT_NUM_ENTITIES, DEFAULT_NUM_RELATIONS, Dictionaries, load_dictionaries
from retr.parsers.referral_tree import VERB_PREP_STYLES, TreeBuilder, TreeRules
from retr.parsers.schemes import SCHEME_CHOICES, ConversionError, SchemeConverter, conversion_summary
from retr.pipeline.parse_trees import (DEFAULT_BATCH_SIZE, DEFAULT_MAX_FAILURES, DEFAULT_SHARD_SIZE, resolve_scheme,
                                      run_parse_trees)


def _backend(conllu: str | None, stanza_dir: str | None, match: str, device: str, constituency: bool
             ) -> ParserBackend:
    if conllu is not None and stanza_dir is not None:
        raise UserError("give either --conllu FILE or --stanza-dir DIR, not both")
    if conllu is not None:
        return ConlluBackend(conllu, match=match)
    return StanzaBackend(stanza_dir, device=device, constituency=constituency)


def _parser_options(f):
    f = click.option("--scheme", type=click.Choice(SCHEME_CHOICES), default="auto", show_default=True,
                     help="dependency labels of the parses: auto (detected from the CoNLL-U file's labels), ud2, "
                          "ud1 (UD v1), sd (Stanford basic dependencies) or clearnlp (ClearNLP / spaCy "
                          "English); converted to UD v2 before the tree rules.")(f)
    f = click.option("--no-constituency", "no_constituency", is_flag=True,
                     help="stanza: skip the constituency parser (the tree rules read dependencies only).")(f)
    f = click.option("--device", default="auto", show_default=True, help="stanza: auto, cpu, cuda or cuda:N.")(f)
    f = click.option("--match", type=click.Choice(["auto", "key", "order"]), default="auto", show_default=True,
                     help="CoNLL-U: match sentences to captions by '# sent_id' (key) or by order.")(f)
    f = click.option("--stanza-dir", type=InputPath("folder", "a stanza model folder", resource=True),
                     help="stanza model folder (default: $STANZA_RESOURCES_DIR, else stanza's own).")(f)
    f = click.option("--conllu", type=InputPath("file", "a CoNLL-U file"),
                     help="parses made elsewhere (CoNLL-U, '# sent_id = <image id>#<caption index>'); needs no "
                          "extra, unlike stanza (the pipeline extra).")(f)
    f = click.option("--verb-prep", type=click.Choice(VERB_PREP_STYLES), default="placeholder",
                     show_default=True,
                     help="verb with a prepositional complement: run_PREP (paper) or run_on (word).")(f)
    return f


@click.command("parse-trees")
@click.option("--manifest", required=True, type=InputPath("file", "a JSON Lines manifest"), help="manifest.jsonl")
@click.option("--out", required=True, type=OutputPath("file"), help="trees.h5 to write")
@_parser_options
@click.option("--dictionaries", type=InputPath("file", "a trees.h5 or JSON file"),
              help="reuse the dictionaries of this trees.h5 (or JSON) instead of building them.")
@click.option("--num-entities", default=DEFAULT_NUM_ENTITIES, show_default=True,
              help="entity dictionary size, null and unknown included.")
@click.option("--num-relations", default=DEFAULT_NUM_RELATIONS, show_default=True,
              help="relation dictionary size, null and unknown included.")
@click.option("--min-count", default=1, show_default=True, help="drop labels seen fewer times in training.")
@click.option("--shard-size", default=DEFAULT_SHARD_SIZE, show_default=True, help="captions per parse shard.")
@click.option("--batch-size", default=DEFAULT_BATCH_SIZE, show_default=True, help="captions per parser call.")
@click.option("--restart", is_flag=True, help="discard the parse shards of an earlier run and parse again.")
@click.option("--max-failures", type=float, default=DEFAULT_MAX_FAILURES, show_default=True, metavar="FRACTION",
              help="largest share of captions that may get no tree; above it the command exits 1 with one error "
                   "line and does not write OUT (the parse shards stay). 0: no failure allowed, 1: no limit.")
@quiet_option
def parse_trees_command(manifest, out, verb_prep, conllu, stanza_dir, match, device, no_constituency, scheme,
                        dictionaries, num_entities, num_relations, min_count, shard_size, batch_size, restart,
                        max_failures, quiet):
    """Parse every caption of a manifest into a referral tree [E1 R2 E3 R4 E5 R6 E7] (trees.h5).

    Sharded under OUT.shards/ and resumable: run the same command again after an interruption. Parses in UD
    v1, Stanford basic dependencies or ClearNLP labels are detected and converted to UD v2 (--scheme). Exits 1
    without writing OUT when more than --max-failures of the captions get no tree.

    \b
    Example:
      retr-pipeline parse-trees --manifest data/synthetic/manifest.jsonl \\
          --conllu data/synthetic/captions.conllu --out data/synthetic/trees.h5
      retr-pipeline parse-trees --manifest data/f30k/manifest.jsonl --stanza-dir ~/stanza_resources \\
          --dictionaries data/coco/trees.h5 --out data/f30k/trees.h5
      retr-pipeline parse-trees --manifest data/coco/manifest.jsonl --conllu stanford_parser.conll \\
          --scheme sd --out data/coco/trees.h5
    """
    backend = _backend(conllu, stanza_dir, match, device, not no_constituency)
    summary = run_parse_trees(manifest, out, backend, dictionaries=dictionaries, num_entities=num_entities,
                              num_relations=num_relations, min_count=min_count,
                              rules=TreeRules(verb_prep=verb_prep), shard_size=shard_size,
                              batch_size=batch_size, quiet=quiet, restart=restart, scheme=scheme,
                              max_failures=max_failures)
    for line in summary.lines():
        click.echo(line)


@click.command("show-tree")
@click.argument("text", required=False)
@_parser_options
@click.option("--key", help="CoNLL-U: take the sentence with this sent_id instead of matching TEXT.")
@click.option("--dictionaries", type=InputPath("file", "a trees.h5 or JSON file"),
              help="also show the ids in these dictionaries (a trees.h5 or JSON).")
def show_tree_command(text, verb_prep, conllu, stanza_dir, match, device, no_constituency, scheme, key,
                      dictionaries):
    """Print the referral tree of one caption TEXT (bracketed, slot by slot, and drawn).

    With --conllu, TEXT is looked up in the file (or give --key instead of TEXT).

    \b
    Example:
      retr-pipeline show-tree "a dog runs on the grass near a fence" --stanza-dir ~/stanza_resources
      retr-pipeline show-tree "a small red circle sits above a large blue square" \\
          --conllu data/synthetic/captions.conllu
      retr-pipeline show-tree --key synth_00000#0 --conllu data/synthetic/captions.conllu
    """
    if not text and not (key and conllu):
        raise UserError("give the caption TEXT (or --key KEY with --conllu FILE)")
    backend = _backend(conllu, stanza_dir, match, device, not no_constituency)
    choice = resolve_scheme(backend, scheme)
    if isinstance(backend, ConlluBackend):
        sentence = backend.find_key(key) if key else backend.find_text(text)
        if sentence is None:
            raise UserError(f"no sentence in {conllu} " + (f"with sent_id {key}" if key else f"reads {text!r}"))
    else:
        outcome = backend.parse([CaptionItem(0, "input#0", text)])[0]
        if outcome.sentence is None:
            raise UserError(outcome.error or "stanza returned no sentence")
        sentence = outcome.sentence
    try:
        converted, applied = SchemeConverter(choice.scheme, trusted=choice.trusted).convert(sentence)
    except ConversionError as exc:
        raise UserError(f"cannot convert this sentence from {choice.scheme} to UD v2: {exc}") from None
    tree = TreeBuilder(TreeRules(verb_prep=verb_prep)).build(converted)
    text = text or sentence.text or " ".join(w.form for w in sentence.words)
    click.echo(f"caption  {text}")
    click.echo(f"tree     {tree.bracketed()}")
    click.echo("slots    " + "  ".join(f"{name}={label}" for name, label in
                                       zip(("E1", "R2", "E3", "R4", "E5", "R6", "E7"), tree.labels())))
    click.echo(f"scheme   {choice.describe()}; converted to UD v2: {conversion_summary(applied)}")
    if dictionaries:
        dicts: Dictionaries = load_dictionaries(dictionaries)
        ids = dicts.encode(tree)
        click.echo(f"ids      {ids.tolist()}  {tree.bracketed(dicts.display_labels(tree, ids))}")
    if sentence.constituency is not None:
        click.echo(f"parse    {sentence.constituency}")
    click.echo("")
    click.echo(TreePrettyPrinter(tree.to_nltk()).text())
