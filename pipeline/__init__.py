"""The offline pipeline: stage orchestration (extract, parse-trees, build-concepts), importers, ``verify`` and
``retr-pipeline`` (every command in :mod:`retr.pipeline.commands`, the only part that imports click). The files
the stages write are defined in :mod:`retr.store`."""
