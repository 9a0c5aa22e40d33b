"""The on-disk contracts both halves share; imports nothing of retr but :mod:`retr.common` (docs/DESIGN.md)."""
