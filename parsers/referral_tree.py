"""From one UD v2 dependency parse to SMFEA's shared referral tree ``[E1 R2 E3 R4 E5 R6 E7]``.

``a dog runs on the grass near a fence`` → ``[dog null null run_PREP grass near fence]``. The rules ("Rule 1" …
below) in order, with examples: docs/referral-trees.md ("The rules")."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Sequence

import nltk

from retr.common.errors import ParameterError
from retr.store.conllu import ConlluRow, ConlluSentence

#: Slot names in in-order traversal; even positions are entities, odd positions relations.
SLOT_NAMES = ("E1", "R2", "E3", "R4", "E5", "R6", "E7")
ENTITY_SLOTS = (0, 2, 4, 6)
RELATION_SLOTS = (1, 3, 5)
NULL_LABEL = "null"

#: Nouns that only frame the picture: ``an image of X`` stands for X.
FRAME_NOUNS = frozenset({"image", "picture", "photo", "photograph", "view", "shot", "snapshot", "closeup",
                         "close-up", "scene", "depiction", "drawing", "painting"})
#: Nouns that only count or group: ``a group of X`` stands for X.
QUANTITY_NOUNS = frozenset({"group", "couple", "pair", "bunch", "herd", "flock", "pack", "number", "lot",
                            "lots", "crowd", "variety", "collection", "set", "pile", "stack", "row", "line",
                            "few", "several", "team", "handful", "dozen", "assortment", "array", "litter"})
#: Nouns that form a multi-word preposition between a preposition and ``of``: ``to the left of``.
RELATIONAL_NOUNS = frozenset({"left", "right", "front", "top", "middle", "side", "back", "edge", "bottom",
                              "center", "centre", "end", "corner", "rear", "inside", "outside", "underside",
                              "base", "foot", "head"})
#: Adjectives that quantify or compare rather than describe; never paired with a noun.
NON_DESCRIPTIVE_ADJECTIVES = frozenset({"other", "many", "several", "few", "various", "different", "same",
                                        "more", "most", "such", "much", "own", "certain", "numerous",
                                        "multiple", "single", "next", "last", "first"})
NOMINAL_UPOS = frozenset({"NOUN", "PROPN"})
VERB_PREP_STYLES = ("placeholder", "word")


@dataclass(frozen=True)
class TreeRules:
    """Options of the tree builder: ``verb_prep`` ``"placeholder"`` (``run_PREP``, the paper's Fig. 4) or ``"word"``
    (``run_on``)."""

    verb_prep: str = "placeholder"

    def __post_init__(self) -> None:
        if self.verb_prep not in VERB_PREP_STYLES:
            raise ParameterError(f"verb_prep must be one of {', '.join(VERB_PREP_STYLES)}, not {self.verb_prep!r}",
                                 "verb_prep")

    def to_json(self) -> str:
        return json.dumps({"verb_prep": self.verb_prep}, sort_keys=True)


@dataclass(frozen=True)
class ReferralTree:
    """Seven slots in in-order ``[E1 R2 E3 R4 E5 R6 E7]``, each a tuple of candidate labels.

    Entity slots list candidates most specific first (``("red_circle", "circle")``); relation slots hold at most one
    label. An empty tuple is ``null``."""

    slots: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        if len(self.slots) != 7:
            raise ValueError(f"a referral tree has 7 slots, got {len(self.slots)}")

    @classmethod
    def empty(cls) -> "ReferralTree":
        return cls(((),) * 7)

    def labels(self) -> list[str]:
        """The most specific label of each slot (``null`` for empty slots): 7 strings."""
        return [slot[0] if slot else NULL_LABEL for slot in self.slots]

    def to_json(self) -> str:
        """Compact JSON (a list of 7 candidate lists) — the form parse shards store."""
        return json.dumps([list(slot) for slot in self.slots], separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "ReferralTree":
        return cls(tuple(tuple(str(label) for label in slot) for slot in json.loads(text)))

    def to_nltk(self, labels: Sequence[str] | None = None) -> nltk.Tree:
        """``(R4 (R2 E1 E3) (R6 E5 E7))`` as an :class:`nltk.Tree` (``labels`` overrides the 7 names)."""
        return slots_to_nltk(labels if labels is not None else self.labels())

    def bracketed(self, labels: Sequence[str] | None = None) -> str:
        """One-line bracketed form, e.g. ``(run_PREP (null dog null) (near grass fence))``."""
        return self.to_nltk(labels).pformat(margin=10**6)

    def __str__(self) -> str:
        return "[" + " ".join(self.labels()) + "]"


def slots_to_nltk(labels: Sequence[str]) -> nltk.Tree:
    """Seven in-order labels → ``nltk.Tree`` ``(R4 (R2 E1 E3) (R6 E5 E7))``."""
    if len(labels) != 7:
        raise ValueError(f"expected 7 labels, got {len(labels)}")
    e1, r2, e3, r4, e5, r6, e7 = (str(label) for label in labels)
    return nltk.Tree(r4, [nltk.Tree(r2, [e1, e3]), nltk.Tree(r6, [e5, e7])])


def nltk_to_slots(tree: nltk.Tree) -> list[str]:
    """Inverse of :func:`slots_to_nltk`: the 7 in-order labels of a bracketed referral tree."""
    left, right = tree[0], tree[1]
    return [left[0], left.label(), left[1], tree.label(), right[0], right.label(), right[1]]


# ----------------------------------------------------------------------------------------------- Lemma fallback

@functools.lru_cache(maxsize=1)
def _wordnet_lemmatizer():
    """NLTK's WordNet lemmatizer if its data is installed here, else ``None`` (never downloaded)."""
    try:
        from nltk.corpus import wordnet  # optional: WordNet's data, where installed
        from nltk.stem import WordNetLemmatizer  # optional: WordNet's data, where installed

        wordnet.ensure_loaded()
        return WordNetLemmatizer()
    except LookupError:
        return None


def fallback_lemma(form: str, upos: str) -> str:
    """Lemma of a word whose parse has none: WordNet (if installed) by part of speech, else the lower-cased form."""
    form = form.lower()
    lemmatizer = _wordnet_lemmatizer()
    if lemmatizer is None:
        return form
    pos = {"NOUN": "n", "PROPN": "n", "VERB": "v", "AUX": "v", "ADJ": "a", "ADV": "r"}.get(upos)
    return lemmatizer.lemmatize(form, pos) if pos else form


# ---------------------------------------------------------------------------- A dependency view of one sentence

def _given(value: str) -> bool:
    return value not in ("", "_")


class DependencySentence:
    """Index over one parsed sentence: words by id, children by head, each word a
    :class:`~retr.store.conllu.ConlluRow` as the rules read it (lemma lower-cased, WordNet's where the parse has
    none; UPOS ``X`` and relation ``dep`` where empty; ``head`` −1 when missing)."""

    def __init__(self, sentence: ConlluSentence):
        words = []
        for w in sentence.words:
            upos = w.upos if _given(w.upos) else "X"
            lemma = w.lemma if _given(w.lemma) else fallback_lemma(w.form, upos)
            words.append(ConlluRow(w.id, w.form, lemma.lower(), upos, w.xpos or "_", w.feats or "_", w.head,
                                   (w.deprel if _given(w.deprel) else "dep").lower()))
        if not words:
            raise ValueError("the sentence has no words")
        self.words = {w.id: w for w in words}
        self.children: dict[int, list[ConlluRow]] = {}
        for w in words:
            self.children.setdefault(w.head, []).append(w)
        roots = self.children.get(0, [])
        if not roots:
            raise ValueError("the parse has no root (no word with head 0)")
        self.root = roots[0]

    def kids(self, word: ConlluRow, *deprels: str) -> list[ConlluRow]:
        """Children of ``word`` whose relation is one of ``deprels`` (a name without ``:`` matches every
        subtype, e.g. ``obl`` matches ``obl:agent``; a full name matches only itself)."""
        found = []
        for child in self.children.get(word.id, []):
            base = child.deprel.split(":")[0]
            if any(child.deprel == d or (":" not in d and base == d) for d in deprels):
                found.append(child)
        return found


def _is_relative_pronoun(word: ConlluRow) -> bool:
    return word.xpos in ("WDT", "WP", "WP$") or "PronType=Rel" in word.feats


# -------------------------------------------------------------------------------------------------- The builder

@dataclass(frozen=True)
class _Predicate:
    relation: str | None
    obj: ConlluRow | None
    rest: tuple[tuple[str, ConlluRow], ...] = ()
    subject: ConlluRow | None = None
    predicative_adjective: str | None = None
    promoted_from_subject: ConlluRow | None = None  # the subject modifier used as the predicate (not reused)


class TreeBuilder:
    """Applies the rules of ``docs/referral-trees.md`` ("The rules") to one parsed sentence at a time."""

    def __init__(self, rules: TreeRules | None = None):
        self.rules = rules or TreeRules()

    # -- public -------------------------------------------------------------------------------------
    def build(self, sentence: ConlluSentence) -> ReferralTree:
        """The referral tree of one parsed sentence (UD v2: :mod:`retr.parsers.schemes` converts the others)."""
        s = DependencySentence(sentence)
        root = s.root
        if root.upos in NOMINAL_UPOS | {"NUM", "PRON"} and not s.kids(root, "cop"):
            subject = self._resolve(s, root)
            predicate = self._promote(s, subject) if subject is not None else _Predicate(None, None)
            predicate = _Predicate(predicate.relation, predicate.obj, predicate.rest, subject,
                                   promoted_from_subject=predicate.promoted_from_subject)
        else:
            predicate = self._clause(s, root)
        subject = self._resolve(s, predicate.subject) if predicate.subject is not None else None

        e1 = self._entity(s, subject, predicate.predicative_adjective) if subject is not None else ()
        r2, e3 = self._modifier(s, subject, exclude=predicate.promoted_from_subject)
        obj = self._resolve(s, predicate.obj) if predicate.obj is not None else None
        e5 = self._entity(s, obj) if obj is not None else ()
        r6, e7 = self._modifier(s, obj) if obj is not None else ((), ())
        if not r6 and not e7 and predicate.rest:
            label, noun = predicate.rest[0]
            r6, e7 = (label,), self._entity(s, self._resolve(s, noun))
        r4 = (predicate.relation,) if predicate.relation else ()
        return ReferralTree((e1, r2, e3, r4, e5, r6, e7))

    # -- nouns --------------------------------------------------------------------------------------
    def _resolve(self, s: DependencySentence, word: ConlluRow | None) -> ConlluRow | None:
        """Rule 1: skip framing/quantity nouns and numbers that have an ``of`` dependent."""
        seen = set()
        while word is not None and word.id not in seen:
            seen.add(word.id)
            transparent = word.upos == "NUM" or (word.upos in NOMINAL_UPOS
                                                 and word.lemma in FRAME_NOUNS | QUANTITY_NOUNS)
            if not transparent:
                return word
            inner = [n for n in s.kids(word, "nmod") if n.deprel != "nmod:poss"
                     and any(c.lemma == "of" for c in s.kids(n, "case"))]
            if not inner:
                return word
            word = inner[0]
        return word

    def _entity(self, s: DependencySentence, noun: ConlluRow | None, predicative_adjective: str | None = None
                ) -> tuple[str, ...]:
        """Candidates of an entity slot: compound, adjective–noun, noun (most specific first)."""
        if noun is None or noun.upos not in NOMINAL_UPOS:
            return ()
        head = noun.lemma
        candidates = []
        compounds = [c for c in s.kids(noun, "compound") if c.deprel == "compound" and c.id < noun.id
                     and c.upos in NOMINAL_UPOS | {"ADJ"}]
        if compounds:
            candidates.append("_".join([c.form.lower() for c in compounds] + [head]))
        adjectives = [a for a in s.kids(noun, "amod") if a.id < noun.id and a.upos in ("ADJ", "VERB")
                      and a.lemma not in NON_DESCRIPTIVE_ADJECTIVES]
        # participles keep their form: "a parked car" → parked_car, not park_car
        nearest = adjectives[-1] if adjectives else None
        adjective = (nearest.form.lower() if nearest.upos == "VERB" else nearest.lemma) if nearest \
            else predicative_adjective
        if adjective:
            candidates.append(f"{adjective}_{head}")
        candidates.append(head)
        return tuple(candidates)

    # -- relations ----------------------------------------------------------------------------------
    def _preposition(self, s: DependencySentence, dependent: ConlluRow) -> tuple[str, ConlluRow] | None:
        """``(label, landmark)`` of a prepositional dependent, or ``None`` if it has no ``case`` word.

        ``on the grass`` → ``("on", grass)``; ``next to a dog`` (``to`` fixed on ``next``) → ``("next_to", dog)``;
        ``to the left of a star`` → ``("to_left_of", star)``."""
        words = []
        for case in s.kids(dependent, "case"):
            if case.xpos == "POS":  # possessive 's
                continue
            words.append("_".join([case.lemma] + [f.lemma for f in s.kids(case, "fixed")]))
        if dependent.lemma in RELATIONAL_NOUNS and dependent.upos in NOMINAL_UPOS:
            of_dependents = [n for n in s.kids(dependent, "nmod") if n.deprel != "nmod:poss"
                             and any(c.lemma == "of" for c in s.kids(n, "case"))]
            if of_dependents:
                return "_".join(words + [dependent.lemma, "of"]), of_dependents[0]
        if not words:
            return None
        return "_".join(words), dependent

    def _complements(self, s: DependencySentence, head: ConlluRow) -> list[tuple[str, ConlluRow]]:
        """Prepositional complements of a predicate (``obl`` with a case word, ``obl:agent``) in word order."""
        found = []
        for dependent in s.kids(head, "obl"):
            if dependent.deprel in ("obl:tmod", "obl:npmod", "obl:unmarked"):
                continue
            prep = self._preposition(s, dependent)
            if prep is not None:
                found.append(prep)
        return found

    def _verb_label(self, s: DependencySentence, verb: ConlluRow) -> str:
        particles = [p.lemma for p in s.kids(verb, "compound:prt")]
        return "_".join([verb.lemma] + particles)

    def _with_preposition(self, verb_label: str, preposition: str) -> str:
        if self.rules.verb_prep == "word":
            return f"{verb_label}_{preposition}"
        return f"{verb_label}_PREP"

    def _clause(self, s: DependencySentence, head: ConlluRow) -> _Predicate:
        """Rule 2 for a clause headed by ``head`` (a root, a relative clause, a clausal modifier)."""
        subjects = [w for w in s.kids(head, "nsubj") if not _is_relative_pronoun(w)]
        subject = subjects[0] if subjects else None
        if s.kids(head, "cop"):
            return self._copular(s, head, subject)
        if s.kids(head, "expl") and subject is not None:
            complements = self._complements(s, head)
            if complements:
                (label, noun), rest = complements[0], tuple(complements[1:])
                return _Predicate(label, noun, rest, subject)
            promoted = self._promote(s, self._resolve(s, subject))
            return _Predicate(promoted.relation, promoted.obj, promoted.rest, subject,
                              promoted_from_subject=promoted.promoted_from_subject)
        objects = s.kids(head, "obj") or s.kids(head, "iobj")
        complements = self._complements(s, head)
        if not objects and not complements:
            xcomps = [x for x in s.kids(head, "xcomp") if x.upos == "VERB"]
            if xcomps:
                inner = self._clause(s, xcomps[0])
                return _Predicate(inner.relation, inner.obj, inner.rest, subject)
        verb = self._verb_label(s, head) if head.upos in ("VERB", "AUX") else head.lemma
        if objects:
            return _Predicate(verb, objects[0], tuple(complements), subject)
        if complements:
            (label, noun), rest = complements[0], tuple(complements[1:])
            return _Predicate(self._with_preposition(verb, label), noun, rest, subject)
        return _Predicate(verb, None, (), subject)

    def _copular(self, s: DependencySentence, head: ConlluRow, subject: ConlluRow | None) -> _Predicate:
        if head.upos == "ADJ":
            complements = self._complements(s, head)
            if complements:
                (label, noun), rest = complements[0], tuple(complements[1:])
                return _Predicate(self._with_preposition(head.lemma, label), noun, rest, subject)
            return _Predicate(None, None, (), subject, predicative_adjective=head.lemma)
        prep = self._preposition(s, head)
        if prep is not None:
            label, noun = prep
            return _Predicate(label, noun, tuple(self._complements(s, head)), subject)
        return _Predicate("be", head, tuple(self._complements(s, head)), subject)

    def _promote(self, s: DependencySentence, noun: ConlluRow | None) -> _Predicate:
        """Verbless captions: the first clausal, else prepositional, modifier of ``noun`` (or of its
        conjuncts) becomes the main predicate."""
        if noun is None:
            return _Predicate(None, None)
        for candidate in [noun] + [c for c in s.kids(noun, "conj") if c.upos in NOMINAL_UPOS]:
            clauses = s.kids(candidate, "acl")
            if clauses:
                inner = self._clause(s, clauses[0])
                return _Predicate(inner.relation, inner.obj, inner.rest, promoted_from_subject=clauses[0])
            for dependent in s.kids(candidate, "nmod"):
                if dependent.deprel == "nmod:poss":
                    continue
                prep = self._preposition(s, dependent)
                if prep is not None:
                    return _Predicate(prep[0], prep[1], (), promoted_from_subject=dependent)
        return _Predicate(None, None)

    def _modifier(self, s: DependencySentence, noun: ConlluRow | None, exclude: ConlluRow | None = None
                  ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Rule 3: ``(relation candidates, entity candidates)`` of the first modifier of ``noun``."""
        if noun is None:
            return (), ()
        for child in s.children.get(noun.id, []):
            if exclude is not None and child.id == exclude.id:
                continue
            base = child.deprel.split(":")[0]
            if base == "nmod" and child.deprel != "nmod:poss":
                prep = self._preposition(s, child)
                if prep is not None:
                    return (prep[0],), self._entity(s, self._resolve(s, prep[1]))
            elif base == "acl":
                inner = self._clause(s, child)
                obj = self._resolve(s, inner.obj) if inner.obj is not None else None
                return ((inner.relation,) if inner.relation else ()), self._entity(s, obj)
            elif base == "conj" and child.upos in NOMINAL_UPOS:
                ccs = s.kids(child, "cc")
                return (ccs[0].lemma if ccs else "and",), self._entity(s, self._resolve(s, child))
        return (), ()


def build_tree(sentence: ConlluSentence, rules: TreeRules | None = None) -> ReferralTree:
    """The referral tree of one parsed sentence (rules: ``docs/referral-trees.md``, "The rules")."""
    return TreeBuilder(rules).build(sentence)
