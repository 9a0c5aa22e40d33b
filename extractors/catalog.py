"""Imports every extractor module so that each registers itself (one line per module)."""
