"""ECCV Caption, CxC and COCO 1K/5K from one matrix (trainers/evaluation/coco_extended.py) against the authors'
evaluator itself: ``eccv_caption.Metrics`` on its real annotations (the installed package), given each query's
ranked list, on constructed 5,000 × 25,000 matrices — perfect retrieval, random, near-perfect with extended
positives ranked first, and one with exact ties under both tie rules. Every number must be 100 × the package's, to
the last bit; then the annotations and ids the extended metrics refuse, one line each."""
from __future__ import annotations

import json
import shutil
import sys
import warnings

import numpy as np
import pytest

from retr.common.errors import UserError
from retr.common.optional import MissingExtraError
from retr.trainers.evaluation import coco_extended as ce

with warnings.catch_warnings():                      # eccv_caption warns that ujson is not installed
    warnings.simplefilter("ignore")
    from eccv_caption import Metrics

#: each reference list's length: the package reads at most the first R ≤ 48 items (mAP@R), or the first ten of a
#: query's 1K fold, which the first 200 of a 5K list always hold here (checked)
LENGTH = 200
PACKAGE_TARGETS = ("eccv_map_at_r", "eccv_rprecision", "eccv_r1", "coco_1k_recalls", "coco_5k_recalls", "cxc_recalls")


@pytest.fixture(scope="module")
def annotations():
    return ce.load_annotations()


@pytest.fixture(scope="module")
def metrics():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Metrics()


def _ids(annotations, image_order=None, caption_order=None) -> ce.MatrixIds:
    """The ids of a matrix whose rows are the test images and columns the test captions (Karpathy's order, or the
    given permutations of it)."""
    images = annotations.image_ids if image_order is None else annotations.image_ids[image_order]
    captions = annotations.caption_ids if caption_order is None else annotations.caption_ids[caption_order]
    owner = dict(zip(annotations.caption_ids.tolist(), annotations.caption_image.tolist()))
    keys = [f"coco_{owner[c]}#{c}" for c in captions.tolist()]
    return ce.matrix_ids([f"coco_{i}" for i in images.tolist()], keys, captions.tolist(), "the test matrix")


def _positives(annotations, ids: ce.MatrixIds, family: str) -> tuple[dict, dict]:
    """(image row → set of caption columns, caption column → set of image rows) of a family's positives."""
    row = {int(i): r for r, i in enumerate(ids.image_ids)}
    col = {int(c): m for m, c in enumerate(ids.caption_ids)}
    i2t, t2i = annotations.sets[family, "i2t"], annotations.sets[family, "t2i"]
    return ({row[int(q)]: {col[int(c)] for c in p if c in col} for q, p in zip(i2t.queries, i2t.positives)},
            {col[int(q)]: {row[int(i)] for i in p if i in row} for q, p in zip(t2i.queries, t2i.positives)})


def _query_rows(sims: np.ndarray, direction: str, start: int, stop: int) -> np.ndarray:
    return sims[start:stop] if direction == "i2t" else np.ascontiguousarray(sims[:, start:stop].T)


def reference_lists(sims: np.ndarray, direction: str, ties: str, positives: dict | None = None) -> dict:
    """Each query's first items by the rule's definition — official: ``np.argsort(row)[::-1]`` (a column as a
    contiguous copy, as retr's official t2i ranks it); pessimistic: by score, a query's positives after every other
    item they tie — from a partial sort where the top has no tie, else from the whole row sorted. ``positives``:
    family → (query → its positives), for pessimistic lists, one set of lists per family; returns family (or
    ``"all"`` for official lists) → lists (COCO's :data:`LENGTH` long, for its 1K folds; the others 60)."""
    families = list(positives) if ties == "pessimistic" else ["all"]
    out: dict[str, list] = {f: [] for f in families}
    length = {f: LENGTH if f in ("coco", "all") else 60 for f in families}
    queries = sims.shape[0] if direction == "i2t" else sims.shape[1]
    for start in range(0, queries, 512):
        rows = _query_rows(sims, direction, start, min(start + 512, queries))
        top = np.argpartition(-rows, LENGTH, axis=1)[:, :LENGTH + 1]
        values = np.take_along_axis(rows, top, 1)
        order = np.argsort(-values, axis=1, kind="stable")
        top, values = np.take_along_axis(top, order, 1), np.take_along_axis(values, order, 1)
        tied = (np.diff(values, axis=1) == 0).any(axis=1)
        for r in range(len(rows)):
            for family in families:
                if not tied[r]:
                    out[family].append(top[r, :length[family]])
                elif ties == "official":
                    out[family].append(np.argsort(rows[r])[::-1][:length[family]])
                else:
                    mine = np.zeros(rows.shape[1], dtype=bool)
                    mine[list(positives[family].get(start + r, ()))] = True
                    out[family].append(np.lexsort((mine, -rows[r]))[:length[family]])
    return out


def package_numbers(metrics, annotations, ids, sims, ties) -> dict:
    """What ``eccv_caption.Metrics`` computes from the reference lists, as retr names and scales it (percent)."""
    fold = {int(c): n // 5000 for n, c in enumerate(annotations.caption_ids)}          # Karpathy's order
    image_fold = {int(i): fold[int(c)] for c, i in zip(annotations.caption_ids, annotations.caption_image)}
    families = ("coco", "cxc", "eccv")

    def items(direction):
        side = 0 if direction == "i2t" else 1
        positives = {f: _positives(annotations, ids, f)[side] for f in families} if ties == "pessimistic" else None
        lists = reference_lists(sims, direction, ties, positives)
        if direction == "i2t":
            keys, names = ids.image_ids, ids.caption_ids
            folds, item_folds = [image_fold[int(i)] for i in keys], np.array([fold[int(c)] for c in names])
        else:
            keys, names = ids.caption_ids, ids.image_ids
            folds, item_folds = [fold[int(c)] for c in keys], np.array([image_fold[int(i)] for i in names])
        coco = lists.get("coco", lists.get("all"))
        assert all((item_folds[lst] == f).sum() >= 10 for lst, f in zip(coco, folds))   # 1K: ten of its fold
        return {family: {int(k): names[lst].tolist() for k, lst in zip(keys, found)}
                for family, found in lists.items()}

    i2t, t2i = items("i2t"), items("t2i")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if ties == "official":           # one list per query for every family: compute_all_metrics itself
            raw = metrics.compute_all_metrics(i2t["all"], t2i["all"], target_metrics=PACKAGE_TARGETS, Ks=(1, 5, 10),
                                              verbose=False)
        else:                            # pessimistic lists depend on the family's positives: one call each
            per = {f: {"i2t": i2t[f], "t2i": t2i[f]} for f in families}
            raw = dict(metrics.eccv_metrics(per["eccv"], "all"))
            for k in (1, 5, 10):
                raw[f"coco_5k_r{k}"] = metrics.coco_5k_recalls(per["coco"], "all", K=k)
                raw[f"coco_1k_r{k}"] = metrics.coco_1k_recalls(per["coco"], "all", K=k)
                raw[f"cxc_r{k}"] = metrics.cxc_recalls(per["cxc"], "all", K=k)
    return {name: {d: 100 * float(raw[name][d]) for d in ("i2t", "t2i")} for name in ce.METRIC_NAMES}


def _uniform(rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """A 5,000 × 25,000 float64 matrix of uniform scores in [0, scale), made in place (1 GB, not 2)."""
    sims = np.empty((5000, 25000))
    rng.random(out=sims)
    sims *= scale
    return sims


def _true_pairs(annotations, ids) -> tuple[np.ndarray, np.ndarray]:
    return ids.caption_image, np.arange(len(ids.caption_ids))


def _extended_pairs(annotations, ids, family: str) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of every i2t positive of ``family`` that is not COCO's own pair."""
    i2t = _positives(annotations, ids, family)[0]
    pairs = [(r, c) for r, cols in i2t.items() for c in cols if ids.caption_image[c] != r]
    return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])


def _assert_equal(ours: dict, theirs: dict) -> None:
    differ = {(name, d): (ours[name][d], theirs[name][d]) for name in ce.METRIC_NAMES for d in ("i2t", "t2i")
              if ours[name][d] != theirs[name][d]}
    assert not differ, differ


@pytest.mark.slow
def test_perfect_random_and_near_perfect_matrices_score_as_the_authors_evaluator(annotations, metrics):
    """No exact ties: both tie rules rank alike, and every number is the package's."""
    rng = np.random.default_rng(0)
    ids = _ids(annotations)
    rows, cols = _true_pairs(annotations, ids)
    # perfect retrieval: COCO's own pairs above everything
    sims = _uniform(rng, 0.5)
    sims[rows, cols] += 1.0
    ours = ce.extended_metrics(sims, ids, annotations, "pessimistic")
    _assert_equal(ours, package_numbers(metrics, annotations, ids, sims, "official"))      # no tie: either rule
    assert all(ours[f"coco_{n}_r{k}"][d] == 100.0 for n in ("1k", "5k") for k in (1, 5, 10) for d in ("i2t", "t2i"))
    assert ours["eccv_map_at_r"]["i2t"] < 100.0          # ECCV's extra positives are ranked anywhere
    # near-perfect, with ECCV Caption's and CxC's extra positives ranked first: their numbers rise
    for family in ("eccv", "cxc"):
        r, c = _extended_pairs(annotations, ids, family)
        sims[r, c] += 2.0
    better = ce.extended_metrics(sims, ids, annotations, "pessimistic")
    _assert_equal(better, package_numbers(metrics, annotations, ids, sims, "official"))
    assert better["eccv_map_at_r"]["i2t"] > ours["eccv_map_at_r"]["i2t"]
    assert better["coco_5k_r1"]["i2t"] < 100.0           # now above COCO's own captions
    del sims                                             # one 1 GB matrix at a time
    # random, rows and columns in another order than Karpathy's: matched by ids, not by place
    image_order, caption_order = rng.permutation(5000), rng.permutation(25000)
    shuffled = _ids(annotations, image_order, caption_order)
    sims = _uniform(rng)
    ours = ce.extended_metrics(sims, shuffled, annotations, "official")
    _assert_equal(ours, package_numbers(metrics, annotations, shuffled, sims, "official"))


@pytest.mark.slow
def test_exact_ties_follow_the_tie_rule_as_the_package_ranks_such_lists(annotations, metrics):
    """A near-perfect matrix where some queries' positives tie negatives and each other exactly: pessimistic lists
    put the negatives first, official ones are np.argsort's; the numbers are the package's on those lists."""
    rng = np.random.default_rng(1)
    ids = _ids(annotations)
    rows, cols = _true_pairs(annotations, ids)
    sims = _uniform(rng, 0.5)
    sims[rows, cols] += 1.0
    r, c = _extended_pairs(annotations, ids, "eccv")
    sims[r, c] += 1.0 + 0.1 * rng.random(len(r))
    for image in rng.choice(5000, 400, replace=False):         # i2t: negatives tie the image's best caption
        best = int(np.argmax(sims[image]))
        negatives = np.flatnonzero(sims[image] < 0.5)
        sims[image, rng.choice(negatives, 2, replace=False)] = sims[image, best]
    for caption in rng.choice(25000, 1500, replace=False):     # t2i: another image ties the caption's own
        sims[rng.choice(5000, 1), caption] = sims[ids.caption_image[caption], caption]
    numbers = {}
    for ties in ("pessimistic", "official"):
        numbers[ties] = ce.extended_metrics(sims, ids, annotations, ties)
        _assert_equal(numbers[ties], package_numbers(metrics, annotations, ids, sims, ties))
    assert numbers["pessimistic"]["coco_5k_r1"]["t2i"] < numbers["official"]["coco_5k_r1"]["t2i"]   # decisive


def test_coco_numbers_equal_retrs_own_protocols_on_a_karpathy_ordered_matrix(annotations):
    """COCO 5K and 1K as the package counts them are retr's coco-5k and coco-1k (pessimistic ties; the folds of
    the package are Karpathy's order, which a COCO manifest keeps)."""
    from retr.trainers.data.splits import SplitData
    from retr.trainers.evaluation.metrics import protocol_metrics

    rng = np.random.default_rng(2)
    ids = _ids(annotations)
    sims = _uniform(rng)
    sims[ids.caption_image, np.arange(25000)] += 0.8
    ours = ce.extended_metrics(sims, ids, annotations, "pessimistic")
    data = SplitData([f"coco_{i}" for i in ids.image_ids], ids.caption_keys, ids.caption_image, [])
    for protocol, name in (("coco-5k", "coco_5k"), ("coco-1k", "coco_1k")):
        result = protocol_metrics(sims, data, protocol)
        for d in ("i2t", "t2i"):
            for k in (1, 5, 10):
                # the 1K mean is taken over fractions there, over percentages here: equal to rounding (1e-12)
                assert ours[f"{name}_r{k}"][d] == pytest.approx(result[d][f"r{k}"], abs=1e-9)


# ------------------------------------------------------------------------------------------------ wrong inputs

def test_ids_that_are_not_the_coco_5k_test_set_are_refused_in_one_line(annotations):
    ids = _ids(annotations)
    keys, captions = ids.caption_keys, ids.caption_ids.tolist()
    images = [f"coco_{i}" for i in ids.image_ids.tolist()]
    with pytest.raises(UserError, match=r"1,000 images and 5,000 captions; --extended scores the COCO 5K test set"):
        ce.check_test_set(annotations, ce.matrix_ids(images[:1000], keys[:5000], captions[:5000], "m"))
    wrong = ce.matrix_ids(["coco_9"] + images[1:], [k.replace(images[0], "coco_9") for k in keys], captions, "m")
    with pytest.raises(UserError, match=r"m: 1 images are not in the COCO 5K test set \(first: coco_9\)"):
        ce.check_test_set(annotations, wrong)
    swapped = captions[:]
    swapped[0], swapped[5] = swapped[5], swapped[0]              # caption 0 given a caption id of image 1
    with pytest.raises(UserError, match=rf"caption {keys[0]} has COCO caption id {captions[5]}, a caption of COCO "
                                        rf"image {ids.image_ids[1]}, not of {images[0]}"):
        ce.check_test_set(annotations, ce.matrix_ids(images, keys, swapped, "m"))
    with pytest.raises(UserError, match="which is not one of the COCO 5K test captions"):
        ce.check_test_set(annotations, ce.matrix_ids(images, keys, [1] + captions[1:], "m"))
    with pytest.raises(UserError, match=r"25,000 of its 25,000 captions have no COCO caption id \(first: .*"
                                        r"retr-pipeline manifest coco-caption-ids"):
        ce.matrix_ids(images, keys, [None] * 25000, "m")
    with pytest.raises(UserError, match="image 'synth_00001' names no COCO image"):
        ce.matrix_ids(["synth_00001"], ["synth_00001#0"], [1], "m")
    with pytest.raises(UserError, match="--protocol f30k-1k is not a COCO protocol"):
        ce.check_protocol("f30k-1k")


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "eccv_caption", None)          # what find_spec sees when it is not installed
    with pytest.raises(MissingExtraError, match=r"^eccv-caption is not installed \(needed by --extended: the ECCV "
                                                r"Caption and CxC annotations\): pip install 'retr\[eccv\]' \(or "
                                                r"make setup\)$"):
        ce.load_annotations()


@pytest.mark.parametrize("damage", ["missing", "truncated", "fewer queries", "test ids"])
def test_a_missing_or_partial_annotation_file_is_one_line(annotations, tmp_path, monkeypatch, damage):
    """A copy of the installed package, one of its files damaged, found first on sys.path."""
    package = tmp_path / "site" / "eccv_caption"
    shutil.copytree(annotations.folder, package)
    data = package / "data"
    if damage == "missing":
        (data / "eccv_caption_to_image.json").unlink()
        expected = r"eccv_caption_to_image.json is missing: the eccv-caption package is incomplete; reinstall"
    elif damage == "truncated":
        body = (data / "cxc_image_to_caption.json").read_bytes()
        (data / "cxc_image_to_caption.json").write_bytes(body[:len(body) // 2])
        expected = r"cxc_image_to_caption.json is not complete JSON \(.*\): the eccv-caption package is incomplete"
    elif damage == "fewer queries":
        whole = json.loads((data / "eccv_image_to_caption.json").read_text())
        (data / "eccv_image_to_caption.json").write_text(json.dumps(dict(list(whole.items())[:1000])))
        expected = r"eccv_image_to_caption.json holds 1,000 queries, not the 1,261 it is published with"
    else:
        np.save(data / "coco_test_ids.npy", np.load(data / "coco_test_ids.npy")[:24000])
        expected = r"coco_test_ids.npy holds \(24000,\) int64 ids, not the 25,000 distinct COCO 5K test caption ids"
    monkeypatch.delitem(sys.modules, "eccv_caption", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(UserError, match=expected):
        ce.load_annotations()


def test_the_positive_pairs_are_every_familys_in_both_directions(annotations):
    """What refined precision rescores for --extended: each family's i2t and t2i positives as matrix pairs, in a
    shuffled order of rows and columns too."""
    rng = np.random.default_rng(11)
    ids = _ids(annotations, rng.permutation(ce.TEST_IMAGES), rng.permutation(ce.TEST_CAPTIONS))
    expected = set()
    for family in ("coco", "cxc", "eccv"):
        i2t, t2i = _positives(annotations, ids, family)
        expected |= {(r, c) for r, cols in i2t.items() for c in cols}
        expected |= {(r, c) for c, rows in t2i.items() for r in rows}
    rows, cols = ce.positive_pairs(ids, annotations)
    assert set(zip(rows.tolist(), cols.tolist())) == expected and len(rows) == len(expected)
    assert {(int(r), c) for c, r in enumerate(ids.caption_image)} <= expected     # COCO's own pairs among them
