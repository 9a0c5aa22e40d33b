"""Caption parsing (stanza, or CoNLL-U made elsewhere), referral-tree construction and dictionaries."""
