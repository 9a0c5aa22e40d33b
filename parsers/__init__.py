"""Caption parsing (stanza, or CoNLL-U made elsewhere), referral-tree construction and dictionaries.

Entry points: :func:`retr.parsers.referral_tree.build_tree` (one parsed sentence → 7-slot tree),
:class:`retr.parsers.backends.StanzaBackend` / :class:`~retr.parsers.backends.ConlluBackend` (captions → parsed
sentences) and :func:`retr.parsers.dictionaries.build_dictionaries`. The ``trees.h5`` file itself (writer,
:func:`~retr.store.trees.read_trees`, :class:`~retr.store.trees.TreeSet`) is in :mod:`retr.store.trees`.
Imports nothing of retr but ``retr.common`` and ``retr.store``.
"""
