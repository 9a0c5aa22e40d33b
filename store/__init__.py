"""The on-disk contracts both halves share: the files one stage writes and another stage (or the trainer) reads.

* :mod:`retr.store.features` — the HDF5 feature store (shards, index, :class:`~retr.store.features.FeatureSet`).
* :mod:`retr.store.trees` — ``trees.h5`` and the parse shards it is merged from.
* :mod:`retr.store.concepts` — ``concepts.h5`` (reader, writer) and GloVe-format word-vector files.
* :mod:`retr.store.vocab` — caption tokenisation and the vocabulary file (SCAN's ``*_vocab.json``).
* :mod:`retr.store.labels` — image-label files (JSON / JSON Lines).
* :mod:`retr.store.conllu` — the CoNLL-U row.

Both the pipeline (which writes these files) and the trainers (which read them) import from here, so neither
imports the other. ``retr.store`` itself imports nothing of retr but :mod:`retr.common`
(``tests/test_layers.py`` checks it).
"""
