"""The referral-tree stage behind ``retr-pipeline parse-trees``: parse shards, then encode ``trees.h5``.

Shards, resume, scheme conversion and ``--max-failures``: docs/referral-trees.md ("Files, sharding and resume")."""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from retr.common.progress import progress
from retr.common.errors import ParameterError, UserError
from retr.manifests.schema import ManifestRecord, manifest_sha256, read_manifest
from retr.parsers.backends import CaptionItem, ConlluBackend, ParserBackend
from retr.parsers.dictionaries import (DEFAULT_NUM_ENTITIES, DEFAULT_NUM_RELATIONS, NULL_ID, UNKNOWN_ID,
                                       build_dictionaries, load_dictionaries)
from retr.parsers.referral_tree import ReferralTree, TreeBuilder, TreeRules
from retr.parsers.schemes import (ConversionError, SchemeChoice, SchemeConverter, choose_scheme,
                                  conversion_summary)
from retr.store.trees import parse_shard_name, read_parse_shard, write_parse_shard, write_trees

DEFAULT_SHARD_SIZE = 5000
DEFAULT_BATCH_SIZE = 64
#: the share of captions that may fail (no tree) before a run is refused: far above what a sound parse loses
#: (a few captions whose text or parse is odd) and far below a wrong input (wrong --scheme, --match or file:
#: nearly every caption fails); see docs/referral-trees.md, "Too many failures".
DEFAULT_MAX_FAILURES = 0.05
DICTIONARY_SPLITS = ("train", "restval")
#: Shard attributes that must match the current run for a finished shard to be reused.
_IDENTITY = ("manifest_sha256", "backend_kind", "rules", "scheme", "shard_index", "num_shards", "first_caption",
             "stop_caption")
#: what a shard written before label schemes existed was read as
_SHARD_DEFAULTS = {"scheme": "ud2"}


@dataclass
class ParseTreesSummary:
    out: Path
    captions: int
    trees: int
    failures: list[tuple[str, str]]
    shards_parsed: int
    shards_reused: int
    num_entities: int
    num_relations: int
    entity_known: float  # share of non-null entity slots with a dictionary id (not unknown)
    relation_known: float
    unmatched_parses: list[str] = field(default_factory=list)
    scheme: SchemeChoice = field(default_factory=lambda: SchemeChoice("ud2", "stanza"))
    conversions: dict[str, int] = field(default_factory=dict)  # conversion name → count, over every shard
    max_failures: float = DEFAULT_MAX_FAILURES

    @property
    def failure_fraction(self) -> float:
        """Failures over captions."""
        return len(self.failures) / self.captions if self.captions else 0.0

    def lines(self) -> list[str]:
        lines = [f"wrote {self.trees} trees for {self.captions} captions to {self.out} "
                 f"({len(self.failures)} failures, {percent(self.failure_fraction)} of the captions, threshold "
                 f"{percent(self.max_failures)}; shards parsed {self.shards_parsed}, reused {self.shards_reused})",
                 f"scheme {self.scheme.describe()}; converted to UD v2: {conversion_summary(self.conversions)}",
                 f"dictionaries: {self.num_entities} entities, {self.num_relations} relations "
                 f"(null = {NULL_ID}, unknown = {UNKNOWN_ID}); known slots: entities {100 * self.entity_known:.1f}%, "
                 f"relations {100 * self.relation_known:.1f}%"]
        for key, reason in self.failures[:5]:
            lines.append(f"  failed {key}: {reason}")
        if len(self.failures) > 5:
            lines.append(f"  … {len(self.failures) - 5} more failures (listed in {self.out.name}:/failures)")
        if self.unmatched_parses:
            lines.append(f"note: {len(self.unmatched_parses)} CoNLL-U sentences match no manifest caption "
                         f"(e.g. {self.unmatched_parses[0]})")
        return lines


class TooManyFailures(UserError):
    """More captions failed than ``max_failures`` allows; ``trees.h5`` was not written (the parse shards were).

    Attributes: ``failures`` (caption key, reason), ``captions`` (the manifest's count), ``max_failures``."""

    def __init__(self, message: str, failures: list[tuple[str, str]], captions: int, max_failures: float):
        super().__init__(message, parameters=("max_failures",))
        self.failures, self.captions, self.max_failures = failures, captions, max_failures


def percent(fraction: float) -> str:
    """``0.05`` → ``5%``, ``89 / 93`` → ``95.7%``, ``2 / 121`` → ``1.65%``."""
    return f"{100 * fraction:.3g}%"


def check_failures(failures: Sequence[tuple[str, str]], captions: int, max_failures: float, out: Path,
                   folder: Path) -> None:
    """Raise :class:`TooManyFailures` (one line) when ``failures`` are more than ``max_failures`` of ``captions``."""
    if not failures or len(failures) / captions <= max_failures:  # the division rounds like 0.29 does: 29/100
        return
    key, reason = failures[0]
    reason = " ".join(reason.split())
    raise TooManyFailures(
        f"{len(failures)} of {captions} captions got no tree ({percent(len(failures) / captions)}), more than "
        f"max_failures {max_failures:g} ({percent(max_failures)}) allows; {out} not written (the parses stay in "
        f"{folder.name}/ beside it); first failure {key}: {reason}; check the input (its scheme, how sentences match "
        "captions) or raise max_failures (1 writes the trees anyway)", list(failures), captions, max_failures)


def caption_items(records: Sequence[ManifestRecord]) -> tuple[list[CaptionItem], list[str]]:
    """Every caption of the manifest in order, with the split of its image."""
    items, splits = [], []
    for record in records:
        for k, text in enumerate(record.captions):
            items.append(CaptionItem(len(items), record.caption_key(k), text))
            splits.append(record.split)
    return items, splits


def shard_folder(out: str | os.PathLike) -> Path:
    """``<out>.shards`` next to ``<out>``."""
    out = Path(out)
    return out.with_name(out.name + ".shards")


def _parse_shard(backend: ParserBackend, converter: SchemeConverter, builder: TreeBuilder,
                 items: Sequence[CaptionItem], batch_size: int, bar
                 ) -> tuple[list[str], list[str], list[tuple[str, str]], Counter]:
    keys, candidates, failures, conversions = [], [], [], Counter()
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        for item, outcome in zip(batch, backend.parse(batch)):
            if outcome.sentence is None:
                failures.append((item.key, outcome.error or "no parse"))
                continue
            try:
                sentence, applied = converter.convert(outcome.sentence)
            except ConversionError as exc:
                failures.append((item.key, f"cannot convert from {converter.scheme} to UD v2: {exc}"))
                continue
            except Exception as exc:  # noqa: BLE001 — a malformed parse is this caption's failure
                failures.append((item.key, f"conversion from {converter.scheme} failed ({type(exc).__name__}: "
                                           f"{exc})"))
                continue
            conversions.update(applied)
            try:
                tree = builder.build(sentence)
            except Exception as exc:  # noqa: BLE001 — a malformed parse is this caption's failure
                failures.append((item.key, f"tree rules failed ({type(exc).__name__}: {exc})"))
                continue
            keys.append(item.key)
            candidates.append(tree.to_json())
        bar.update(len(batch))
    return keys, candidates, failures, conversions


def resolve_scheme(backend: ParserBackend, scheme: str = "auto") -> SchemeChoice:
    """The scheme to read ``backend``'s parses as: ``scheme`` (``auto``: detected; unknown → one-line
    :class:`UserError`). A given scheme is checked against the detection when the backend counted its labels
    (the summary then says what they look like)."""
    source = str(backend.path) if isinstance(backend, ConlluBackend) else backend.describe()
    counted = isinstance(backend, ConlluBackend) and backend.evidence is not None
    return choose_scheme(scheme, backend.detect_scheme() if scheme == "auto" or counted else None, source)


def run_parse_trees(manifest: str | os.PathLike, out: str | os.PathLike, backend: ParserBackend, *,
                    dictionaries: str | os.PathLike | None = None, num_entities: int = DEFAULT_NUM_ENTITIES,
                    num_relations: int = DEFAULT_NUM_RELATIONS, min_count: int = 1,
                    rules: TreeRules | None = None, shard_size: int = DEFAULT_SHARD_SIZE,
                    batch_size: int = DEFAULT_BATCH_SIZE, quiet: bool = True, restart: bool = False,
                    scheme: str = "auto", max_failures: float = DEFAULT_MAX_FAILURES) -> ParseTreesSummary:
    """Parse every caption of ``manifest`` into ``out`` (``trees.h5``), through reusable parse shards.

    ``restart`` deletes earlier shards; ``scheme``: ``auto`` or one of :data:`retr.parsers.schemes.SCHEMES`;
    ``max_failures``: the largest share of failed captions (above it :class:`TooManyFailures`, ``out`` unwritten).
    """
    if shard_size < 1 or batch_size < 1:
        raise UserError("--shard-size and --batch-size must be at least 1")
    if not 0 <= max_failures <= 1:  # also refuses NaN
        raise ParameterError(f"max_failures must be a fraction of the captions from 0 to 1, not {max_failures:g}",
                             "max_failures")
    rules = rules or TreeRules()
    out = Path(out)
    records = read_manifest(manifest)
    items, splits = caption_items(records)
    if not items:
        raise UserError(f"manifest {manifest} has no captions")
    unmatched: list[str] = []
    if isinstance(backend, ConlluBackend):
        backend.check_count(len(items))
        unmatched = backend.unmatched_keys({item.key for item in items})
    choice = resolve_scheme(backend, scheme)
    converter = SchemeConverter(choice.scheme, trusted=choice.trusted)
    reused_dictionaries = load_dictionaries(dictionaries) if dictionaries is not None else None
    identity = {"manifest_sha256": manifest_sha256(manifest), "backend_kind": backend.name,
                "rules": rules.to_json(), "scheme": choice.scheme}
    num_shards = math.ceil(len(items) / shard_size)
    folder = shard_folder(out)
    if restart and folder.is_dir():
        for old in folder.glob("shard-*.h5*"):
            old.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in folder.glob("shard-*.h5") if not p.name.endswith(f"-of-{num_shards:05d}.h5"))
    if stale:
        raise UserError(f"{folder} holds shards of another run ({stale[0]}, not of {num_shards}); delete the "
                        "folder or pass --restart to start over")
    builder = TreeBuilder(rules)
    shards, parsed, reused = [], 0, 0
    done = {}
    for r in range(num_shards):
        shard = read_parse_shard(folder / parse_shard_name(r, num_shards))
        if shard is not None:
            done[r] = shard
    with progress(total=len(items), desc="parse-trees", unit="caption", quiet=quiet,
                  initial=sum(len(items[r * shard_size:(r + 1) * shard_size]) for r in done)) as bar:
        for r in range(num_shards):
            first, stop = r * shard_size, min(len(items), (r + 1) * shard_size)
            expected = dict(identity, shard_index=r, num_shards=num_shards, first_caption=first, stop_caption=stop)
            path = folder / parse_shard_name(r, num_shards)
            shard = done.get(r)
            if shard is not None:
                differs = [k for k in _IDENTITY
                           if str(shard.attrs.get(k, _SHARD_DEFAULTS.get(k))) != str(expected[k])]
                if differs:
                    raise UserError(f"{path} was made by another run (its {differs[0]} differs); delete {folder} "
                                    "to start over (or pass --restart)")
                reused += 1
            else:
                keys, candidates, failures, applied = _parse_shard(backend, converter, builder, items[first:stop],
                                                                   batch_size, bar)
                attrs = dict(expected, backend=backend.describe(), conversions=json.dumps(dict(applied)))
                write_parse_shard(path, keys, candidates, failures, attrs)
                shard = read_parse_shard(path)
                parsed += 1
            shards.append(shard)
    keys = [k for s in shards for k in s.keys]
    trees = [ReferralTree.from_json(c) for s in shards for c in s.candidates]
    failures = [f for s in shards for f in s.failures]
    check_failures(failures, len(items), max_failures, out, folder)
    conversions: Counter = Counter()
    for s in shards:
        conversions.update(json.loads(s.attrs.get("conversions") or "{}"))
    if reused_dictionaries is not None:
        dicts, source = reused_dictionaries, str(dictionaries)
    else:
        split_of = {item.key: split for item, split in zip(items, splits)}
        training = [t for k, t in zip(keys, trees) if split_of[k] in DICTIONARY_SPLITS]
        if not training:
            raise UserError(f"no {'/'.join(DICTIONARY_SPLITS)} captions with trees in {manifest} to build the "
                            "dictionaries from; pass --dictionaries FILE (e.g. another dataset's trees.h5)")
        dicts = build_dictionaries(training, num_entities, num_relations, min_count)
        source = f"built from {len(training)} {'+'.join(DICTIONARY_SPLITS)} captions"
    nodes = np.stack([dicts.encode(t) for t in trees]) if trees else np.zeros((0, 7), np.int32)
    text = [t.bracketed(dicts.display_labels(t, row)) for t, row in zip(trees, nodes)]
    backends = sorted({str(s.attrs.get("backend")) for s in shards})
    write_trees(out, keys, nodes, text, [t.to_json() for t in trees], failures, dicts, {
        "manifest_sha256": identity["manifest_sha256"], "backend": "; ".join(backends), "rules": rules.to_json(),
        "dictionaries_source": source, "num_failures": len(failures), "shard_size": shard_size,
        "conllu_unmatched": len(unmatched), "scheme": choice.scheme, "scheme_how": choice.describe(),
        "max_failures": max_failures,
        "conversions": json.dumps(dict(conversions), sort_keys=True)})
    return ParseTreesSummary(out, len(items), len(keys), failures, parsed, reused, len(dicts.entities),
                             len(dicts.relations), *_known_shares(nodes), unmatched_parses=unmatched,
                             scheme=choice, conversions=dict(conversions), max_failures=max_failures)


def _known_shares(nodes: np.ndarray) -> tuple[float, float]:
    shares = []
    for block in (nodes[:, 0::2], nodes[:, 1::2]):
        filled = block != NULL_ID
        shares.append(float((block[filled] != UNKNOWN_ID).mean()) if filled.any() else 0.0)
    return shares[0], shares[1]
