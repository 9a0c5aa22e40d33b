"""Search at scale: the vector index (``trainers/search/vector_index.py``) — exact kinds return brute
force's top k with its tie rule, approximate kinds keep a stated recall on a clustered set, save/load round trips
through an atomic write, ``add`` grows, and recall@k is what it says."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from retr.common.errors import UserError
from retr.trainers.search.vector_index import InnerProductIndex, index_recall, ivf_size_error, recall_at_k

pytestmark = pytest.mark.numerical


def _faiss_installed() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


needs_faiss = pytest.mark.skipif(not _faiss_installed(), reason="faiss-cpu is not installed (pip install faiss-cpu)")
BACKENDS = [False, pytest.param(True, marks=needs_faiss)]


def _brute_force(vectors: np.ndarray, ids: np.ndarray, queries: np.ndarray, k: int):
    """float64 scores, best first, equal scores to the lower id: the rule every exact search keeps."""
    scores = queries.astype(np.float64) @ vectors.astype(np.float64).T
    order = np.stack([np.lexsort((ids, -row))[:k] for row in scores])
    return np.take_along_axis(scores, order, 1), ids[order]


def _clustered(n_per=100, clusters=20, dim=32, seed=0):
    """Unit vectors in ``clusters`` tight groups, and 100 queries near gallery items (as a caption near its
    image): each query's top 10 lies in its own group, the structure approximate indexes rely on."""
    g = torch.Generator().manual_seed(seed)
    norm = torch.nn.functional.normalize
    centres = norm(torch.randn(clusters, dim, generator=g), dim=1)
    x = norm(centres.repeat_interleave(n_per, 0) + 0.15 * torch.randn(clusters * n_per, dim, generator=g), dim=1)
    return x, norm(x[::clusters] + 0.05 * torch.randn(len(x) // clusters, dim, generator=g), dim=1)


@pytest.mark.parametrize("use_faiss", BACKENDS)
def test_exact_search_is_brute_force_with_ties_to_the_lower_id(use_faiss):
    rng = np.random.default_rng(0)
    # small integers: every inner product is exact in float32 whatever the summation order, so ties are real
    # ties in every backend, and many of them straddle the k-th place
    vectors = rng.integers(-2, 3, size=(700, 6)).astype(np.float32)
    ids = rng.permutation(5000)[:700]                              # ids in no relation to the rows
    queries = rng.integers(-2, 3, size=(40, 6)).astype(np.float32)
    index = InnerProductIndex(vectors, ids, use_faiss=use_faiss, block=128)
    assert index.backend == ("faiss" if use_faiss else "matmul") and len(index) == 700
    for k in (1, 7, 50):
        scores, found = index.search(queries, k)
        want_scores, want = _brute_force(vectors, ids, queries, k)
        assert found.shape == (40, k) and np.array_equal(found, want) and np.array_equal(scores, want_scores)
        kth = want_scores[:, -1:]
        assert ((queries @ vectors.T == kth).sum(1) > (want_scores == kth).sum(1)).any()  # ties cut at k
    # random unit vectors: the same top k as float64 brute force where no two of the top 11 scores are within
    # 1e-5 (float32 inner products of 24-d unit vectors are within ~1e-6 of float64, so none can swap)
    x = torch.nn.functional.normalize(torch.randn(3000, 24, generator=torch.Generator().manual_seed(1)), dim=1)
    q = x[:20].numpy() + 0.3 * rng.standard_normal((20, 24)).astype(np.float32)
    want_scores, want = _brute_force(x.numpy(), np.arange(3000), q, 11)
    assert np.diff(want_scores, axis=1).max() < -1e-5
    assert np.array_equal(InnerProductIndex(x, use_faiss=use_faiss).search(q, 10)[1], want[:, :10])


@needs_faiss
def test_approximate_indexes_keep_their_recall_on_a_clustered_set():
    x, q = _clustered()
    exact = InnerProductIndex(x)
    # nprobe 4 of 45 lists: a group of 100 points falls in a few k-means lists, so 4 probes hold a query's top 10
    # (measured 0.997; 1 probe 0.748, which shows the setting reaches faiss)
    ivf = InnerProductIndex(x, kind="ivf", nprobe=4)
    assert ivf.settings == {"kind": "ivf", "backend": "faiss", "nlist": 45, "nprobe": 4}
    assert index_recall(ivf, exact, q)[10] >= 0.95
    one_list = InnerProductIndex(x, kind="ivf", nprobe=1)
    assert index_recall(one_list, exact, q)[10] < 0.9
    # one list of ~45 items cannot hold 500: the rest is id -1, score -inf, and never a candidate
    scores, found = one_list.search(q[0], 500)
    assert (found[0] == -1).any() and np.isinf(scores[0][found[0] == -1]).all()
    assert (one_list.candidates(q[0], 500) >= 0).all()
    # scanning every list is exhaustive: recall 1 exactly
    assert index_recall(InnerProductIndex(x, kind="ivf", nprobe=45), exact, q) == {1: 1.0, 5: 1.0, 10: 1.0}
    # a small graph (m 8, ef_search 16) over 2,000 points still walks into the query's group (measured 0.989)
    hnsw = InnerProductIndex(x, kind="hnsw", m=8, ef_search=16)
    assert hnsw.settings["ef_search"] == 16 and index_recall(hnsw, exact, q)[10] >= 0.95


@pytest.mark.parametrize("kind,use_faiss", [("exact", False), pytest.param("exact", True, marks=needs_faiss),
                                            pytest.param("ivf", True, marks=needs_faiss),
                                            pytest.param("hnsw", True, marks=needs_faiss)])
def test_save_load_round_trip_and_add_grows(tmp_path, kind, use_faiss):
    x, q = _clustered()
    index = InnerProductIndex(x[:1500], np.arange(1500) * 3, use_faiss=use_faiss, kind=kind, nprobe=5)
    index.add(x[1500:])                                            # ids continue from len(index): 1500…1999
    assert len(index) == 2000
    scores, found = index.search(x[1990], 1)
    assert found[0, 0] == 1990 and scores[0, 0] == pytest.approx(1.0, abs=1e-5)
    path = tmp_path / "sub" / "gallery.index"
    index.save(path)
    assert path.is_file() and not list(path.parent.glob("*.partial"))
    again = InnerProductIndex.load(path)
    assert (again.kind, again.backend, len(again), again.settings) == (kind, index.backend, 2000, index.settings)
    for got, want in zip(again.search(q, 10), index.search(q, 10)):
        assert np.array_equal(got, want)
    again.add(x[:3], [7, 8, 9])                                    # a loaded index grows too
    assert len(again) == 2003 and set(again.search(x[0], 2)[1][0]) == {0, 7}


@needs_faiss
def test_save_is_atomic(tmp_path, monkeypatch):
    import faiss

    path = tmp_path / "gallery.index"
    InnerProductIndex(torch.eye(4)).save(path)
    before = path.read_bytes()

    def broken(index, name):                                      # a writer killed half way
        open(name, "wb").write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(faiss, "write_index", broken)
    with pytest.raises(KeyboardInterrupt):
        InnerProductIndex(torch.ones(9, 4)).save(path)
    assert path.read_bytes() == before and not list(tmp_path.glob("*.partial"))
    assert len(InnerProductIndex.load(path)) == 4


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(UserError, match="one of exact, ivf, hnsw"):
        InnerProductIndex(torch.eye(3), kind="lsh")
    with pytest.raises(UserError, match="use_faiss=False"):
        InnerProductIndex(torch.eye(3), kind="hnsw", use_faiss=False)
    with pytest.raises(UserError, match="size 4 cannot join an index of size 3"):
        InnerProductIndex(torch.eye(3)).add(torch.eye(4))
    with pytest.raises(UserError, match="2 ids given for 3 vectors"):
        InnerProductIndex(torch.eye(3), [1, 2])
    (tmp_path / "notes.txt").write_text("not an index")
    with pytest.raises(UserError, match="not an index retr wrote|no index"):
        InnerProductIndex.load(tmp_path / "notes.txt")
    if _faiss_installed():
        with pytest.raises(UserError, match="10 lists needs at least 390 vectors .*there are 3"):
            InnerProductIndex(torch.eye(3), kind="ivf", nlist=10)


@needs_faiss
def test_an_ivf_index_too_small_to_train_is_refused_before_faiss_warns(capfd):
    """faiss's k-means prints ``WARNING clustering 16 points to 1 centroids …`` on the process's stderr (past
    Python) below 39 points per list: retr refuses such an index in its own one line instead, and builds one at
    exactly 39 per list without a word from faiss."""
    x, _ = _clustered(n_per=8, clusters=2, dim=8)                 # 16 vectors
    with pytest.raises(UserError, match=r"^an ivf index of 1 list needs at least 39 vectors .*there are 16; use an "
                                        r"exact index"):
        InnerProductIndex(x, kind="ivf")
    with pytest.raises(UserError, match="2 lists needs at least 78 vectors"):
        InnerProductIndex(torch.cat([x] * 4), kind="ivf", nlist=2)
    assert ivf_size_error(16) is not None and ivf_size_error(39) is None and ivf_size_error(77, 2) is not None
    x, _ = _clustered(n_per=39, clusters=2, dim=8)                # 78 vectors: default nlist 2, 39 per list
    index = InnerProductIndex(x, kind="ivf")
    assert index.settings["nlist"] == 2 and len(index) == 78
    assert "WARNING" not in capfd.readouterr().err


def test_recall_at_k_counts_the_shared_items():
    truth = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    found = np.array([[2, 1, 9, 4], [9, 9, 9, 5]])
    assert recall_at_k(found, truth, 1) == 0.0                     # neither query found its best item first
    assert recall_at_k(found, truth, 2) == 0.5                     # {1, 2} both; {5, 6} vs {9}: none
    assert recall_at_k(found, truth, 4) == pytest.approx((3 / 4 + 1 / 4) / 2)
    x, q = _clustered()
    assert index_recall(InnerProductIndex(x), InnerProductIndex(x, use_faiss=False), q) == {1: 1.0, 5: 1.0, 10: 1.0}
