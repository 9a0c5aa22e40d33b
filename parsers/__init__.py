"""Caption parsing (stanza, or CoNLL-U made elsewhere), referral-tree construction and dictionaries
(docs/referral-trees.md). Imports nothing of retr but ``retr.common`` and ``retr.store``."""
