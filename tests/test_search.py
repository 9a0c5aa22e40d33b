"""Search: ``Retriever`` and ``retr-train search`` return eval's scores for the same pairs, report
unknown words, and cache the gallery per checkpoint and data."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from retr.common.errors import UserError
from retr.trainers.runs import checkpoint as ckpt
from retr.trainers.commands import cli
from retr.trainers.data.splits import ImageFeatures
from retr.trainers.search.retrieval import CACHE_DIR, Retriever
from retr.trainers.evaluation.two_step import encode_all, rerank_matrices
from retr.store.features import FeatureSet

TINY = ["--embed-size", "16", "--word-dim", "8", "--batch-size", "16", "--quiet", "--val-images", "10",
        "--device", "cpu", "--epochs", "2", "--lr", "2e-3"]
RUNS = {"vsepp": [], "scan": ["--direction", "t2i"],
        "jgcar": ["--hidden-size", "8", "--num-negatives", "3", "--optimizer", "adam", "--shortlist", "4",
                  "--global-similarity", "cosine", "--num-regions", "4"]}


def _invoke(args):
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def runs(synthetic_data, synthetic_run, tmp_path_factory):
    """(this module's output folder, manifest, features, model → run): the runs are this module's copies, since
    searches write their gallery caches into them."""
    folder = tmp_path_factory.mktemp("search")
    manifest, features = synthetic_data(images=60)
    out = {model: synthetic_run(model, *TINY, *extra, images=60, copy_to=folder / model)
           for model, extra in RUNS.items()}
    return folder, manifest, features, out


def _eval_sims(run, folder):
    path = folder / f"{run.name}-sims.npy"
    _invoke(["eval", run, "--protocol", "f30k-1k", "--allow-size-mismatch", "--precision", "float64",
             "--save-sims", path, "--device", "cpu", "--quiet"])         # the device the search side runs on
    return np.load(path)


@pytest.mark.parametrize("model", ["vsepp", "scan"])
def test_scores_equal_evals_float64_matrix(runs, model):
    folder, manifest, features, run = runs
    sims = _eval_sims(run[model], folder)                          # [images, captions] of the test split
    r = Retriever.from_run(run[model], device="cpu")
    data = r.data
    for image_row in (0, 5):
        [result] = r.image_to_texts([data.image_ids[image_row]], k=7)
        cols = [h.caption_index for h in result.hits]
        assert np.allclose([h.score for h in result.hits], sims[image_row, cols], rtol=0, atol=1e-9)
        assert [h.score for h in result.hits] == sorted((h.score for h in result.hits), reverse=True)
        assert sorted(sims[image_row], reverse=True)[6] == pytest.approx(result.hits[-1].score, abs=1e-9)
        assert all(data.captions[c] == h.caption for c, h in zip(cols, result.hits))
    for caption in (0, 13):
        [result] = r.text_to_images([data.captions[caption]], k=5)
        rows = [data.image_ids.index(h.image_id) for h in result.hits]
        # the query is encoded on its own, not padded in a block of the split: equal to float rounding
        assert np.allclose([h.score for h in result.hits], sims[rows, caption], rtol=0, atol=1e-6)
        assert rows == list(np.argsort(-sims[:, caption], kind="stable")[:5])


def test_two_step_model_ranks_and_scores_as_evals_two_step(runs):
    folder, manifest, features, run = runs
    r = Retriever.from_run(run["jgcar"], device="cpu")
    assert r.two_step and r.model.shortlist == 4
    data = r.data
    feats = ImageFeatures(FeatureSet(features), data.image_ids)
    images, captions = encode_all(r.model, data, feats, torch.device("cpu"), dtype=torch.float64)
    with torch.no_grad():
        g = r.model.global_score(images, captions, dtype=torch.float64)
        i2t, t2i = rerank_matrices(g, lambda ii, cc: r.model.pair_score(images, captions, ii, cc,
                                                                       dtype=torch.float64), 4)
    i2t, t2i = i2t.numpy(), t2i.numpy()
    [result] = r.image_to_texts([data.image_ids[3]], k=4)
    cols = [h.caption_index for h in result.hits]
    assert np.allclose([h.score for h in result.hits], i2t[3, cols], rtol=0, atol=1e-9)
    assert set(cols) == set(np.argsort(-i2t[3])[:4])
    [result] = r.text_to_images([data.captions[8]], k=4)
    rows = [data.image_ids.index(h.image_id) for h in result.hits]
    assert np.allclose([h.score for h in result.hits], t2i[rows, 8], rtol=0, atol=1e-6)


def test_unknown_words_are_reported_and_read_as_unk(runs):
    folder, manifest, features, run = runs
    r = Retriever.from_run(run["vsepp"], device="cpu")
    [result] = r.text_to_images(["a zyzzyva red circle"], k=3)
    assert result.unknown_words == ["zyzzyva"] and len(result.hits) == 3
    [known] = r.text_to_images(["a red circle"], k=3)
    assert known.unknown_words == []


def test_gallery_is_cached_per_checkpoint_and_reused(runs, monkeypatch):
    folder, manifest, features, run = runs
    cache = run["vsepp"] / CACHE_DIR
    Retriever.from_run(run["vsepp"], device="cpu")
    made = sorted(cache.glob("*.pt"))
    assert len(made) == 1
    import retr.trainers.search.retrieval as retrieval

    def no_encoding(*args, **kwargs):
        raise AssertionError("the gallery should come from the cache")
    monkeypatch.setattr(retrieval, "_encode_gallery", no_encoding)
    cached = Retriever.from_run(run["vsepp"], device="cpu")
    monkeypatch.undo()
    fresh = Retriever.from_run(run["vsepp"], device="cpu", cache=False)
    q = ["a small blue square"]
    assert [vars(h) for h in cached.text_to_images(q, 5)[0].hits] == [vars(h) for h in fresh.text_to_images(q, 5)[0].hits]
    Retriever.from_run(run["vsepp"], device="cpu", checkpoint=ckpt.list_checkpoints(run["vsepp"])[0][1].name)
    assert len(sorted(cache.glob("*.pt"))) == 2                   # another checkpoint, another gallery
    torch.save({"not": "a gallery"}, made[0])                     # a damaged cache is re-made
    assert Retriever.from_run(run["vsepp"], device="cpu").text_to_images(q, 5)[0].hits


def test_search_command_prints_and_writes_json(runs):
    folder, manifest, features, run = runs
    r = Retriever.from_run(run["scan"], device="cpu")
    image = r.data.image_ids[2]
    text = _invoke(["search", run["scan"], "--query", "a big green triangle", "--image", image, "--top", "3",
                    "--device", "cpu"])
    assert text.splitlines()[0] == "a big green triangle" and "  1  " in text and image in text
    lines = [json.loads(line) for line in _invoke(["search", run["scan"], "--query", "a qwxz circle", "--top",
                                                   "2", "--json", "--device", "cpu"]).splitlines()]
    assert lines[0]["unknown_words"] == ["qwxz"] and [h["rank"] for h in lines[0]["hits"]] == [1, 2]
    result = CliRunner().invoke(cli, ["search", str(run["scan"]), "--image", "nope"])
    assert result.exit_code != 0 and "not in the gallery" in str(result.exception)


def _faiss_installed() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("use_faiss", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _faiss_installed(), reason="faiss-cpu is not installed (pip install faiss-cpu)"))])
def test_inner_product_index_holds_the_exact_top_k(use_faiss):
    from retr.trainers.search.retrieval import InnerProductIndex

    gen = torch.Generator().manual_seed(0)
    vectors = torch.nn.functional.normalize(torch.randn(3000, 24, generator=gen), dim=1)
    vectors[1500] = vectors[7]                                         # an exact tie
    index = InnerProductIndex(vectors, use_faiss=use_faiss, block=512)
    assert index.backend == ("faiss" if use_faiss else "matmul")
    for q in range(5):
        query = torch.randn(24, generator=gen)
        exact = (vectors.double() @ query.double()).numpy()
        top = set(np.argsort(-exact, kind="stable")[:10])
        found = index.candidates(query, 10)
        assert top <= set(found.tolist()) and len(found) < 60
    ids = np.arange(3000) * 2
    assert set(InnerProductIndex(vectors, ids, use_faiss).candidates(vectors[7], 2).tolist()) >= {14, 3000}


@pytest.mark.parametrize("model", ["vsepp", "jgcar"])
def test_index_and_blockwise_searches_agree(runs, model):
    folder, manifest, features, run = runs
    plain = Retriever.from_run(run[model], device="cpu", use_faiss=False)
    assert plain.image_index is not None and plain.image_index.backend == "matmul"
    queries = [plain.data.captions[3], "a big red circle"]
    results = plain.text_to_images(queries, 6) + plain.image_to_texts(plain.data.image_ids[:3], 6)
    if _faiss_installed():
        fast = Retriever.from_run(run[model], device="cpu", use_faiss=True)
        again = fast.text_to_images(queries, 6) + fast.image_to_texts(plain.data.image_ids[:3], 6)
        assert [r.to_json() for r in again] == [r.to_json() for r in results]
    # and without any index: the model's score over the whole gallery
    plain.image_index = plain.caption_index = None
    blockwise = plain.text_to_images(queries, 6) + plain.image_to_texts(plain.data.image_ids[:3], 6)
    for a, b in zip(results, blockwise):
        assert [h.image_id for h in a.hits] == [h.image_id for h in b.hits]
        assert np.allclose([h.score for h in a.hits], [h.score for h in b.hits], rtol=0, atol=1e-12)


def test_cross_attention_models_have_no_index(runs):
    folder, manifest, features, run = runs
    assert Retriever.from_run(run["scan"], device="cpu").image_index is None


def test_a_shortlist_as_large_as_the_gallery_is_the_exhaustive_search(runs):
    """Two-stage search (``--shortlist``) of SCAN: with every item shortlisted it is the exhaustive result, hit for
    hit; with a few, each returned score is still eval's for that pair and the items are the shortlist's best by
    the model's score (stage one: the cosine of mean region and mean word vectors)."""
    from retr.trainers.search.two_stage import shortlist_vectors

    folder, manifest, features, run = runs
    full = Retriever.from_run(run["scan"], device="cpu")
    n_images, n_captions = full.data.num_images, full.data.num_captions
    every = Retriever.from_run(run["scan"], device="cpu", shortlist=n_captions)
    texts, images = [full.data.captions[c] for c in (0, 13)], list(full.data.image_ids[:2])
    for a, b in ((full.text_to_images(texts, 5), every.text_to_images(texts, 5)),
                 (full.image_to_texts(images, 7), every.image_to_texts(images, 7))):
        assert [r.to_json() for r in a] == [r.to_json() for r in b]
    few = Retriever.from_run(run["scan"], device="cpu", shortlist=3)
    assert few.image_index is not None and len(few.image_index) == n_images
    [result] = few.text_to_images([texts[0]], 3)
    query, _ = few.encode_texts([texts[0]])
    with torch.no_grad():
        stage_one = shortlist_vectors(few.model, few.images, "image") @ shortlist_vectors(few.model, query,
                                                                                         "caption")[0]
    short = set(np.argsort(-stage_one.numpy(), kind="stable")[:3])
    assert {full.image_ids.index(h.image_id) for h in result.hits} == short
    exhaustive = {h.image_id: h.score for h in full.text_to_images([texts[0]], n_images)[0].hits}
    assert all(h.score == pytest.approx(exhaustive[h.image_id], abs=1e-12) for h in result.hits)
    out = _invoke(["search", run["scan"], "--query", texts[0], "--top", "3", "--shortlist", "3", "--json",
                   "--device", "cpu"])
    assert json.loads(out) == result.to_json()


def _nothing_loaded(monkeypatch):
    """Make opening a run's model and split fail loudly: a refusal must come before it."""
    import retr.trainers.search.retrieval as retrieval

    def opened(*args, **kwargs):
        raise AssertionError("the run was loaded before the refusal")
    monkeypatch.setattr(retrieval, "open_run_split", opened)


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_an_approximate_index_on_a_model_scored_by_no_inner_product_is_refused_before_loading(runs, run_cli,
                                                                                            monkeypatch, kind):
    """SCAN without ``--shortlist`` scores every item with the model: no inner-product index exists for
    ``--vector-index`` to approximate, so the flag would be ignored; it is refused in one line instead."""
    folder, manifest, features, run = runs
    with monkeypatch.context() as patched:
        _nothing_loaded(patched)
        code, out, err = run_cli.as_user("train", "search", run["scan"], "--query", "a red circle", "--vector-index",
                                         kind, "--device", "cpu")
    assert code == 1 and out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"error: --vector-index {kind} approximates an inner-product search, and scan's score is "
                          f"no inner product") and "add --shortlist N to search in two stages" in err
    with pytest.raises(UserError, match="vector_index hnsw approximates"):
        Retriever.from_run(run["scan"], device="cpu", vector_index="hnsw")


@pytest.mark.skipif(not _faiss_installed(), reason="faiss-cpu is not installed (pip install faiss-cpu)")
def test_with_a_shortlist_the_approximate_index_is_stage_one(runs):
    """``--shortlist N --vector-index hnsw`` on SCAN: stage one's N come from faiss's HNSW over the shortlist
    vectors (on a gallery this small the graph finds them all, so the results equal the exact stage one's)."""
    folder, manifest, features, run = runs
    exact = Retriever.from_run(run["scan"], device="cpu", shortlist=4)
    approx = Retriever.from_run(run["scan"], device="cpu", shortlist=4, vector_index="hnsw")
    assert approx.image_index.kind == "hnsw" and exact.image_index.kind == "exact"
    text = exact.data.captions[0]
    assert approx.text_to_images([text], 4)[0].to_json() == exact.text_to_images([text], 4)[0].to_json()


def test_a_shortlist_shorter_than_top_is_said_in_one_note_line(runs, run_cli):
    """``--shortlist 3 --top 5``: five results need five items scored; the command says so on stderr (once, with
    --quiet too: a note, not progress), and its results are those of ``--shortlist 5``."""
    folder, manifest, features, run = runs
    args = ["search", run["scan"], "--query", "a big green triangle", "--top", "5", "--device", "cpu", "--json",
            "--quiet"]
    code, out, err = run_cli.as_user("train", *args, "--shortlist", "3")
    assert code == 0
    assert err.splitlines() == ["note: the shortlist of 3 is shorter than the 5 results asked for: the 5 best by "
                                "stage one are scored per query"]
    assert len(json.loads(out)["hits"]) == 5
    code, five, err = run_cli.as_user("train", *args, "--shortlist", "5")
    assert code == 0 and err == "" and five == out


def test_a_shortlist_that_changes_nothing_is_said(runs, run_cli, caplog):
    """VSE++'s exact inner-product index already finds the top k; JGCAR ranks with its run's own shortlist."""
    folder, manifest, features, run = runs
    code, out, err = run_cli.as_user("train", "search", run["vsepp"], "--query", "a red circle", "--shortlist", "3",
                                     "--device", "cpu", "--quiet")
    assert code == 0 and err.splitlines() == ["note: vsepp's score is an inner product, whose exact top k the vector "
                                              "index finds: the shortlist of 3 is not used"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="retr"):
        Retriever.from_run(run["jgcar"], device="cpu", shortlist=2)
    assert [r.getMessage() for r in caplog.records] == [
        "note: jgcar ranks in two steps with the run's own shortlist (4 per query), so the shortlist of 2 does not "
        "change its results"]


def test_an_ivf_index_over_too_few_images_is_refused_before_the_gallery_is_encoded(runs, run_cli, monkeypatch,
                                                                                  capfd):
    """The split's gallery is far below 39 images: faiss would print its own ``WARNING clustering …``."""
    import retr.trainers.search.retrieval as retrieval

    folder, manifest, features, run = runs
    n = Retriever.from_run(run["vsepp"], device="cpu").data.num_images     # encoded here if no test before did

    def encoded(*args, **kwargs):
        raise AssertionError("the gallery was encoded before the refusal")
    monkeypatch.setattr(retrieval, "_encode_gallery", encoded)
    code, out, err = run_cli.as_user("train", "search", run["vsepp"], "--query", "a red circle", "--vector-index",
                                     "ivf", "--device", "cpu", "--no-cache")
    assert code == 1 and out == "" and err == (
        f"error: an ivf index of 1 list needs at least 39 gallery images to train on (39 per list), and there are "
        f"{n}; use --vector-index exact (as fast at this size)\n")
    assert "WARNING" not in capfd.readouterr().err


@pytest.mark.parametrize("query", ["", "   ", "\t"])
def test_an_empty_query_is_refused_in_one_line(runs, run_cli, monkeypatch, query):
    folder, manifest, features, run = runs
    with monkeypatch.context() as patched:
        _nothing_loaded(patched)
        code, out, err = run_cli.as_user("train", "search", run["vsepp"], "--query", query, "--device", "cpu")
    assert code == 1 and out == "" and err == f"error: --query {query!r} has no words: give a sentence describing " \
                                               f"the images you want\n"
    with pytest.raises(UserError, match="has no words"):
        Retriever.from_run(run["vsepp"], device="cpu").text_to_images(["a red circle", query])
