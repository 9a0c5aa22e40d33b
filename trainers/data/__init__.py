"""What a run reads, below the models: a split's captions and images joined with a feature set (``splits``), and
whether a manifest names the images a feature set was made from (``pairing``)."""
