"""Feature extractors: one module per network, image decoding and batching shared in one place."""
