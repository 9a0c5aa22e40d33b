"""The offline pipeline: the HDF5 feature store, stage orchestration, importers and ``retr-pipeline``."""
