"""Parsing backends: captions → one :class:`ParseOutcome` per caption (a
:class:`~retr.store.conllu.ConlluSentence` or the reason).

:class:`StanzaBackend` (stanza on raw captions, local model folder; its output converted by
:func:`sentence_from_stanza`) and :class:`ConlluBackend` (parses made elsewhere, read by :mod:`retr.store.conllu`,
no extra needed): docs/referral-trees.md ("Offline use")."""
from __future__ import annotations

import functools
import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from retr.common.devices import resolve_device
from retr.common.downloads import is_offline
from retr.common.errors import MissingResourceError, ParameterError, UserError
from retr.common.optional import require
from retr.parsers.schemes import Detection, LabelEvidence
from retr.store.conllu import (ConlluBlock, ConlluError, ConlluRow, ConlluSentence, index_conllu, parse_conllu,
                               read_block)

STANZA_PROCESSORS = "tokenize,pos,lemma,depparse,constituency"
STANZA_PROCESSORS_NO_CONSTITUENCY = "tokenize,pos,lemma,depparse"
STANZA_LANGUAGE = "en"
#: stanza's plain English package (charlm models); ``default_accurate`` needs transformers and is avoided.
STANZA_PACKAGE = "default"


@dataclass(frozen=True)
class CaptionItem:
    """One caption to parse: its position in the manifest's caption order, key and text."""

    index: int
    key: str
    text: str


@dataclass
class ParseOutcome:
    """A parsed sentence for ``key``, or ``error`` saying why there is none."""

    key: str
    sentence: ConlluSentence | None = None
    error: str | None = None


class ParserBackend(ABC):
    """Turns captions into parsed sentences."""

    #: ``"stanza"`` or ``"conllu"``
    name: str

    @abstractmethod
    def parse(self, items: Sequence[CaptionItem]) -> list[ParseOutcome]:
        """One outcome per item, in the same order."""

    @abstractmethod
    def describe(self) -> str:
        """Provenance recorded in ``trees.h5`` (``backend`` attribute)."""

    def detect_scheme(self) -> Detection | None:
        """The label scheme of the parses, ``None`` when the backend produces UD v2 by construction."""
        return None


@functools.lru_cache(maxsize=1)
def _word_tokenizer():
    # NLTKWordTokenizer is word_tokenize without the punkt sentence splitter: it needs no downloaded data.
    from nltk.tokenize import NLTKWordTokenizer  # cost: nltk takes ~0.5 s, imported on first use

    return NLTKWordTokenizer()


_PUNCT = re.compile(r"^\W+$")


def same_caption(a: str, b: str) -> bool:
    """True if two caption texts agree after :func:`normalize_caption` (whitespace/case-equal texts skip the
    tokenizer: the common case costs a string comparison)."""
    if " ".join(a.lower().split()) == " ".join(b.lower().split()):
        return True
    return normalize_caption(a) == normalize_caption(b)


def normalize_caption(text: str) -> str:
    """Lower-cased tokens without punctuation, single-spaced: how caption and parse texts are compared."""
    tokens = _word_tokenizer().tokenize(" ".join(text.lower().split()))
    return " ".join(t for t in tokens if not _PUNCT.match(t))


# ------------------------------------------------------------------------------------------------------ CoNLL-U

class ConlluBackend(ParserBackend):
    """Sentences from a CoNLL-U file (``# sent_id``, ``# text``, ``# constituency`` read), indexed once by byte
    offsets and read a batch of blocks at a time (:mod:`retr.store.conllu`).

    ``match``: ``auto``, ``key`` or ``order``; ``check_text``: a ``# text`` differing from the caption is a failure;
    ``detect``: count labels while indexing, for :meth:`detect_scheme`."""

    name = "conllu"

    def __init__(self, path: str | os.PathLike, match: str = "auto", check_text: bool = True,
                 detect: bool = True):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"CoNLL-U file {self.path} does not exist")
        if match not in ("auto", "key", "order"):
            raise ParameterError(f"match must be auto, key or order, not {match!r}", "match")
        self.check_text = check_text
        self.evidence = LabelEvidence() if detect else None
        self.blocks = self._index()
        if not self.blocks:
            raise UserError(f"{self.path} holds no CoNLL-U sentences")
        with_ids = sum(1 for b in self.blocks if b.sent_id is not None)
        if match == "auto":
            if with_ids == len(self.blocks):
                match = "key"
            elif with_ids == 0:
                match = "order"
            else:
                raise UserError(f"{self.path}: {with_ids} of {len(self.blocks)} sentences have '# sent_id'; "
                                "give every sentence one (<image id>#<caption index>) or none (manifest order)")
        if match == "key" and with_ids < len(self.blocks):
            raise UserError(f"{self.path}: {len(self.blocks) - with_ids} sentences have no '# sent_id' "
                            "(needed to match by key)")
        self.match = match
        self.by_key: dict[str, int] = {}
        if match == "key":
            for i, block in enumerate(self.blocks):
                if block.sent_id in self.by_key:
                    raise UserError(f"{self.path}: sent_id {block.sent_id!r} occurs twice")
                self.by_key[block.sent_id] = i

    def _index(self) -> list[ConlluBlock]:
        evidence = self.evidence
        return index_conllu(self.path, evidence.add if evidence is not None else None)

    def detect_scheme(self) -> Detection | None:
        """The label scheme of the whole file (counted while indexing; :func:`retr.parsers.schemes.detect_scheme`)."""
        if self.evidence is None:
            self.evidence = LabelEvidence()
            self._index()
        return self.evidence.detect()

    def describe(self) -> str:
        return f"conllu:{self.path.name} (matched by {self.match})"

    def check_count(self, num_captions: int) -> None:
        """Order matching needs exactly one sentence per caption; say so otherwise."""
        if self.match == "order" and len(self.blocks) != num_captions:
            raise UserError(f"{self.path} has {len(self.blocks)} sentences and no sent_id; matching by order "
                            f"needs one per caption, the manifest has {num_captions}")

    def unmatched_keys(self, keys: set[str]) -> list[str]:
        """sent_ids in the file that are not caption keys of the manifest (reported, not parsed)."""
        if self.match != "key":
            return []
        return [k for k in self.by_key if k not in keys]

    def _block_for(self, item: CaptionItem) -> tuple[ConlluBlock | None, str | None]:
        if self.match == "key":
            i = self.by_key.get(item.key)
            if i is None:
                return None, f"no sentence with sent_id {item.key} in {self.path.name}"
            return self.blocks[i], None
        if item.index >= len(self.blocks):
            return None, f"{self.path.name} has only {len(self.blocks)} sentences (caption {item.index})"
        return self.blocks[item.index], None

    def parse(self, items: Sequence[CaptionItem]) -> list[ParseOutcome]:
        outcomes = [ParseOutcome(item.key) for item in items]
        todo: list[tuple[int, str]] = []
        with open(self.path, "rb") as handle:
            for i, item in enumerate(items):
                block, error = self._block_for(item)
                if block is None:
                    outcomes[i].error = error
                    continue
                if self.check_text and block.text is not None and not same_caption(block.text, item.text):
                    outcomes[i].error = (f"CoNLL-U sentence {block.sent_id or item.index} reads "
                                         f"{block.text!r}, the caption is {item.text!r}")
                    continue
                todo.append((i, read_block(handle, block)))
        if not todo:
            return outcomes
        try:
            sentences = parse_conllu("".join(text for _, text in todo))
            if len(sentences) != len(todo):
                raise ValueError(f"read {len(sentences)} sentences from {len(todo)} blocks")
        except Exception:  # isolate the broken block(s): read one at a time
            sentences = []
            for i, text in todo:
                try:
                    found = parse_conllu(text)
                    sentences.append(found[0] if len(found) == 1 else ValueError(f"{len(found)} sentences"))
                except Exception as exc:  # noqa: BLE001 — recorded as this caption's failure
                    sentences.append(exc)
        for (i, _), sentence in zip(todo, sentences):
            if isinstance(sentence, Exception):
                outcomes[i].error = f"unreadable CoNLL-U ({type(sentence).__name__}: {sentence})"
            else:
                if self.check_text and sentence.text is None and items[i].text:
                    words = " ".join(w.text for w in sentence.words)
                    if not same_caption(words, items[i].text):
                        outcomes[i].error = (f"CoNLL-U sentence {items[i].key} has words {words!r}, "
                                             f"the caption is {items[i].text!r}")
                        continue
                outcomes[i].sentence = sentence
        return outcomes

    def _sentence(self, handle, block: ConlluBlock) -> ConlluSentence:
        """The one sentence of ``block``; a block that is not CoNLL-U is one :class:`UserError` naming it."""
        try:
            found = parse_conllu(read_block(handle, block))
        except ConlluError as exc:
            text = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise UserError(f"{self.path}: the sentence at byte {block.offset} is not readable CoNLL-U "
                            f"({type(exc).__name__}: {text[:120]})") from None
        if len(found) != 1:
            raise UserError(f"{self.path}: the block at byte {block.offset} holds {len(found)} CoNLL-U sentences, "
                            f"not one")
        return found[0]

    def find_text(self, text: str) -> ConlluSentence | None:
        """The first sentence whose text matches ``text`` (after :func:`normalize_caption`), or ``None``."""
        wanted = normalize_caption(text)
        with open(self.path, "rb") as handle:
            for block in self.blocks:
                if block.text is not None:
                    if normalize_caption(block.text) == wanted:
                        return self._sentence(handle, block)
                    continue
                sentence = self._sentence(handle, block)
                if normalize_caption(" ".join(w.text for w in sentence.words)) == wanted:
                    return sentence
        return None

    def find_key(self, key: str) -> ConlluSentence | None:
        i = self.by_key.get(key)
        if i is None:
            return None
        with open(self.path, "rb") as handle:
            return self._sentence(handle, self.blocks[i])


# ------------------------------------------------------------------------------------------------------- stanza

def _column(value: Any) -> str:
    return str(value) if value not in (None, "") else "_"


def sentence_from_stanza(sentence: Any) -> ConlluSentence:
    """A stanza ``Sentence`` (what ``stanza.Pipeline`` returns) as retr's :class:`ConlluSentence`: the columns
    stanza leaves unset (``None``) are ``"_"`` as in CoNLL-U, a missing head −1, the constituency tree its
    bracketed text — the sentence the same parse written to CoNLL-U and read back gives."""
    words = tuple(ConlluRow(int(w.id), w.text if w.text is not None else "_", _column(w.lemma), _column(w.upos),
                            _column(w.xpos), _column(w.feats), int(w.head) if w.head is not None else -1,
                            _column(w.deprel))
                  for w in sentence.words)
    constituency = getattr(sentence, "constituency", None)
    return ConlluSentence(words, getattr(sentence, "sent_id", None), getattr(sentence, "text", None),
                          str(constituency) if constituency is not None else None)


def stanza_model_dir(model_dir: str | os.PathLike | None = None) -> tuple[Path, str]:
    """The model folder to use and where the choice came from (``--stanza-dir``, the env, stanza's default)."""
    if model_dir is not None:
        return Path(model_dir), "--stanza-dir"
    env = os.environ.get("STANZA_RESOURCES_DIR")
    if env:
        return Path(env), "STANZA_RESOURCES_DIR"
    DEFAULT_MODEL_DIR = require("stanza.resources.common", "pipeline", "the caption parser").DEFAULT_MODEL_DIR

    return Path(DEFAULT_MODEL_DIR), "stanza's default folder"


def _how_to_fetch(folder: Path) -> str:
    return (f"on a machine with internet access run `retr-pipeline fetch-parser-models {folder}` (it calls "
            f"stanza.download('en', model_dir=…, processors='{STANZA_PROCESSORS}')), copy the folder here and "
            f"pass --stanza-dir {folder} (or set STANZA_RESOURCES_DIR), or give parses with --conllu FILE")


def missing_models_error(folder: Path, source: str) -> MissingResourceError:
    return MissingResourceError("stanza English models (tokenize, pos, lemma, depparse, constituency)",
                                f"{folder} ({source})", _how_to_fetch(folder))


class StanzaBackend(ParserBackend):
    """A stanza English pipeline from a local folder (None → ``$STANZA_RESOURCES_DIR`` → stanza's default).

    ``device``: as :func:`retr.common.devices.resolve_device`; ``constituency=False`` saves time; ``pipeline``: a
    ready ``text → stanza.Document`` callable."""

    name = "stanza"

    def __init__(self, model_dir: str | os.PathLike | None = None, device: str = "auto",
                 constituency: bool = True, pipeline: Callable[[str], Any] | None = None):
        self.processors = STANZA_PROCESSORS if constituency else STANZA_PROCESSORS_NO_CONSTITUENCY
        self.device = resolve_device(device)
        self.folder, source = stanza_model_dir(model_dir)
        if pipeline is None:
            pipeline = self._load(source)
        self.pipeline = pipeline

    def _load(self, source: str) -> Callable[[str], Any]:
        folder = self.folder
        if not (folder / "resources.json").is_file() or not (folder / STANZA_LANGUAGE).is_dir():
            if is_offline():
                raise missing_models_error(folder, source)
            # first use on a connected machine: stanza's own download into the folder, then load as usual
            fetch_parser_models(folder, constituency=self.processors == STANZA_PROCESSORS)
        stanza = require("stanza", "pipeline", "the caption parser")

        try:
            return stanza.Pipeline(STANZA_LANGUAGE, dir=str(folder), processors=self.processors,
                                   download_method=None, tokenize_no_ssplit=True,
                                   use_gpu=self.device.type == "cuda", device=str(self.device),
                                   logging_level="WARN")
        except (FileNotFoundError, KeyError, ValueError) as exc:
            raise MissingResourceError(
                f"a stanza model file ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})",
                f"{folder} ({source})", _how_to_fetch(folder)) from None
        except Exception as exc:  # stanza's own ResourcesFileNotFoundError, UnsupportedProcessorError, …
            if "resource" in type(exc).__name__.lower() or "download" in str(exc).lower():
                raise missing_models_error(folder, source) from None
            raise UserError(f"could not load stanza from {folder}: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200]}") from None

    def describe(self) -> str:
        return f"stanza {self.processors} from {self.folder}"

    def _run(self, texts: Sequence[str]) -> list[ConlluSentence]:
        return [sentence_from_stanza(s) for s in self.pipeline("\n\n".join(texts)).sentences]

    def parse(self, items: Sequence[CaptionItem]) -> list[ParseOutcome]:
        outcomes = [ParseOutcome(item.key) for item in items]
        texts = [" ".join(item.text.split()) for item in items]
        try:
            sentences = self._run(texts)
        except Exception:  # noqa: BLE001 — retried one caption at a time below
            sentences = None
        if sentences is not None and len(sentences) == len(items):
            for outcome, sentence in zip(outcomes, sentences):
                outcome.sentence = sentence
            return outcomes
        for outcome, text in zip(outcomes, texts):
            if not text:
                outcome.error = "empty caption"
                continue
            try:
                found = self._run([text])
            except Exception as exc:  # noqa: BLE001 — recorded as this caption's failure
                outcome.error = f"stanza failed ({type(exc).__name__}: {str(exc)[:200]})"
                continue
            if len(found) != 1:
                outcome.error = f"stanza read {len(found)} sentences in this caption"
            else:
                outcome.sentence = found[0]
        return outcomes


def fetch_parser_models(model_dir: str | os.PathLike, constituency: bool = True) -> Path:
    """Download stanza's English models into ``model_dir`` (needs internet; for connected machines)."""
    stanza = require("stanza", "pipeline", "the caption parser")

    folder = Path(model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    processors = STANZA_PROCESSORS if constituency else STANZA_PROCESSORS_NO_CONSTITUENCY
    try:
        stanza.download(STANZA_LANGUAGE, model_dir=str(folder), package=STANZA_PACKAGE, processors=processors)
    except Exception as exc:  # noqa: BLE001 — network and server errors come in many types
        raise UserError(f"could not download stanza models into {folder} ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160] if str(exc) else 'no detail'}); run this command on a "
                        "machine with internet access and copy the folder here") from None
    return folder
