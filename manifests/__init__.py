"""Manifests (the JSON Lines schema), Karpathy split readers, dataset presets and the synthetic dataset."""
from retr.manifests.schema import (SPLITS, ManifestError, ManifestRecord, iter_manifest, manifest_sha256,
                                   read_manifest, resolve_image_root, write_manifest)

__all__ = ["SPLITS", "ManifestError", "ManifestRecord", "iter_manifest", "manifest_sha256", "read_manifest",
           "resolve_image_root", "write_manifest"]
