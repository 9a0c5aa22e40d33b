"""A run's folder, above the models: its settings, checkpoints and trained model (``checkpoint``), the typed
metrics log (``run_log``), a trained run opened on a split (``split``), whether it may resume on the data given
(``resume``), and the authors' released checkpoints written as runs (``official_checkpoints``)."""
