"""The offline pipeline: stage orchestration (extract, parse-trees, build-concepts), importers, ``verify`` and
``retr-pipeline``. The files the stages write are defined in :mod:`retr.store`."""
