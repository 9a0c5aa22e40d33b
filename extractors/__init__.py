"""Feature extractors: one module per network, each registering its ``ExtractorSpec`` (every module is imported when
the registry is first used: :mod:`retr.extractors.base`); image decoding and batching shared in one place."""
