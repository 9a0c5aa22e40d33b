"""Evaluation's float32 arithmetic: exact (no TF32) on CUDA unless ``--tf32`` asks for it, recorded as what ran;
and, where CUDA is present, the same run scored on the CPU and on the GPU gives the same ranks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from retr.trainers.evaluation.metrics import i2t_ranks, t2i_ranks
from retr.trainers.evaluation.similarity import similarity_matrix
from retr.trainers.models import create_model
from retr.trainers.data.splits import SplitData
from tests.conftest import in_memory_features


def _precisions() -> tuple[str, str]:
    """What cuDNN's RNNs and convolutions are allowed now ("ieee": exact float32)."""
    backends = torch.backends.cudnn
    if hasattr(backends, "rnn"):
        return backends.rnn.fp32_precision, backends.conv.fp32_precision
    return ("tf32" if backends.allow_tf32 else "ieee",) * 2


@pytest.mark.parametrize("tf32", [False, True])
def test_evaluation_runs_in_exact_float32_unless_tf32_and_records_what_ran(monkeypatch, tf32):
    import retr.trainers.evaluation.runs as runs
    before = _precisions()
    seen = []

    def fake(*args):
        seen.append(_precisions())
        return {}, None
    monkeypatch.setattr(runs, "_evaluate_runs", fake)
    result, _ = runs.evaluate_runs(["run"], "f30k-1k", device="cpu", tf32=tf32)
    assert seen == [before if tf32 else ("ieee", "ieee")]
    assert _precisions() == before                              # restored
    assert result["tf32"] is False                              # a CPU never runs TF32: recorded as what ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on a GPU machine: make test-gpu)")
@pytest.mark.parametrize("name", ["scan", "vsepp"])
def test_the_same_run_scores_the_same_on_the_cpu_and_on_cuda(name):
    """A GRU caption encoder and cross attention, float32 on both devices inside exact float32: scores within
    float32 rounding of a few hundred-term sums (1e-5) and, refined, every rank equal."""
    from retr.common.devices import exact_float32
    rng = np.random.default_rng(0)
    n, per = 60, 5
    tokens = [[1] + [int(t) for t in rng.integers(4, 40, size=int(rng.integers(3, 12)))] + [2] for _ in range(n * per)]
    data = SplitData([f"i{j}" for j in range(n)], ["x"] * (n * per), np.arange(n * per) // per, tokens)
    feats = in_memory_features(rng.standard_normal((n, 36, 64)).astype(np.float32))
    torch.manual_seed(0)
    model = create_model(name, vocab_size=40, img_dim=64, embed_size=32, word_dim=16).eval()
    out = {}
    with exact_float32():
        for device in ("cpu", "cuda"):
            model.to(device)
            out[device] = {p: similarity_matrix(model, data, feats, device, precision=p, quiet=True)
                           for p in ("float32", "refined")}
    np.testing.assert_allclose(out["cuda"]["float32"], out["cpu"]["float32"], rtol=0, atol=1e-5)
    owner = data.caption_image
    np.testing.assert_array_equal(t2i_ranks(out["cuda"]["refined"], owner), t2i_ranks(out["cpu"]["refined"], owner))
    np.testing.assert_array_equal(i2t_ranks(out["cuda"]["refined"], owner), i2t_ranks(out["cpu"]["refined"], owner))


@pytest.mark.parametrize("argv,exact", [(["eval", "{run}", "--protocol", "f30k-1k"], True),
                                        (["eval", "{run}", "--protocol", "f30k-1k", "--tf32"], False),
                                        (["search", "{run}", "--query", "a dog"], True)])
def test_the_commands_score_in_exact_float32_unless_tf32(monkeypatch, tmp_path, argv, exact):
    """``eval`` hands ``--tf32`` to the evaluator (which records it); ``search`` builds and queries its
    retriever inside exact float32 (what cuDNN may use there is read when the work starts)."""
    from click.testing import CliRunner

    import retr.trainers.commands.evaluate as evaluate
    from retr.common.errors import UserError
    from retr.trainers.commands import cli
    from retr.trainers.search.retrieval import Retriever
    seen = []

    def fake_eval(*args, tf32=False, **kwargs):
        seen.append(not tf32)
        raise UserError("stop here")

    def fake_from_run(*args, **kwargs):
        seen.append(_precisions() == ("ieee", "ieee"))
        raise UserError("stop here")
    monkeypatch.setattr(evaluate, "evaluate_runs", fake_eval)
    monkeypatch.setattr(Retriever, "from_run", staticmethod(fake_from_run))
    (tmp_path / "config.json").write_text('{"model": "vsepp"}')      # a run folder, as the RUN argument checks
    result = CliRunner().invoke(cli, [a.format(run=tmp_path) for a in argv])
    assert str(result.exception) == "stop here" and seen == [exact]
