"""Caption parsing (stanza, or CoNLL-U made elsewhere), referral-tree construction and dictionaries.

Entry points: :func:`retr.parsers.referral_tree.build_tree` (one parsed sentence → 7-slot tree),
:class:`retr.parsers.backends.StanzaBackend` / :class:`~retr.parsers.backends.ConlluBackend` (captions → parsed
sentences), :func:`retr.parsers.dictionaries.build_dictionaries`, and :func:`retr.parsers.trees_file.read_trees`
/ :class:`~retr.parsers.trees_file.TreeSet` for reading ``trees.h5``. Imports nothing of retr but ``retr.common``.
"""
