"""Recall, medr, meanr, rSum and the protocols against hand-computed cases."""
from __future__ import annotations

import numpy as np
import pytest

from retr.trainers.data.splits import SplitData
from retr.trainers.evaluation.metrics import (coco_folds, i2t_ranks, protocol_metrics, rank_metrics, retrieval_metrics,
                                      t2i_ranks)


def _authors_i2t_t2i(sims: np.ndarray):
    """The authors' loops (5 captions per image, argsort descending) for matrices without ties."""
    n = sims.shape[0]
    r_i2t = []
    for i in range(n):
        inds = np.argsort(sims[i])[::-1]
        r_i2t.append(min(np.where(inds == j)[0][0] for j in range(5 * i, 5 * i + 5)))
    r_t2i = []
    for c in range(sims.shape[1]):
        inds = np.argsort(sims[:, c])[::-1]
        r_t2i.append(np.where(inds == c // 5)[0][0])
    return np.array(r_i2t), np.array(r_t2i)


def test_hand_computed_ranks_and_metrics():
    # 2 images × 4 captions (captions 0,1 → image 0; 2,3 → image 1)
    sims = np.array([[0.1, 0.9, 0.5, 0.95],
                     [0.8, 0.2, 0.3, 0.1]])
    owner = np.array([0, 0, 1, 1])
    # image 0: best true caption 1 (0.9) — only caption 3 (0.95) is higher → rank 1
    # image 1: best true caption 2 (0.3) — captions 0 (0.8) is higher, caption 1 (0.2) is not → rank 1
    assert i2t_ranks(sims, owner).tolist() == [1, 1]
    # caption 0: true image 0 (0.1) < image 1 (0.8) → 1; caption 1: 0; caption 2: 0.3 vs 0.5 → 1; caption 3: 0.1 vs 0.95 → 1
    assert t2i_ranks(sims, owner).tolist() == [1, 0, 1, 1]
    m = retrieval_metrics(sims, owner)
    assert m["i2t"] == {"r1": 0.0, "r5": 100.0, "r10": 100.0, "medr": 2.0, "meanr": 2.0}
    assert m["t2i"] == {"r1": 25.0, "r5": 100.0, "r10": 100.0, "medr": 2.0, "meanr": 1.75}
    assert m["rsum"] == 0 + 100 + 100 + 25 + 100 + 100


def test_ties_count_against_the_query():
    sims = np.zeros((3, 3))
    owner = np.arange(3)
    assert i2t_ranks(sims, owner).tolist() == [2, 2, 2]
    assert t2i_ranks(sims, owner).tolist() == [2, 2, 2]
    m = retrieval_metrics(sims, owner)
    assert m["i2t"]["r1"] == m["t2i"]["r1"] == 0.0 and m["rsum"] == 400.0   # R@5 and R@10 of 3 items: 100
    # a tie between two true captions of one image does not hurt that image
    sims = np.array([[0.5, 0.5, 0.5], [0.1, 0.1, 0.9]])
    assert i2t_ranks(sims, np.array([0, 0, 1])).tolist() == [1, 0]


def test_medr_floors_even_medians_and_meanr():
    ranks = np.array([0, 1, 2, 5])           # median 1.5 → floor 1 → medr 2
    m = rank_metrics(ranks)
    assert m["medr"] == 2.0 and m["meanr"] == 3.0 and m["r1"] == 25.0 and m["r5"] == 75.0 and m["r10"] == 100.0


def test_agrees_with_the_authors_loops_on_random_scores():
    rng = np.random.default_rng(0)
    sims = rng.standard_normal((40, 200))
    sims[np.arange(40).repeat(5), np.arange(200)] += 1.5
    owner = np.arange(200) // 5
    want_i2t, want_t2i = _authors_i2t_t2i(sims)
    np.testing.assert_array_equal(i2t_ranks(sims, owner), want_i2t)
    np.testing.assert_array_equal(t2i_ranks(sims, owner), want_t2i)
    m = retrieval_metrics(sims, owner)
    assert m["i2t"]["r1"] == 100.0 * np.mean(want_i2t < 1)
    assert m["t2i"]["meanr"] == want_t2i.mean() + 1
    assert m["t2i"]["medr"] == np.floor(np.median(want_t2i)) + 1


def _split(n_images: int, per_image: int = 5) -> SplitData:
    owner = np.arange(n_images * per_image) // per_image
    return SplitData([f"i{k}" for k in range(n_images)], ["c"] * owner.size, owner, [[1, 2]] * owner.size)


def test_coco_five_fold_slicing():
    assert coco_folds(10) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    with pytest.raises(Exception, match="divisible"):
        coco_folds(12)
    rng = np.random.default_rng(1)
    data = _split(10)
    sims = rng.standard_normal((10, 50))
    with pytest.raises(Exception, match="coco-1k expects a split of 5000 images, this one has 10"):
        protocol_metrics(sims, data, "coco-1k")
    result = protocol_metrics(sims, data, "coco-1k", allow_size_mismatch=True)
    assert len(result["folds"]) == 5 and result["size_mismatch"] == {"expected": 5000, "images": 10}
    # fold 2 = images 4,5 and captions 20..29, scored only against each other
    fold = retrieval_metrics(sims[4:6, 20:30], np.arange(10) // 5)
    assert result["folds"][2]["rsum"] == fold["rsum"]
    assert result["i2t"]["r1"] == pytest.approx(np.mean([f["i2t"]["r1"] for f in result["folds"]]))
    assert result["rsum"] == pytest.approx(np.mean([f["rsum"] for f in result["folds"]]))
    first = protocol_metrics(sims, data, "coco-1k-first", allow_size_mismatch=True)
    assert first["rsum"] == result["folds"][0]["rsum"] and first["images"] == 2 and first["captions"] == 10
    whole = protocol_metrics(sims, data, "coco-5k", allow_size_mismatch=True)
    assert "folds" not in whole and whole["images"] == 10 and whole["captions"] == 50


def test_protocols_refuse_another_split_size_unless_allowed():
    from retr.trainers.evaluation.metrics import EXPECTED_IMAGES, check_split_size

    assert EXPECTED_IMAGES == {"f30k-1k": 1000, "coco-1k": 5000, "coco-5k": 5000, "coco-1k-first": 5000}
    for protocol, size in EXPECTED_IMAGES.items():
        assert check_split_size(protocol, size) is None
        with pytest.raises(Exception, match="--allow-size-mismatch"):
            check_split_size(protocol, size + 5)
        assert check_split_size(protocol, 24, allow_size_mismatch=True) == {"expected": size, "images": 24}


def _authors_i2t_t2i(sims: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The authors' evaluation loops, written out in the test: captions 5k..5k+4 belong to image k."""
    n = sims.shape[0]
    i2t = np.zeros(n)
    for index in range(n):
        inds = np.argsort(sims[index])[::-1]
        rank = 1e20
        for i in range(5 * index, 5 * index + 5):
            rank = min(rank, np.where(inds == i)[0][0])
        i2t[index] = rank
    t2i = np.zeros(5 * n)
    sims_t = sims.T
    for index in range(n):
        for i in range(5):
            inds = np.argsort(sims_t[5 * index + i])[::-1]
            t2i[5 * index + i] = np.where(inds == index)[0][0]
    return i2t, t2i


def test_official_tie_rule_equals_the_authors_loops_where_ties_differ():
    from retr.trainers.evaluation.metrics import i2t_ranks_official, t2i_ranks_official

    rng = np.random.default_rng(4)
    sims = np.round(rng.standard_normal((30, 150)), 1)        # coarse values: many exact ties
    sims[:, 5:10] = sims[:, 0:5]                              # identical captions of images 0 and 1 tie exactly
    caption_image = np.arange(150) // 5
    want_i2t, want_t2i = _authors_i2t_t2i(sims)
    np.testing.assert_array_equal(i2t_ranks_official(sims, caption_image), want_i2t)
    np.testing.assert_array_equal(t2i_ranks_official(sims, caption_image), want_t2i)
    official = retrieval_metrics(sims, caption_image, ties="official")
    pessimistic = retrieval_metrics(sims, caption_image)
    assert official["i2t"]["r1"] == pytest.approx(100 * np.mean(want_i2t < 1))
    assert official["i2t"]["r1"] >= pessimistic["i2t"]["r1"] and official != pessimistic
    with pytest.raises(ValueError, match="ties must be one of"):
        retrieval_metrics(sims, caption_image, ties="optimistic")


def test_the_hint_after_training_names_the_protocols_the_test_split_fits(tmp_path):
    """Printed after `retr-train MODEL`: a 5,000-image test split is COCO (1K folds or 5K), 1,000 is Flickr30K,
    another size says so (it was always `--protocol f30k-1k`, also for COCO runs)."""
    from retr.manifests.schema import ManifestRecord, write_manifest
    from retr.trainers.config import TrainConfig
    from retr.trainers.evaluation.metrics import protocols_for
    from retr.trainers.commands.train import evaluate_hint

    assert protocols_for(5000) == ["coco-1k", "coco-5k", "coco-1k-first"] and protocols_for(1000) == ["f30k-1k"]
    for n, expected in ((1000, ["--protocol f30k-1k"]), (5000, ["--protocol coco-1k", "--protocol coco-5k"]),
                        (7, ["--allow-size-mismatch", "7 images"])):
        manifest = tmp_path / f"m{n}.jsonl"
        write_manifest(manifest, [ManifestRecord(f"i{k}", f"{k}.jpg", "test", ("a cat",)) for k in range(n)]
                       + [ManifestRecord("t0", "t.jpg", "train", ("a dog",))])
        hint = evaluate_hint(TrainConfig(manifest=str(manifest), out="runs/x"))
        assert all(part in hint for part in expected), hint
        assert n != 5000 or "f30k-1k" not in hint
