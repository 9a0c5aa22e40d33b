"""Blockwise similarity matrices, ensembles, and the float64 refinement of near-ties."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from retr.trainers.data.splits import SplitData, pad_tokens
from retr.trainers.models import create_model
from retr.trainers.models.base import MatchingModel
from retr.trainers.evaluation.metrics import i2t_ranks, retrieval_metrics, t2i_ranks
from retr.trainers.evaluation.similarity import (Scorer, SplitEmbeddings, caption_sources, combined_matrix, rank_deciding_pairs,
                                      similarity_matrix, with_shared_captions)
from retr.store.vocab import Vocabulary
from tests.conftest import in_memory_features




@pytest.mark.parametrize("name,kwargs", [("scan", {"direction": "t2i"}), ("scan", {"direction": "i2t", "agg": "avg"}),
                                         ("vsepp", {})])
def test_blockwise_matrix_equals_one_block(name, kwargs):
    torch.manual_seed(0)
    vocab = Vocabulary(["a", "b", "c", "d"])
    rng = np.random.default_rng(0)
    n = 7
    captions = [" ".join(rng.choice(["a", "b", "c", "d"], size=int(rng.integers(1, 6)))) for _ in range(n * 2)]
    owner = np.arange(n * 2) // 2
    data = SplitData([f"i{k}" for k in range(n)], captions, owner, [vocab.encode(c) for c in captions])
    feats = in_memory_features(rng.standard_normal((n, 5, 6)).astype(np.float16), rng.integers(1, 6, size=n))
    model = create_model(name, vocab_size=len(vocab), img_dim=6, embed_size=8, word_dim=4, **kwargs)
    whole = similarity_matrix(model, data, feats, precision="float64", encode_batch=3, image_block=100,
                              pair_budget=10_000, quiet=True)
    blocks = similarity_matrix(model, data, feats, precision="float64", encode_batch=3, image_block=1,
                               pair_budget=2, quiet=True)
    fast = similarity_matrix(model, data, feats, precision="float32", encode_batch=3, image_block=2,
                             pair_budget=4, quiet=True)
    assert whole.dtype == np.float64 and whole.shape == (n, 2 * n)
    np.testing.assert_allclose(blocks, whole, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(fast, whole, rtol=1e-5, atol=1e-6)
    stats = {}
    refined = similarity_matrix(model, data, feats, precision="refined", encode_batch=3, image_block=2,
                                pair_budget=4, quiet=True, stats=stats)
    # 7 × 14 lies inside the 32 × 32 probe block: every pair was rescored in float64
    assert stats["rescored_pairs"] == 7 * 14
    np.testing.assert_allclose(refined, whole, rtol=1e-12, atol=1e-12)
    # manifest order on both axes: caption m's column equals scoring it alone
    model.eval()
    with torch.no_grad():
        f, mask = feats.get([3])
        tokens, lengths = pad_tokens([data.tokens[9]])
        img = {k: v.double() if v.is_floating_point() else v for k, v in model.encode_images(f, mask).items()}
        cap = {k: v.double() if v.is_floating_point() else v for k, v in model.encode_captions(tokens, lengths).items()}
        assert model.score(img, cap, dtype=torch.float64).item() == pytest.approx(whole[3, 9], rel=1e-5)  # float32 encoders, other batch


def test_rank_deciding_pairs_are_those_near_the_true_or_best_true_score():
    sims = np.array([[0.50, 0.10, 0.90, 0.40],
                     [0.50 + 1e-7, 0.30, 0.20, 0.60],
                     [0.70, 0.30 + 5e-7, 0.60 - 2e-7, 0.95]])
    caption_image = np.array([0, 1, 1, 2])             # true scores 0.50, 0.30, 0.20, 0.95; best: 0.5, 0.3, 0.95
    near = rank_deciding_pairs(sims, caption_image, margin=1e-6)
    want = np.zeros(sims.shape, dtype=bool)
    want[0, 0] = want[1, 0] = True                     # caption 0: image 1 is 1e-7 above the true 0.50
    want[1, 1] = want[2, 1] = True                     # caption 1: image 2 is 5e-7 above the true 0.30
    want[1, 2] = True                                  # caption 2's true pair itself
    want[2, 3] = True
    want[0, 0] = want[1, 1] = True                     # each image's best true pair
    np.testing.assert_array_equal(near, want)
    assert rank_deciding_pairs(sims, caption_image, margin=0.5).sum() > want.sum()


class _TableModel(MatchingModel):
    """A "model" whose score is a fixed float64 table; its float32 scores carry a chosen error pattern."""

    def __init__(self, table: np.ndarray, error: np.ndarray):
        super().__init__()
        self.table, self.error = table, error
        self.calls: list[torch.dtype] = []

    def score(self, images, captions, dtype=None):
        rows = images["id"][:, 0].long().numpy()
        cols = captions["id"][:, 0].long().numpy()
        self.calls.append(dtype)
        values = self.table[np.ix_(rows, cols)]
        if dtype == torch.float32:                     # float32 scores are float32 numbers, as a model's are
            values = (values + self.error[np.ix_(rows, cols)]).astype(np.float32)
        return torch.from_numpy(values)


def _table_scorer(table: np.ndarray, error: np.ndarray, block: int = 16) -> Scorer:
    n, m = table.shape
    ids = torch.arange(m, dtype=torch.float32).view(m, 1)
    blocks = [(np.arange(s, min(s + block, m)), {"id": ids[s:s + block]}) for s in range(0, m, block)]
    embeddings = SplitEmbeddings({"id": torch.arange(n, dtype=torch.float32).view(n, 1)}, blocks)
    return Scorer(_TableModel(table, error), embeddings)


def _ranks(sims: np.ndarray, caption_image: np.ndarray):
    return i2t_ranks(sims, caption_image), t2i_ranks(sims, caption_image)


def _near_tied_table(n: int, m: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.round(rng.random((n, m)), 2) + 1e-6 * rng.random((n, m))   # ~50 values per 0.01: many near-ties


def test_refined_ranks_equal_float64_even_when_the_first_estimate_underestimates_the_error():
    n, m = 60, 300
    table = _near_tied_table(n, m, seed=1)
    owner = np.arange(m) // 5
    rng = np.random.default_rng(2)
    error = 3e-6 * rng.standard_normal((n, m))
    error[:32, :32] *= 1e-3                    # the probe block …
    error[owner, np.arange(m)] *= 1e-3         # … and the true pairs (the first estimate) see almost no error
    scorer = _table_scorer(table, error)
    fast = combined_matrix([scorer], "float32")
    assert any((a != b).any() for a, b in zip(_ranks(fast, owner), _ranks(table, owner)))   # float32 alone errs
    stats = {}
    refined = combined_matrix([scorer], "refined", owner, stats=stats)
    for got, want in zip(_ranks(refined, owner), _ranks(table, owner)):
        np.testing.assert_array_equal(got, want)
    assert retrieval_metrics(refined, owner) == retrieval_metrics(table, owner)
    assert stats["rounds"] >= 2 and stats["margin"] >= 2 * stats["max_float32_error"]
    assert 0 < stats["rescored_pairs"] < n * m / 4
    rescored = refined == table
    np.testing.assert_array_equal(refined[~rescored], fast[~rescored])   # the rest keep their float32 values
    assert rescored[owner, np.arange(m)].all()                              # every true pair is exact


def test_refined_holds_float32_estimates_and_makes_the_float64_matrix_once_the_embeddings_are_gone(monkeypatch):
    """refined keeps the matrix as float32 while the embeddings are held (COCO 5K: 0.47 GiB, not 0.93) and the
    rescored pairs' float64 scores beside it; with release the scorers' embeddings go before the float64 matrix
    is made, and its ranks are the float64 table's."""
    import retr.trainers.evaluation.similarity as similarity

    n, m = 60, 300
    table = _near_tied_table(n, m, seed=1)
    owner = np.arange(m) // 5
    error = 3e-6 * np.random.default_rng(2).standard_normal((n, m))
    scorer = _table_scorer(table, error)
    kept, written = [], []
    real_matrix, real_write = Scorer.matrix, similarity.ExactScores.write
    monkeypatch.setattr(Scorer, "matrix", lambda self, *a, **k: kept.append(k["out_dtype"]) or real_matrix(self, *a, **k))
    monkeypatch.setattr(similarity.ExactScores, "write",
                        lambda self, sims: written.append((sims.dtype, scorer.embeddings)) or real_write(self, sims))
    refined = combined_matrix([scorer], "refined", owner, release=True)
    assert kept == [np.float32] and written == [(np.float64, None)] and refined.dtype == np.float64
    for got, want in zip(_ranks(refined, owner), _ranks(table, owner)):
        np.testing.assert_array_equal(got, want)
    kept.clear()
    combined_matrix([_table_scorer(table, error)], "float32")
    assert kept == [np.float64]                            # float32 precision: its matrix as before


def test_refined_ensemble_ranks_the_average_of_float64_matrices():
    n, m = 40, 200
    owner = np.arange(m) // 5
    tables = [_near_tied_table(n, m, seed=s) for s in (3, 4)]
    rng = np.random.default_rng(5)
    scorers = [_table_scorer(t, 2e-6 * rng.standard_normal((n, m))) for t in tables]
    refined = combined_matrix(scorers, "refined", owner)
    mean = (tables[0] + tables[1]) / 2
    for got, want in zip(_ranks(refined, owner), _ranks(mean, owner)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(combined_matrix(scorers, "float64"), mean, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="caption_image"):
        combined_matrix(scorers, "refined")


def test_refine_gives_up_loudly_when_the_margin_stops_growing(monkeypatch):
    import retr.trainers.evaluation.similarity as similarity
    from retr.common.errors import UserError
    monkeypatch.setattr(similarity, "MAX_ROUNDS", 1)
    n, m = 60, 300
    table = _near_tied_table(n, m, seed=1)
    error = 3e-6 * np.random.default_rng(2).standard_normal((n, m))
    error[:32, :32] *= 1e-3                    # the first estimate (probe block, true pairs) too small
    error[np.arange(m) // 5, np.arange(m)] *= 1e-3
    with pytest.raises(UserError, match="--precision float64"):
        combined_matrix([_table_scorer(table, error)], "refined", np.arange(m) // 5)


MODELS = {
    "scan-t2i": ("scan", dict(vocab_size=30, img_dim=8, embed_size=8, word_dim=5, direction="t2i"), (6, 8)),
    "scan-i2t": ("scan", dict(vocab_size=30, img_dim=8, embed_size=8, word_dim=5, direction="i2t", agg="avg"),
                 (6, 8)),
    "vsepp": ("vsepp", dict(vocab_size=30, img_dim=8, embed_size=8, word_dim=5), (6, 8)),
    "sman": ("sman", dict(vocab_size=30, img_dim=12, embed_size=8, word_dim=8, dropout=0.0), (49, 12)),
    "seam": ("seam", dict(vocab_size=30, img_dim=10, text_encoder="c", embed_size=8, word_dim=6, hops=2,
                          attention_hidden=4, conv_filters=3, gru_size=5), (10, 10)),
    "jgcar": ("jgcar", dict(vocab_size=30, img_dim=8, embed_size=6, word_dim=5, hidden_size=7, num_regions=9,
                            max_words=8, dropout=0.0, num_negatives=3), (9, 8)),
    "smfea": ("smfea", dict(vocab_size=30, num_entities=5, num_relations=4, num_concepts=3, img_dim=8,
                            embed_size=8, word_dim=4, tree_hidden=4, num_regions=6), (6, 8)),
}


@pytest.mark.parametrize("case", sorted(MODELS))
def test_listed_pairs_and_refined_ranks_match_the_float64_matrix(case):
    """Scorer.pairs (captions gathered across blocks, re-padded) gives each model's float64 matrix entries."""
    name, args, (k, dim) = MODELS[case]
    torch.manual_seed(0)
    model = create_model(name, **args).eval()
    rng = np.random.default_rng(1)
    n, per = 40, 2                                   # 40 images × 80 captions: beyond the 32 × 32 probe
    # short random captions: several are identical (the same token ids), so exact ties occur
    tokens = [[1] + [int(t) for t in rng.integers(4, 30, size=int(rng.integers(1, 7)))] + [2] for _ in range(n * per)]
    assert len({tuple(t) for t in tokens}) < len(tokens)
    data = SplitData([f"i{j}" for j in range(n)], ["x"] * (n * per), np.arange(n * per) // per, tokens)
    feats = in_memory_features(rng.standard_normal((n, k, dim)).astype(np.float16), np.full(n, k))
    full = similarity_matrix(model, data, feats, precision="float64", encode_batch=16, quiet=True)
    scorer = Scorer(model, SplitEmbeddings.encode(model, data, feats, batch_size=16, quiet=True))
    rows, cols = rng.integers(0, n, 60), rng.integers(0, n * per, 60)
    # float64 throughout (a float64 copy of the model scores): the pairs agree with the matrix to rounding, one
    # image at a time (the CPU's way) and caption block by caption block through pair_score (the GPU's way)
    if not model.pair_score_is_aligned:
        with pytest.raises(ValueError, match="strategy aligned needs a model"):
            scorer.pairs(rows, cols, "aligned")
    for strategy in ("image", "block") + (("aligned",) if model.pair_score_is_aligned else ()):
        np.testing.assert_allclose(scorer.pairs(rows, cols, strategy), full[rows, cols], rtol=1e-9, atol=1e-12)
        refined = combined_matrix([scorer], "refined", data.caption_image, pair_strategy=strategy)
        for got, want in zip(_ranks(refined, data.caption_image), _ranks(full, data.caption_image)):
            np.testing.assert_array_equal(got, want)
    source = caption_sources(tokens)
    for sims in (full, refined, combined_matrix([scorer], "float32")):     # identical captions: identical columns
        np.testing.assert_array_equal(sims, sims[:, source])


# PyTorch's CPU kernels compute exp, sigmoid, tanh … in vector registers, and the last few elements of a call (or
# of a thread's share of it) in scalar code, which may round them an ulp otherwise; where a pair's values fall in a
# call depends on its chunk, so its score may differ by the ulps a few such functions in a row give, never more
# (float64: 2.2e-16 each). Everything else is a pair's own arithmetic: its products (batched per pair, row_linear)
# and its softmax rows (in place, over any axis) do not depend on the rows beside them.
CHUNK_RTOL = 1e-14


@pytest.mark.parametrize("case", sorted(MODELS))
def test_every_model_scores_its_pairs_the_same_in_any_chunks(case):
    """Every model's listed pairs in chunks of 1, 7 and 23 pairs through pair_score (models that score aligned
    pairs), and one image at a time in chunks that hold whole images (a call cut in parts has other GEMM shapes),
    are the unchunked scores but for elementwise functions' rounding (CHUNK_RTOL), with any number of threads."""
    name, args, (k, dim) = MODELS[case]
    torch.manual_seed(0)
    model = create_model(name, **args).eval()
    rng = np.random.default_rng(3)
    n, per = 30, 2
    tokens = [[1] + [int(t) for t in rng.integers(4, 30, size=int(rng.integers(1, 7)))] + [2] for _ in range(n * per)]
    data = SplitData([f"i{j}" for j in range(n)], ["x"] * (n * per), np.arange(n * per) // per, tokens)
    feats = in_memory_features(rng.standard_normal((n, k, dim)).astype(np.float16), np.full(n, k))
    embeddings = SplitEmbeddings.encode(model, data, feats, batch_size=16, quiet=True)
    rows, cols = rng.integers(0, n, 120), rng.integers(0, n * per, 120)
    largest_image = int(np.bincount(np.unique(rows * (n * per) + embeddings.sources[cols]) // (n * per)).max())
    chunks = {"image": (largest_image, largest_image + 3)}
    if model.pair_score_is_aligned:
        chunks["aligned"] = (1, 7, 23)
    for strategy, steps in chunks.items():
        whole = Scorer(model, embeddings, pair_memory=1 << 40).pairs(rows, cols, strategy)
        for pairs_per_chunk in steps:
            scorer = Scorer(model, embeddings, pair_memory=1 << 40)
            scorer.pair_step = lambda shapes, step=pairs_per_chunk: step
            np.testing.assert_allclose(scorer.pairs(rows, cols, strategy), whole, rtol=CHUNK_RTOL, atol=0)
            assert max(scorer.pair_chunks) == pairs_per_chunk


def test_row_linear_gives_each_row_the_same_bits_in_any_batch():
    """A GEMM's rounding depends on its row count (BLAS picks the kernel by it: 1 row, a few, many); row_linear's
    per-row products do not, to the bit, and equal F.linear to rounding (float64: a sum of 64 products)."""
    from retr.trainers.models.layers import row_linear

    torch.manual_seed(0)
    x, weight, bias = (torch.randn(97, 64, dtype=torch.float64), torch.randn(48, 64, dtype=torch.float64),
                       torch.randn(48, dtype=torch.float64))
    for b in (bias, None):
        whole = row_linear(x, weight, b)
        np.testing.assert_allclose(whole, torch.nn.functional.linear(x, weight, b), rtol=0, atol=1e-12)
        for step in (1, 2, 7, 33):
            parts = torch.cat([row_linear(x[s:s + step], weight, b) for s in range(0, len(x), step)])
            assert torch.equal(parts, whole)


def _attributes(model: torch.nn.Module) -> dict:
    """``vars`` of every submodule: plain values as they are, other objects by identity."""
    plain = (bool, int, float, str, tuple, torch.dtype, type(None))
    return {(path, k): (v if isinstance(v, plain) else id(v))
            for path, module in model.named_modules() for k, v in vars(module).items()}


@pytest.mark.parametrize("case", sorted(MODELS))
def test_evaluation_at_every_precision_leaves_the_model_as_it_was(case):
    """The scoring dtype is passed, not set: after float64, refined and float32 evaluation (and two-step, for
    models with a global stage) the model has the same attributes, parameter dtypes and values, and scores the
    same numbers as before."""
    from retr.trainers.evaluation.two_step import two_step_split

    name, args, (k, dim) = MODELS[case]
    torch.manual_seed(0)
    model = create_model(name, **args).eval()
    rng = np.random.default_rng(2)
    n, per = 6, 2
    tokens = [[1] + [int(t) for t in rng.integers(4, 30, size=int(rng.integers(1, 7)))] + [2] for _ in range(n * per)]
    data = SplitData([f"i{j}" for j in range(n)], ["x"] * (n * per), np.arange(n * per) // per, tokens)
    feats = in_memory_features(rng.standard_normal((n, k, dim)).astype(np.float16), np.full(n, k))
    attributes = _attributes(model)
    state = {key: (v.dtype, v.clone()) for key, v in model.state_dict().items()}
    first = {p: similarity_matrix(model, data, feats, precision=p, encode_batch=4, quiet=True)
             for p in ("float64", "refined", "float32")}
    if model.has_global_stage:
        two_step_split(model, data, feats, shortlist=3, precision="float64", full=True)
    assert _attributes(model) == attributes
    assert {key: v.dtype for key, v in model.state_dict().items()} == {key: d for key, (d, _) in state.items()}
    assert all(torch.equal(v, state[key][1]) for key, v in model.state_dict().items())
    for precision, sims in first.items():           # nothing left behind: the same numbers again, to the bit
        np.testing.assert_array_equal(similarity_matrix(model, data, feats, precision=precision, encode_batch=4,
                                                        quiet=True), sims)


def test_caption_sources_and_shared_pairs():
    source = caption_sources([[1, 5, 2], [1, 6, 2], [1, 5, 2], [1, 7, 2], [1, 6, 2], [1, 5, 2]])
    np.testing.assert_array_equal(source, [0, 1, 0, 3, 1, 0])
    rows, cols = with_shared_captions(np.array([4, 1, 4]), np.array([2, 3, 4]), source)
    assert sorted(zip(rows.tolist(), cols.tolist())) == [(1, 3), (4, 0), (4, 1), (4, 2), (4, 4), (4, 5)]
    rows, cols = with_shared_captions(np.array([0]), np.array([1]), np.arange(3))
    assert (rows.tolist(), cols.tolist()) == ([0], [1])


def test_identical_captions_tie_exactly_and_count_against_the_query():
    """Image 0's only caption reappears under image 1: image 0's i2t rank counts that exact tie (rank ≥ 1)."""
    torch.manual_seed(0)
    model = create_model("scan", vocab_size=30, img_dim=8, embed_size=8, word_dim=5, direction="t2i").eval()
    # encoded in blocks of 2 by length, caption 2 would share a block with the longer caption 3 (padding 6, not 4)
    tokens = [[1, 5, 6, 2], [1, 7, 5, 2], [1, 5, 6, 2], [1, 8, 9, 10, 11, 2]]
    data = SplitData(["a", "b"], ["x"] * 4, np.array([0, 1, 1, 1]), tokens)
    feats = in_memory_features(np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float16), np.full(2, 4))
    for precision in ("float64", "float32", "refined"):
        sims = similarity_matrix(model, data, feats, precision=precision, encode_batch=2, quiet=True)
        np.testing.assert_array_equal(sims[:, 0], sims[:, 2])
        assert i2t_ranks(sims, data.caption_image)[0] >= 1
    embeddings = SplitEmbeddings.encode(model, data, feats, batch_size=2, quiet=True)
    assert sorted(np.concatenate([idx for idx, _ in embeddings.caption_blocks]).tolist()) == [0, 1, 3]   # once each
    np.testing.assert_array_equal(embeddings.sources, [0, 1, 0, 3])


def test_the_near_tie_search_on_a_device_equals_numpy():
    """rank_deciding_pairs(device=…) — the refinement's search as it runs on a GPU — in torch on the CPU."""
    rng = np.random.default_rng(7)
    n, m = 2100, 40                                   # more than one 1,024-row chunk
    sims = np.round(rng.random((n, m)), 3)
    caption_image = rng.integers(0, n, m)
    for margin in (0.0, 1e-3, 0.05):
        np.testing.assert_array_equal(rank_deciding_pairs(sims, caption_image, margin, device="cpu"),
                                      rank_deciding_pairs(sims, caption_image, margin))


def test_block_sizes_follow_the_device():
    from retr.trainers.evaluation.similarity import CPU_PAIR_BUDGET, GPU_PAIR_BUDGET_MAX, gpu_image_block, gpu_pair_budget
    scorer = _table_scorer(np.zeros((4, 8)), np.zeros((4, 8)))
    assert scorer.block_sizes(torch.float32) == (128, CPU_PAIR_BUDGET)
    assert scorer.block_sizes(torch.float32, 7, 99) == (7, 99)
    gib = 1 << 30
    assert gpu_pair_budget(40 * gib, 10_000) == int(20 * gib / 10_000)       # half the free memory
    assert gpu_pair_budget(1 << 20, 10_000) == CPU_PAIR_BUDGET               # never below the CPU's
    assert gpu_pair_budget(80 * gib, 1) == GPU_PAIR_BUDGET_MAX
    assert gpu_image_block(2_000_000, 128) == 15_625 and gpu_image_block(1000, 128) == 128
    with pytest.raises(ValueError, match="strategy must be one of"):
        scorer.pairs(np.array([0]), np.array([0]), "fast")


def test_gpu_sized_blocks_give_the_cpu_blocks_matrix():
    """One call of every image × a caption block (what GPU block sizes make of COCO 5K) against CPU blocks."""
    torch.manual_seed(0)
    model = create_model("scan", vocab_size=30, img_dim=8, embed_size=8, word_dim=5, direction="t2i").eval()
    rng = np.random.default_rng(3)
    n = 300
    tokens = [[1] + [int(t) for t in rng.integers(4, 30, size=int(rng.integers(1, 7)))] + [2] for _ in range(2 * n)]
    data = SplitData([f"i{j}" for j in range(n)], ["x"] * (2 * n), np.arange(2 * n) // 2, tokens)
    feats = in_memory_features(rng.standard_normal((n, 6, 8)).astype(np.float16), np.full(n, 6))
    scorer = Scorer(model, SplitEmbeddings.encode(model, data, feats, batch_size=64, quiet=True))
    for dtype in (torch.float64, torch.float32):
        cpu = scorer.matrix(dtype)
        gpu = scorer.matrix(dtype, image_block=n, pair_budget=1 << 22)
        tolerance = 1e-12 if dtype == torch.float64 else 1e-6
        np.testing.assert_allclose(gpu, cpu, rtol=0, atol=tolerance)


def test_gpu_block_sizes_come_from_the_measured_memory_per_pair(monkeypatch):
    """Scorer.block_sizes' CUDA branch with the device's answers stubbed: the budget is half the free memory at
    the measured bytes per pair, and the image block fills it against the widest caption block."""
    import retr.trainers.evaluation.similarity as similarity
    scorer = _table_scorer(np.zeros((300, 40)), np.zeros((300, 40)), block=16)
    seen = {}

    def measured(score, images, captions):
        seen["probe"] = (images["id"].shape[0], captions["id"].shape[0])
        score(images, captions)
        return 1000.0
    monkeypatch.setattr(similarity.Scorer, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(similarity, "bytes_per_pair", measured)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 16 << 30))
    budget = int(0.5 * (8 << 30) / 1000)
    assert scorer.block_sizes(torch.float32) == (budget // 16, budget)
    assert seen["probe"] == (64, 8)                      # 64 images × the last caption block (40 = 2·16 + 8)
    assert scorer.block_sizes(torch.float32, pair_budget=1 << 16) == (4096, 1 << 16)


# ------------------------------------------------------------------------------------------------ memory budgets

def _scan_scorer(n: int = 50, per: int = 2, pair_memory: int | None = None, seed: int = 4):
    torch.manual_seed(0)
    model = create_model("scan", vocab_size=30, img_dim=8, embed_size=8, word_dim=5, direction="t2i").eval()
    rng = np.random.default_rng(seed)
    tokens = [[1] + [int(t) for t in rng.integers(4, 30, size=int(rng.integers(1, 9)))] + [2]
              for _ in range(n * per)]
    data = SplitData([f"i{j}" for j in range(n)], ["x"] * (n * per), np.arange(n * per) // per, tokens)
    feats = in_memory_features(rng.standard_normal((n, 6, 8)).astype(np.float16), np.full(n, 6))
    embeddings = SplitEmbeddings.encode(model, data, feats, batch_size=16, quiet=True)
    return Scorer(model, embeddings, pair_memory=pair_memory), data


def test_listed_pairs_are_scored_in_chunks_the_memory_budget_holds(monkeypatch):
    """A pair costs its image's and caption's rows in float64 — once gathered by the scorer, twice more inside
    SCAN's pair_score — so 6 regions × 8 dims + the mask, and 10 words (the longest listed caption) × 8 + the
    mask: 3 · (6·8·8 + 6 + 10·8·8 + 10) = 3 · 1,040 bytes. The chunks are the budget's, every pair_score call
    stays within them, and the scores do not depend on the chunks but for the rounding of elementwise functions
    (test_every_model_scores_its_pairs_the_same_in_any_chunks says why it is at most a few ulps)."""
    reference, _ = _scan_scorer(pair_memory=1 << 40)
    rng = np.random.default_rng(5)
    rows, cols = rng.integers(0, 50, 400), rng.integers(0, 100, 400)
    whole = reference.pairs(rows, cols, "aligned")
    distinct = len(np.unique(rows * 100 + reference.embeddings.sources[cols]))
    assert reference.pair_chunks == [distinct]
    shapes = reference._caption_shapes(np.unique(reference.embeddings.sources[cols]))
    assert shapes["words"] == (10, 8) and shapes["mask"] == (10,)
    for budget in (3 * 1040 * 200, 3 * 1040 * 37, 3 * 1040 * 37 + 3 * 1040 - 1, 3 * 1040, 1):
        scorer, _ = _scan_scorer(pair_memory=budget)
        step = max(1, budget // (3 * 1040))
        assert scorer.pair_step(shapes) == step
        calls = []
        real = scorer.model.pair_score
        monkeypatch.setattr(scorer.model, "pair_score", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
        got = scorer.pairs(rows, cols, "aligned")
        assert scorer.pair_chunks == [step] * (distinct // step) + ([distinct % step] if distinct % step else [])
        assert max(calls) <= step
        np.testing.assert_allclose(got, whole, rtol=CHUNK_RTOL, atol=0)
        # a score call per image, or per caption block: a chunk holds whole calls, and while the budget holds the
        # largest call the scores are the unchunked ones to the bit; a call cut in parts may round otherwise (its
        # GEMMs have other shapes), by an ulp
        for strategy, group in (("image", rows), ("block", reference._caption_block[cols])):
            largest = max(len(np.unique((rows * 100 + cols)[group == g])) for g in np.unique(group))
            chunked, unchunked = scorer.pairs(rows, cols, strategy), reference.pairs(rows, cols, strategy)
            if step >= largest:
                np.testing.assert_array_equal(chunked, unchunked)
            else:
                np.testing.assert_allclose(chunked, unchunked, rtol=1e-15, atol=0)


def test_the_pair_budget_is_a_share_of_the_memory_available_now(monkeypatch):
    import retr.common.memory as memory
    import retr.trainers.evaluation.similarity as similarity

    gib = 1 << 30
    monkeypatch.setattr(similarity, "available_bytes", lambda device: 1 * gib)
    assert similarity.pair_memory_budget(torch.device("cpu")) == gib // 4
    monkeypatch.setattr(similarity, "available_bytes", lambda device: 16 * gib)
    assert similarity.pair_memory_budget(torch.device("cpu")) == similarity.CPU_PAIR_MEMORY_MAX   # no faster above
    assert similarity.pair_memory_budget(torch.device("cuda")) == 4 * gib                         # a GPU's share
    seen = []
    monkeypatch.setattr(similarity, "available_bytes", lambda device: seen.append(device) or 2 * gib)
    scorer, data = _scan_scorer()
    scorer.pairs(np.array([0, 1]), np.array([0, 3]), "aligned")
    assert seen == [torch.device("cpu")]                   # read when the pairs are scored
    monkeypatch.setattr(memory, "host_memory_available", lambda: 3 * gib)
    assert memory.available_bytes(torch.device("cpu")) == 3 * gib           # the host's, as preloading reads it
    monkeypatch.setattr(memory, "host_memory_available", lambda: None)
    assert memory.available_bytes(torch.device("cpu")) == 0                 # unknown …
    monkeypatch.setattr(similarity, "available_bytes", memory.available_bytes)
    assert similarity.pair_memory_budget(torch.device("cpu")) == similarity.PAIR_MEMORY_MIN   # … the floor


def test_refinement_searches_the_matrix_a_block_of_rows_at_a_time(monkeypatch):
    """No [N, M] mask: the rank-deciding pairs are looked for REFINE_ROWS rows at a time, and the pairs rescored
    are kept as keys; the refined matrix is the one the whole-matrix search gave."""
    import retr.trainers.evaluation.similarity as similarity

    scorer, data = _scan_scorer(n=50)
    monkeypatch.setattr(similarity, "REFINE_ROWS", 16)
    searched = []
    real = similarity.rank_deciding_pairs
    monkeypatch.setattr(similarity, "rank_deciding_pairs",
                        lambda *a, **k: searched.append(a[4]) or real(*a, **k))
    stats = {}
    refined = combined_matrix([scorer], "refined", data.caption_image, stats=stats)
    assert {(s.start, s.stop) for s in searched} == {(0, 16), (16, 32), (32, 48), (48, 64)}
    wide = combined_matrix([scorer], "float64", data.caption_image)
    for got, want in zip(_ranks(refined, data.caption_image), _ranks(wide, data.caption_image)):
        np.testing.assert_array_equal(got, want)
    assert stats["rescored_pairs"] >= 32 * 32


def test_positive_scores_find_every_pair_near_a_positive_of_its_row_or_column():
    from retr.trainers.evaluation.similarity import PositiveScores

    rng = np.random.default_rng(6)
    sims = np.round(rng.random((70, 90)) * 3 - 1, 3)          # values on a 0.001 grid in [-1, 2]: many near ones
    rows, cols = rng.integers(0, 70, 150), rng.integers(0, 90, 150)
    margin = 0.0015
    near = PositiveScores(sims, rows, cols, margin).near(sims[10:50], 10, margin)
    want = np.zeros((40, 90), dtype=bool)
    for r, c in zip(rows, cols):
        if 10 <= r < 50:
            want[r - 10] |= np.abs(sims[r] - sims[r, c]) <= margin                   # near a positive of its row
        want[:, c] |= np.abs(sims[10:50, c] - sims[r, c]) <= margin              # near a positive of its column
    np.testing.assert_array_equal(near, want)


def test_refined_places_of_extra_positives_are_float64s():
    """Positives beyond the true pairs (ECCV Caption's, CxC's): every one's place in its row and in its column
    is the float64 matrix's once they are given to the refinement; the true pairs alone may leave one off."""
    n, m = 60, 300
    owner = np.arange(m) // 5
    table = _near_tied_table(n, m, seed=7)
    rng = np.random.default_rng(8)
    extra_rows, extra_cols = rng.integers(0, n, 400), rng.integers(0, m, 400)
    error = 4e-6 * rng.standard_normal((n, m))
    error[:32, :32] *= 1e-3
    scorer = _table_scorer(table, error)

    def places(sims):
        return ([(sims[r] >= sims[r, c]).sum() for r, c in zip(extra_rows, extra_cols)],
                [(sims[:, c] >= sims[r, c]).sum() for r, c in zip(extra_rows, extra_cols)])

    assert places(combined_matrix([scorer], "refined", owner)) != places(table)       # the true pairs are not enough
    stats = {}
    refined = combined_matrix([scorer], "refined", owner, stats=stats, positives=(extra_rows, extra_cols))
    assert places(refined) == places(table)
    for got, want in zip(_ranks(refined, owner), _ranks(table, owner)):
        np.testing.assert_array_equal(got, want)
    assert stats["rescored_pairs"] < n * m / 3
