"""End to end: ``retr-pipeline extract --extractor butd-regions --weights random`` on the synthetic dataset."""
from __future__ import annotations

import numpy as np
import pytest

from retr.store.features import FeatureSet
from retr.pipeline.verify import verify_feature_set

# the speed options keep this test fast; the same settings as test_butd_model, so the random weights are reused
FAST_ARGS = ["--short-side", "96", "--max-side", "128", "--pre-nms-topk", "600", "--post-nms-topk", "40",
             "--pooled-size", "7"]


@pytest.mark.slow
def test_extract_command_writes_a_sound_regions_set_and_records_bad_images(tmp_path, run_cli):
    from retr.manifests.synthetic import generate_synthetic

    data = tmp_path / "synthetic"
    generate_synthetic(data, num_images=4, seed=0)
    broken = sorted((data / "images").glob("*.jpg"))[1]
    broken.write_bytes(b"not a jpeg at all")
    args = ["extract", "--manifest", str(data / "manifest.jsonl"), "--extractor", "butd-regions",
            "--weights", "random", "--out", str(tmp_path / "features"), "--workers", "0", "--quiet", *FAST_ARGS]
    run_cli("pipeline", *args)
    path = tmp_path / "features" / "butd-regions.h5"
    assert verify_feature_set(path) == []
    fs = FeatureSet(path)
    assert len(fs) == 3 and fs.feature_shape == (36, 2048) and fs.dtype == np.float16
    assert [e[0] for e in fs.errors] == [broken.stem] and "decode" in fs.errors[0][1]
    features = fs.read_all().astype(np.float32)
    assert np.isfinite(features).all() and features.std() > 0
    assert (fs.read_all("num_boxes") == 36).all()
    boxes = fs.read_all("boxes")
    assert boxes.min() >= 0 and boxes[..., 2:].max() <= 223
    assert fs.attrs["kind"] == "regions" and fs.attrs["weights"] == "random"
    assert fs.attrs["short_side"] == 96 and fs.attrs["detector_settings"]["pooled_size"] == 7
    # a second run resumes: the complete shard is kept as is
    before = path.with_suffix("").joinpath("shard-00000-of-00001.h5").stat().st_mtime_ns
    run_cli("pipeline", *args)
    assert path.with_suffix("").joinpath("shard-00000-of-00001.h5").stat().st_mtime_ns == before
