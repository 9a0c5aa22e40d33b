"""Dependency label schemes (``ud2``, ``ud1``, ``sd``, ``clearnlp``): detection, and conversion to UD v2.

:func:`detect_scheme` → :class:`Detection`; :func:`to_ud2` converts one sentence (or raises
:class:`ConversionError`). Which parser emits which scheme, detection and the mapping: docs/referral-trees.md
("Parses made elsewhere: label schemes")."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from retr.common.errors import UserError
from retr.store.conllu import ConlluRow, ConlluSentence

SCHEMES = ("ud2", "ud1", "sd", "clearnlp")
#: what ``--scheme`` accepts
SCHEME_CHOICES = ("auto",) + SCHEMES
UNKNOWN = "unknown"
SCHEME_TITLES = {"ud2": "UD v2", "ud1": "UD v1", "sd": "Stanford basic dependencies",
                 "clearnlp": "ClearNLP (spaCy English)", UNKNOWN: "unknown"}

#: The 37 universal relations of UD v2 (any subtype of them is accepted: ``obl:tmod``, ``nmod:poss``, …).
UD2_RELATIONS = frozenset({
    "acl", "advcl", "advmod", "amod", "appos", "aux", "case", "cc", "ccomp", "clf", "compound", "conj", "cop",
    "csubj", "dep", "det", "discourse", "dislocated", "expl", "fixed", "flat", "goeswith", "iobj", "list",
    "mark", "nmod", "nsubj", "nummod", "obj", "obl", "orphan", "parataxis", "punct", "reparandum", "root",
    "vocative", "xcomp"})
#: The 40 universal relations of UD v1.
UD1_RELATIONS = frozenset({
    "acl", "advcl", "advmod", "amod", "appos", "aux", "auxpass", "case", "cc", "ccomp", "compound", "conj",
    "cop", "csubj", "csubjpass", "dep", "det", "discourse", "dislocated", "dobj", "expl", "foreign", "goeswith",
    "iobj", "list", "mark", "mwe", "name", "neg", "nmod", "nsubj", "nsubjpass", "nummod", "parataxis", "punct",
    "remnant", "reparandum", "root", "vocative", "xcomp"})
#: Subtypes that came with v2 although their base relation is also a v1 relation.
UD2_ONLY_SUBTYPES = frozenset({"nsubj:pass", "csubj:pass", "aux:pass"})
#: Stanford basic dependencies (the manual's hierarchy, v1.x–3.x; the generic ``arg``, ``comp``, ``mod``,
#: ``subj``, ``obj``, ``sdep`` and the collapsed-only ``agent``, ``ref``, ``xsubj``, ``prep_*`` are not
#: basic labels that a converted tree holds, and make a file ``unknown``).
SD_RELATIONS = frozenset({
    "root", "dep", "aux", "auxpass", "cop", "acomp", "ccomp", "xcomp", "dobj", "iobj", "pobj", "nsubj",
    "nsubjpass", "csubj", "csubjpass", "cc", "conj", "expl", "amod", "appos", "advcl", "det", "predet",
    "preconj", "vmod", "partmod", "infmod", "purpcl", "mwe", "mark", "complm", "advmod", "neg", "rcmod",
    "rel", "quantmod", "nn", "npadvmod", "tmod", "num", "number", "prep", "pcomp", "poss", "possessive",
    "prt", "parataxis", "goeswith", "punct", "discourse", "abbrev"})
#: ClearNLP's labels (Choi & Palmer 2012) and spaCy's English label set, which grew out of them: SD's plus
#: these. ``attr``/``acomp`` under "be" mean the copula heads its clause.
CLEARNLP_ONLY = frozenset({"attr", "dative", "oprd", "agent", "intj", "meta", "hmod", "hyph", "nfmod",
                           "relcl", "acl", "case", "compound", "nummod", "nmod"})
CLEARNLP_RELATIONS = SD_RELATIONS | CLEARNLP_ONLY

#: Renames that do not depend on the context (UD v1 and the Stanford family).
UD1_RENAMES: Mapping[str, str] = {
    "dobj": "obj", "nsubjpass": "nsubj:pass", "csubjpass": "csubj:pass", "auxpass": "aux:pass",
    "mwe": "fixed", "name": "flat", "foreign": "flat:foreign"}
STANFORD_RENAMES: Mapping[str, str] = {
    **UD1_RENAMES,
    "nn": "compound", "num": "nummod", "number": "compound", "poss": "nmod:poss", "possessive": "case",
    "prt": "compound:prt", "rcmod": "acl:relcl", "relcl": "acl:relcl", "predet": "det:predet",
    "preconj": "cc:preconj", "quantmod": "advmod", "complm": "mark", "purpcl": "advcl", "abbrev": "appos",
    "intj": "discourse", "hyph": "punct", "hmod": "compound", "meta": "dep", "rel": "dep"}
#: Renames that depend on the head: ``(under a predicate, under anything else)``.
STANFORD_BY_HEAD: Mapping[str, tuple[str, str]] = {
    "partmod": ("advcl", "acl"), "infmod": ("advcl", "acl"), "vmod": ("advcl", "acl"), "nfmod": ("advcl", "acl"),
    "tmod": ("obl:tmod", "nmod:tmod"), "npadvmod": ("obl:npmod", "nmod:npmod")}
#: Predicate complements that UD writes as ``xcomp`` when the verb is not a copula.
STANFORD_XCOMP = frozenset({"acomp", "attr", "oprd"})

#: Two-word prepositions that UD English writes as ``case`` + ``fixed`` (first word heads).
TWO_WORD_PREPOSITIONS = frozenset({
    ("next", "to"), ("because", "of"), ("instead", "of"), ("due", "to"), ("prior", "to"), ("according", "to"),
    ("ahead", "of"), ("out", "of"), ("apart", "from"), ("rather", "than"), ("such", "as"), ("thanks", "to"),
    ("along", "with"), ("as", "of"), ("as", "for"), ("as", "to")})
_TWO_WORD_FIRST = frozenset(first for first, _ in TWO_WORD_PREPOSITIONS)

#: UPOS of a Penn Treebank tag (AUX for verbs attached as ``aux``/``auxpass``/``cop``, PART/ADP for "to"
#: are decided from the label).
PTB_TO_UPOS: Mapping[str, str] = {
    "NN": "NOUN", "NNS": "NOUN", "NNP": "PROPN", "NNPS": "PROPN", "VB": "VERB", "VBD": "VERB", "VBG": "VERB",
    "VBN": "VERB", "VBP": "VERB", "VBZ": "VERB", "MD": "AUX", "JJ": "ADJ", "JJR": "ADJ", "JJS": "ADJ",
    "AFX": "ADJ", "RB": "ADV", "RBR": "ADV", "RBS": "ADV", "WRB": "ADV", "IN": "ADP", "RP": "ADP", "TO": "PART",
    "DT": "DET", "PDT": "DET", "WDT": "PRON", "PRP": "PRON", "PRP$": "PRON", "WP": "PRON", "WP$": "PRON",
    "EX": "PRON", "CD": "NUM", "CC": "CCONJ", "POS": "PART", "UH": "INTJ", "SYM": "SYM", "$": "SYM",
    "#": "SYM", "FW": "X", "LS": "X", "GW": "X", "XX": "X", "ADD": "X", ".": "PUNCT", ",": "PUNCT",
    ":": "PUNCT", "``": "PUNCT", "''": "PUNCT", "-LRB-": "PUNCT", "-RRB-": "PUNCT", "HYPH": "PUNCT",
    "NFP": "PUNCT"}
UD_UPOS = frozenset({"ADJ", "ADP", "ADV", "AUX", "CCONJ", "DET", "INTJ", "NOUN", "NUM", "PART", "PRON", "PROPN",
                     "PUNCT", "SCONJ", "SYM", "VERB", "X"})
#: Heads under which a nominal is ``obl`` (not ``nmod``) in UD v2.
PREDICATE_UPOS = frozenset({"VERB", "AUX", "ADJ", "ADV"})
_BE_FORMS = frozenset({"be", "is", "are", "was", "were", "been", "being", "am", "'s", "'re", "'m"})
_PREPOSITION_ROLES = frozenset({"prep", "agent", "dative"})

# structural evidence names (Detection.structure)
NMOD_ON_PREDICATE = "nmod on a predicate"
CC_ON_FIRST = "cc on the first conjunct"
CC_ON_NEXT = "cc on the following conjunct"
#: share of word tokens whose labels the chosen scheme lacks that detection tolerates (those sentences then
#: fail one by one, with the label named); above it the file is ``unknown``.
STRAY_TOLERANCE = 0.001


class ConversionError(ValueError):
    """One sentence cannot be converted to UD v2; the message is the reason recorded for its caption."""


def accepts(scheme: str, label: str) -> bool:
    """True if ``label`` (lower case, maybe with a subtype) belongs to ``scheme``'s inventory."""
    if scheme == "ud2":
        return label.split(":", 1)[0] in UD2_RELATIONS
    if scheme == "ud1":
        return label.split(":", 1)[0] in UD1_RELATIONS and label not in UD2_ONLY_SUBTYPES
    if scheme == "sd":
        return label in SD_RELATIONS
    if scheme == "clearnlp":
        return label in CLEARNLP_RELATIONS
    raise ValueError(f"unknown scheme {scheme!r}")


# ---------------------------------------------------------------------------------------------------- Detection

class LabelEvidence:
    """Label counts and structural cues gathered sentence by sentence (cheap enough to run over a whole file
    while indexing it: :class:`retr.parsers.backends.ConlluBackend` does)."""

    def __init__(self) -> None:
        self._raw: Counter = Counter()  # labels as written (lower-cased when read: spaCy writes ROOT)
        self._upos: Counter = Counter()
        self.structure: Counter = Counter()
        self.sentences = 0
        self.words = 0

    @property
    def labels(self) -> Counter:
        """Every label, lower case, with its number of words."""
        merged: Counter = Counter()
        for label, count in self._raw.items():
            merged[label.lower()] += count
        return merged

    @property
    def odd_upos(self) -> int:
        """Words whose UPOS is not one of UD's 17 tags (missing, or a Penn Treebank tag)."""
        return sum(count for tag, count in self._upos.items() if tag not in UD_UPOS)

    def add(self, rows: Sequence[tuple[str, str, str, str]]) -> None:
        """One sentence as ``(id, upos, head, deprel)`` strings, CoNLL-U columns 1, 4, 7 and 8."""
        self.sentences += 1
        self.words += len(rows)
        deprels = [r[3] for r in rows]
        self._raw.update(deprels)
        self._upos.update([r[1] for r in rows])
        for label in set(deprels):
            low = label[:4].lower()
            if low == "nmod" or (low == "cc" and len(label) == 2):
                self._structure(rows)
                break

    def _structure(self, rows: Sequence[tuple[str, str, str, str]]) -> None:
        upos = {r[0]: r[1] for r in rows}
        label_of = {r[0]: r[3].lower() for r in rows}
        conjuncts: dict[str, list[int]] = {}
        for r in rows:
            if label_of[r[0]].split(":", 1)[0] == "conj":
                conjuncts.setdefault(r[2], []).append(_int(r[0]))
        for wid, _, head, deprel in rows:
            label = label_of[wid]
            if label.startswith("nmod") and label != "nmod:poss" and label.split(":", 1)[0] == "nmod":
                if upos.get(head) in PREDICATE_UPOS:
                    self.structure[NMOD_ON_PREDICATE] += 1
            elif label == "cc":
                me, boss = _int(wid), _int(head)
                if label_of.get(head, "").split(":", 1)[0] == "conj" and me < boss:
                    self.structure[CC_ON_NEXT] += 1
                elif me > boss and any(k > me for k in conjuncts.get(head, ())):
                    self.structure[CC_ON_FIRST] += 1

    def detect(self) -> "Detection":
        return _decide(self.labels, Counter(self.structure), self.sentences, self.words, self.odd_upos)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return -1


@dataclass(frozen=True)
class Detection:
    """What :func:`detect_scheme` found: ``scheme`` (or ``unknown``), ``labels`` and ``structure`` counts,
    ``unexpected`` labels per scheme, ``evidence`` against the nearest rival, ``sentences``, ``words``, ``odd_upos``.
    """

    scheme: str
    labels: Counter
    structure: Counter
    unexpected: dict[str, dict[str, int]]
    evidence: tuple[tuple[str, int], ...]
    sentences: int
    words: int
    odd_upos: int = 0

    @property
    def title(self) -> str:
        return SCHEME_TITLES[self.scheme]

    @property
    def stray(self) -> dict[str, int]:
        """Labels the chosen scheme lacks (tolerated below :data:`STRAY_TOLERANCE`; their sentences fail)."""
        return self.unexpected.get(self.scheme, {}) if self.scheme != UNKNOWN else {}

    def closest(self) -> str:
        """The scheme with the fewest words whose labels it lacks."""
        return min(SCHEMES, key=lambda s: (sum(self.unexpected[s].values()), SCHEMES.index(s)))

    def summary(self) -> str:
        """``UD v1 (dobj 40, nmod on a predicate 57; 93 sentences)``."""
        parts = ", ".join(f"{name} {count}" for name, count in self.evidence[:6])
        stray = self.stray
        extra = (f"; {sum(stray.values())} words with labels outside it: {_listing(stray)}") if stray else ""
        return f"{self.title} ({parts + '; ' if parts else ''}{self.sentences} sentences{extra})"

    def refusal(self, source: str) -> str:
        """The one-line error for an ``unknown`` scheme."""
        closest = self.closest()
        hint = ""
        if any(label.startswith(("prep_", "prepc_", "conj_")) for label in self.labels):
            hint = " (collapsed Stanford dependencies? give the basic ones)"
        return (f"{source}: the dependency labels are none of UD v2, UD v1, Stanford basic dependencies or "
                f"ClearNLP — unexpected for the closest, {SCHEME_TITLES[closest]}: "
                f"{_listing(self.unexpected[closest])}{hint}; pass --scheme {'|'.join(SCHEMES)} to read it as "
                "one of them anyway (sentences with other labels then fail one by one)")


def _listing(counts: Mapping[str, int], limit: int = 8) -> str:
    items = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{label} ({count})" for label, count in items[:limit])
    return text + (f", … {len(items) - limit} more" if len(items) > limit else "")


def _decide(labels: Counter, structure: Counter, sentences: int, words: int, odd_upos: int = 0) -> Detection:
    unexpected = {s: {label: n for label, n in labels.items() if not accepts(s, label)} for s in SCHEMES}
    consistent = [s for s in SCHEMES if not unexpected[s]]
    v1_cues = structure[NMOD_ON_PREDICATE] + structure[CC_ON_FIRST]
    if "ud2" in consistent and "ud1" in consistent:
        scheme = "ud1" if v1_cues > structure[CC_ON_NEXT] else "ud2"
    elif consistent:
        scheme = consistent[0]  # SCHEMES order: ud2, ud1, sd, clearnlp (sd ⊂ clearnlp)
    else:
        best = min(SCHEMES, key=lambda s: (sum(unexpected[s].values()), SCHEMES.index(s)))
        scheme = best if sum(unexpected[best].values()) <= STRAY_TOLERANCE * max(words, 1) else UNKNOWN
    evidence: list[tuple[str, int]] = []
    if scheme != UNKNOWN:
        taken: set[str] = set()
        for rival in _RIVALS[scheme]:  # what sets it apart from its nearest rival first
            group = [(label, n) for label, n in labels.items()
                     if label not in taken and accepts(scheme, label) and not accepts(rival, label)]
            if rival in ("ud1", "ud2") and scheme in ("ud1", "ud2"):
                cues = (NMOD_ON_PREDICATE, CC_ON_FIRST) if scheme == "ud1" else (CC_ON_NEXT,)
                group += [(cue, structure[cue]) for cue in cues if structure[cue]]
            evidence += sorted(group, key=lambda kv: (-kv[1], kv[0]))
            taken.update(label for label, _ in group)
    return Detection(scheme, labels, structure, unexpected, tuple(evidence), sentences, words, odd_upos)


#: the schemes each one is told apart from, nearest first (for :attr:`Detection.evidence`)
_RIVALS = {"ud2": ("ud1",), "ud1": ("ud2",), "sd": ("ud2",), "clearnlp": ("sd", "ud2")}


def detect_scheme(sentences: Iterable[ConlluSentence]) -> Detection:
    """The label scheme of parsed sentences (an empty ``DEPREL`` counts as ``dep``)."""
    evidence = LabelEvidence()
    for sentence in sentences:
        evidence.add([(str(w.id), w.upos, str(w.head), _deprel(w.deprel)) for w in sentence.words])
    return evidence.detect()


def _deprel(label: str) -> str:
    """A word's relation as written, ``dep`` where the column is empty (``_``)."""
    return label if label not in ("", "_") else "dep"


@dataclass(frozen=True)
class SchemeChoice:
    """The scheme a run reads, how it was chosen, and the detection behind it (``None`` for stanza)."""

    scheme: str
    how: str  # "detected", "given" or "stanza"
    detection: Detection | None = None

    @property
    def trusted(self) -> bool:
        """True when every label of the input is known to be in the scheme and every UPOS a UD tag (stanza, or
        a whole-file detection of this scheme without stray labels): per-sentence checks can be skipped."""
        if self.how == "stanza":
            return True
        found = self.detection
        return found is not None and found.scheme == self.scheme and not found.stray and not found.odd_upos

    def describe(self) -> str:
        """``ud1: UD v1, detected (dobj 40, …; 93 sentences)`` and, when given, what detection said."""
        title = SCHEME_TITLES[self.scheme]
        if self.how == "stanza":
            return f"{self.scheme}: {title}, as stanza's English models produce it"
        if self.how == "detected":
            return f"{self.scheme}: detected, {self.detection.summary()}"
        note, found = "", self.detection
        if found is not None and found.scheme == UNKNOWN:
            note = (f"; detection found none of the four (unexpected for {SCHEME_TITLES[self.scheme]}: "
                    f"{_listing(found.unexpected[self.scheme], 4) or 'nothing'})")
        elif found is not None and found.scheme != self.scheme:
            note = f"; the labels look like {found.scheme}, {found.summary()}"
        return f"{self.scheme}: {title}, given by --scheme{note}"


def choose_scheme(requested: str, detection: Detection | None, source: str) -> SchemeChoice:
    """``--scheme`` → the scheme to read. ``auto`` takes the detection and refuses ``unknown`` in one line
    (:class:`UserError`); ``detection`` ``None`` means stanza (UD v2 by construction)."""
    if requested not in SCHEME_CHOICES:
        raise UserError(f"--scheme must be one of {', '.join(SCHEME_CHOICES)}, not {requested!r}")
    if requested != "auto":
        return SchemeChoice(requested, "given", detection)
    if detection is None:
        return SchemeChoice("ud2", "stanza")
    if detection.scheme == UNKNOWN:
        raise UserError(detection.refusal(source))
    return SchemeChoice(detection.scheme, "detected", detection)


# --------------------------------------------------------------------------------------------------- Conversion

class _Word:
    """A mutable copy of one :class:`ConlluRow` while its sentence is converted (``deprel`` lower-cased,
    ``dep`` where empty)."""

    __slots__ = ("id", "form", "lemma", "upos", "xpos", "feats", "head", "deprel")

    def __init__(self, w: ConlluRow):
        self.id = w.id
        self.form = w.form or "_"
        self.lemma = w.lemma or "_"
        self.upos = w.upos or "_"
        self.xpos = w.xpos or "_"
        self.feats = w.feats or "_"
        self.head = w.head
        self.deprel = _deprel(w.deprel).lower()

    @property
    def low(self) -> str:
        """Lower-cased lemma, the form when the parse has no lemma."""
        return (self.lemma if self.lemma != "_" else self.form).lower()

    def row(self) -> ConlluRow:
        return ConlluRow(self.id, self.form, self.lemma, self.upos, self.xpos, self.feats, self.head, self.deprel)


def _children(words: Sequence[_Word]) -> dict[int, list[_Word]]:
    kids: dict[int, list[_Word]] = {}
    for w in words:
        kids.setdefault(w.head, []).append(w)
    return kids


def _is_predicate(word: _Word | None) -> bool:
    return word is not None and word.upos in PREDICATE_UPOS


def _is_be(word: _Word) -> bool:
    return word.low == "be" or word.form.lower() in _BE_FORMS


def _fill_upos(words: Sequence[_Word], counts: Counter) -> None:
    """UPOS from a Penn Treebank XPOS (or a PTB tag in the UPOS column) where the UPOS column has none."""
    for w in words:
        if w.upos in UD_UPOS:
            continue
        tag = w.xpos if w.xpos != "_" else w.upos
        upos = PTB_TO_UPOS.get(tag)
        if upos is None:
            raise ConversionError(f"word {w.id} {w.form!r} has no UPOS and its tag {tag!r} is not a Penn "
                                  "Treebank tag")
        if upos == "VERB" and w.deprel in ("aux", "auxpass", "aux:pass", "cop"):
            upos = "AUX"
        elif tag == "TO" and w.deprel in ("prep", "case", "dative", "mwe", "fixed"):
            upos = "ADP"
        if w.xpos == "_":
            w.xpos = tag
        w.upos = upos
        counts["PTB tag→UPOS"] += 1


def _check(words: Sequence[_Word], scheme: str) -> None:
    for w in words:
        if not accepts(scheme, w.deprel):
            raise ConversionError(f"label {w.deprel!r} (word {w.id} {w.form!r}) is not in "
                                  f"{SCHEME_TITLES[scheme]}")


def _rename(w: _Word, new: str, counts: Counter) -> None:
    if new != w.deprel:
        counts[f"{w.deprel}→{new}"] += 1
        w.deprel = new


def _coordination(words: Sequence[_Word], counts: Counter) -> None:
    """``cc`` and commas between conjuncts move from the first conjunct to the conjunct that follows them."""
    if not any(w.deprel.startswith("conj") for w in words):
        return
    kids = _children(words)
    for head_id, children in kids.items():
        conjuncts = [c for c in children if c.deprel.split(":", 1)[0] == "conj"]
        if not conjuncts:
            continue
        for c in children:
            if c.id < head_id or not (c.deprel == "cc" or c.deprel == "punct"):
                continue
            following = next((k for k in conjuncts if k.id > c.id), None)
            if following is not None:
                c.head = following.id
                counts[f"{c.deprel}→following conjunct"] += 1


def _from_ud1(words: list[_Word], counts: Counter) -> None:
    by_id = {w.id: w for w in words}
    for w in words:
        base, _, sub = w.deprel.partition(":")
        if base == "remnant":
            raise ConversionError(f"'remnant' (word {w.id} {w.form!r}, UD v1 ellipsis) has no one-to-one UD v2 "
                                  "relation (v2 promotes a dependent and writes 'orphan')")
        if base == "nmod" and sub != "poss" and _is_predicate(by_id.get(w.head)):
            _rename(w, "obl" + (f":{sub}" if sub else ""), counts)
        elif base == "neg":
            _rename(w, "det" if w.upos == "DET" else "advmod", counts)
        elif w.deprel in UD1_RENAMES:
            _rename(w, UD1_RENAMES[w.deprel], counts)
        elif base in UD1_RENAMES and sub:
            _rename(w, f"{UD1_RENAMES[base]}:{sub}" if ":" not in UD1_RENAMES[base] else UD1_RENAMES[base], counts)
    _coordination(words, counts)


def _from_stanford(words: list[_Word], counts: Counter) -> None:
    by_id = {w.id: w for w in words}
    labels = {w.deprel for w in words}  # each rewrite runs only where its labels occur
    if "mwe" in labels:
        _head_initial_mwe(words, counts)
    two_word = _two_word_prepositions(words, counts) if any(w.low in _TWO_WORD_FIRST for w in words) else set()
    if "pcomp" in labels or "prep" in labels:
        _preposition_complements(words, by_id, counts)
    if "pobj" in labels or "prep" in labels or "agent" in labels:
        _prepositions(words, by_id, counts, two_word)
    if any(w.upos in ("VERB", "AUX") and _is_be(w) for w in words):
        _copula(words, counts)
    for w in words:
        label = w.deprel
        if label in STANFORD_RENAMES:
            _rename(w, STANFORD_RENAMES[label], counts)
        elif label in STANFORD_BY_HEAD:
            on_predicate, otherwise = STANFORD_BY_HEAD[label]
            _rename(w, on_predicate if _is_predicate(by_id.get(w.head)) else otherwise, counts)
        elif label in STANFORD_XCOMP:
            _rename(w, "xcomp", counts)
        elif label == "dative":
            _rename(w, "iobj", counts)
        elif label == "neg":
            _rename(w, "det" if w.upos == "DET" else "advmod", counts)
        elif label == "aux" and w.low == "to" and w.upos in ("PART", "ADP"):
            _rename(w, "mark", counts)
    _coordination(words, counts)


def _head_initial_mwe(words: list[_Word], counts: Counter) -> None:
    """SD's ``mwe`` hangs the first words on the last ("because of": mwe(of, because)); UD's ``fixed`` hangs
    the rest on the first."""
    kids = _children(words)
    for h in list(words):
        parts = [c for c in kids.get(h.id, []) if c.deprel == "mwe"]
        if not parts:
            continue
        group = sorted([h, *parts], key=lambda w: w.id)
        first = group[0]
        if first is not h:
            first.head, first.deprel = h.head, h.deprel
            for c in kids.get(h.id, []):
                if c not in group:
                    c.head = first.id
        for part in group[1:]:
            part.head, part.deprel = first.id, "fixed"
        counts["mwe→fixed"] += len(parts)
        kids = _children(words)


def _two_word_prepositions(words: list[_Word], counts: Counter) -> set[int]:
    """``next to a dog`` as advmod(X, next) prep(next, to) pobj(to, dog) (or amod/prep + pcomp): ``next`` becomes
    the preposition, ``to`` its ``fixed`` part, ``dog`` its object. Returns the ids of the first words."""
    found: set[int] = set()
    kids = _children(words)
    for w in words:
        for p in kids.get(w.id, []):
            if p.deprel not in ("prep", "pcomp") or p.id != w.id + 1 or (w.low, p.low) not in TWO_WORD_PREPOSITIONS:
                continue
            inner = kids.get(p.id, [])
            if not any(c.deprel == "pobj" for c in inner):
                continue
            for c in inner:
                c.head = w.id
            p.head, p.deprel = w.id, "fixed"
            if w.deprel not in _PREPOSITION_ROLES and w.deprel != "root":
                w.deprel = "prep"
            found.add(w.id)
            counts["two-word preposition→case+fixed"] += 1
            kids = _children(words)
            break
    return found


def _preposition_complements(words: list[_Word], by_id: dict[int, _Word], counts: Counter) -> None:
    """A preposition without ``pobj`` whose complement is another preposition ("from under the bed") or a
    clause ("after eating")."""
    kids = _children(words)
    for p in words:
        if p.deprel not in _PREPOSITION_ROLES:
            continue
        children = kids.get(p.id, [])
        if any(c.deprel == "pobj" for c in children):
            continue
        inner = next((c for c in children if c.deprel in ("pcomp", "prep")
                      and any(g.deprel == "pobj" for g in kids.get(c.id, []))), None)
        if inner is not None:
            noun = next(g for g in kids[inner.id] if g.deprel == "pobj")
            noun.head = p.id
            inner.head, inner.deprel = noun.id, "case"
            counts["prep+pcomp→case+case"] += 1
            kids = _children(words)
            continue
        clause = next((c for c in children if c.deprel == "pcomp"), None)
        if clause is not None:
            clause.head = p.head
            clause.deprel = "advcl" if _is_predicate(by_id.get(p.head)) else "acl"
            p.head, p.deprel = clause.id, "mark"
            counts[f"prep+pcomp→mark+{clause.deprel}"] += 1
            kids = _children(words)


def _prepositions(words: list[_Word], by_id: dict[int, _Word], counts: Counter, known: set[int]) -> None:
    """The object of a preposition takes its place; the preposition becomes the object's ``case``."""
    kids = _children(words)
    object_of: dict[int, _Word] = {}
    for p in words:
        objects = [c for c in kids.get(p.id, []) if c.deprel == "pobj"]
        if not objects:
            continue
        if len(objects) > 1:
            raise ConversionError(f"preposition {p.form!r} (word {p.id}) has {len(objects)} pobj dependents")
        object_of[p.id] = objects[0]
    for pid in sorted(object_of):
        p = by_id[pid]
        coordinated = p.deprel == "conj" and p.head in object_of
        if not (p.deprel in _PREPOSITION_ROLES or coordinated or pid in known or p.upos == "ADP"
                or p.xpos in ("IN", "TO")):
            raise ConversionError(f"{object_of[pid].form!r} (word {object_of[pid].id}) is the pobj of "
                                  f"{p.form!r}, which is not a preposition ({p.deprel}, {p.upos})")
    for pid in sorted(object_of):
        p, noun = by_id[pid], object_of[pid]
        head_id, seen = p.head, set()
        while head_id in object_of and head_id not in seen:  # a preposition on a preposition: on its object
            seen.add(head_id)
            head_id = object_of[head_id].id
        head = by_id.get(head_id)
        if p.deprel == "agent" or (p.deprel == "prep" and p.low == "by" and head is not None and any(
                c.deprel in ("auxpass", "nsubjpass", "csubjpass") for c in kids.get(head.id, []))):
            relation = "obl:agent"  # SD's "by" under a passive verb is its agent, as CoreNLP's converter says
        elif p.deprel == "conj" and p.head in object_of:
            relation = "conj"
            first = by_id[p.head]
            for c in kids.get(first.id, []):  # "on X and on Y": the "and" goes with the objects
                if c.deprel in ("cc", "punct") and first.id < c.id < p.id:
                    c.head = object_of[first.id].id
        elif p.deprel in _PREPOSITION_ROLES:
            relation = "obl" if _is_predicate(head) else "nmod"
        else:
            relation = p.deprel
        counts[f"{p.deprel}+pobj→case+{relation}"] += 1
        noun.head, noun.deprel = head_id, relation
        p.head, p.deprel = noun.id, "case"
    for p in words:  # what is left has no object: "standing around", a stranded preposition
        if p.deprel in ("prep", "agent"):
            _rename(p, "advmod", counts)


def _copula(words: list[_Word], counts: Counter) -> None:
    """A clause headed by "be" with a predicate (``attr``/``acomp`` or a prepositional predicate) is
    re-headed on that predicate and "be" becomes ``cop`` — unless the ``acomp`` is a participle (spaCy:
    "a man is diving", "the seabed is overgrown with coral reefs"), which UD v2 reads as the verb of the
    clause: "be" becomes its ``aux`` (VBG) or ``aux:pass`` (VBN; the subject then ``nsubj:pass``, a "by" phrase
    ``obl:agent``), see :func:`_participle_auxiliary`."""
    kids = _children(words)
    for v in words:
        if v.upos not in ("VERB", "AUX") or not _is_be(v) or v.deprel in ("aux", "auxpass", "cop"):
            continue
        children = kids.get(v.id, [])
        if any(c.deprel == "expl" for c in children):
            for c in children:
                if c.deprel == "attr":
                    _rename(c, "nsubj", counts)
            continue
        predicate = next((c for c in children if c.deprel in ("attr", "acomp")), None)
        how = predicate.deprel if predicate is not None else "prepositional predicate"
        if predicate is None and not any(c.deprel in ("dobj", "obj", "xcomp", "ccomp", "oprd") for c in children):
            predicate = next((c for c in children if c.deprel == "obl" and c.id > v.id
                              and any(g.deprel == "case" for g in kids.get(c.id, []))), None)
        if predicate is None:
            continue
        auxiliary = _participle_auxiliary(predicate) if how == "acomp" else None
        predicate.head, predicate.deprel = v.head, v.deprel
        for c in children:
            if c is not predicate:
                c.head = predicate.id
        v.head, v.deprel = predicate.id, auxiliary or "cop"
        if v.upos == "VERB":
            v.upos = "AUX"  # UD v2: a copula or an auxiliary is AUX
        if auxiliary is None:
            counts[f"be+{how}→cop"] += 1
        else:
            counts[f"be+acomp {_participle_tag(predicate)}→{auxiliary}"] += 1
            if auxiliary == "aux:pass":
                for c in children + kids.get(predicate.id, []):
                    if c.deprel in ("nsubj", "csubj"):
                        _rename(c, f"{c.deprel}:pass", counts)
                    elif c.deprel == "obl" and any(g.deprel == "case" and g.low == "by"
                                                   for g in kids.get(c.id, [])):
                        _rename(c, "obl:agent", counts)
        kids = _children(words)


#: PTB tags of a participle after "be": VBD is a past participle the tagger took for a past tense
#: ("is parked" tagged VBD): after "be" only the participle reading is possible.
_PARTICIPLE_AUX = {"VBG": "aux", "VBN": "aux:pass", "VBD": "aux:pass"}


def _participle_tag(w: _Word) -> str:
    """``VBG``/``VBN``/``VBD`` (the PTB tag), or ``VERB`` for a parse without one (in the conversion's name)."""
    return w.xpos.upper() if w.xpos.upper() in PTB_TO_UPOS else w.upos


def _participle_auxiliary(w: _Word) -> str | None:
    """What "be" is in UD v2 when its ClearNLP ``acomp`` is ``w``: ``aux`` (VBG), ``aux:pass`` (VBN), or None for an
    adjective (then ``cop``); without a PTB tag, by UPOS/FEATS, else an ``-ing`` ending (docs/referral-trees.md)."""
    tag = w.xpos.upper()
    if tag in PTB_TO_UPOS:
        return _PARTICIPLE_AUX.get(tag)
    if w.upos != "VERB":
        return None
    feats = dict(f.split("=", 1) for f in w.feats.split("|") if "=" in f)
    if feats.get("VerbForm") == "Ger" or feats.get("Tense") == "Pres" or feats.get("Aspect") == "Prog":
        return "aux"
    if feats.get("Tense") == "Past" or feats.get("Voice") == "Pass":
        return "aux:pass"
    return "aux" if w.form.lower().endswith("ing") else "aux:pass"


class SchemeConverter:
    """Converts sentences of one scheme to UD v2: ``convert`` → ``(sentence, conversions)``.

    ``trusted`` skips the label/UPOS checks a whole-file detection already made; ``conversions`` counts each change
    by name (``dobj→obj``, ``prep+pobj→case+obl`` …)."""

    def __init__(self, scheme: str, trusted: bool = False):
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, not {scheme!r}")
        self.scheme = scheme
        self.trusted = trusted
        self._fine: set[str] = set()  # ud2 labels already checked

    def convert(self, sentence: ConlluSentence) -> tuple[ConlluSentence, Counter]:
        """``(the sentence in UD v2, conversions)``; :class:`ConversionError` when it cannot be converted."""
        if self.scheme == "ud2":
            if self.trusted:
                return sentence, Counter()
            fine = self._fine
            clean = True
            for w in sentence.words:
                label = _deprel(w.deprel)
                if label not in fine:
                    if not accepts("ud2", label.lower()):
                        raise ConversionError(f"label {label.lower()!r} (word {w.id} {w.text!r}) is not in UD v2")
                    fine.add(label)
                if w.upos not in UD_UPOS:
                    clean = False
            if clean:
                return sentence, Counter()
        counts: Counter = Counter()
        words = [_Word(w) for w in sentence.words]
        if not words:
            raise ConversionError("the sentence has no words")
        _fill_upos(words, counts)
        if self.scheme != "ud2":
            if not self.trusted:
                _check(words, self.scheme)
            if self.scheme == "ud1":
                _from_ud1(words, counts)
            else:
                _from_stanford(words, counts)
            for w in words:
                if not accepts("ud2", w.deprel):
                    raise ConversionError(f"no UD v2 relation for {w.deprel!r} (word {w.id} {w.form!r}) "
                                          "in this construction")
        return ConlluSentence(tuple(w.row() for w in words), sentence.sent_id, sentence.text,
                              sentence.constituency), counts


def to_ud2(sentence: ConlluSentence, scheme: str) -> tuple[ConlluSentence, Counter]:
    """One parsed sentence in ``scheme`` → ``(UD v2 sentence, conversions)``.

    Raises :class:`ConversionError` with the reason when the sentence cannot be converted."""
    return SchemeConverter(scheme).convert(sentence)


def conversion_summary(conversions: Mapping[str, int]) -> str:
    """``nmod→obl 57, dobj→obj 40, …`` (every kind, most frequent first), or ``nothing converted``."""
    if not conversions:
        return "nothing converted"
    items = sorted(conversions.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{name} {count}" for name, count in items)
