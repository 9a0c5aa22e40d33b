"""trainers/training/collapse.py: the hardest-negative collapse is reported in one line, a healthy run stays silent, and
``--warmup-epochs`` trains the first epochs on the sum of violations (also across a resume)."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import retr.trainers.models.base as base
from retr.trainers.commands import cli
from retr.trainers.training.collapse import (STRETCH, CollapseMonitor, StepRanking, chance_recalls, collapse_message,
                                    recall_at_chance)
from retr.trainers.models.losses import hinge_triplet_loss, in_batch_ranking
from retr.trainers.models import get_spec, list_models
from trainer_synthetic import write_uninformative_regions

TINY = ["--embed-size", "16", "--word-dim", "8", "--batch-size", "16", "--quiet", "--log-every", "1",
        "--val-images", "10"]


# ------------------------------------------------------------------------------------------------ pieces

@pytest.mark.parametrize("hardest", [True, False])
def test_equal_scores_give_the_closed_form_hinge_and_no_first_place(hardest):
    b, margin = 6, 0.2
    scores = torch.full((b, b), 0.37)
    loss = hinge_triplet_loss(scores, margin, hardest)
    ranking = in_batch_ranking(scores, margin, hardest, loss)
    assert float(ranking.hinge_at_equal_scores) == pytest.approx(float(loss))
    assert float(loss) == pytest.approx(2 * b * margin if hardest else 2 * b * (b - 1) * margin)
    assert int(ranking.hits) == 0                       # a tie is not a first place
    assert int(ranking.trials) == 2 * b and float(ranking.expected) == pytest.approx(2)


def test_in_batch_ranking_counts_rows_and_columns_and_respects_positives():
    scores = torch.tensor([[0.9, 0.1, 0.2],
                           [0.95, 0.5, 0.0],          # row 1: caption 0 outscores its own → miss
                           [0.1, 0.2, 0.8]])
    r = in_batch_ranking(scores, 0.2, True, torch.tensor(0.0))
    # rows: 0 hit, 1 miss, 2 hit; columns: 0 (0.9 < 0.95) miss, 1 hit, 2 hit
    assert int(r.hits) == 4 and int(r.trials) == 6 and float(r.expected) == pytest.approx(6 / 3)
    positives = torch.zeros(3, 3, dtype=torch.bool)
    positives[0, 1] = positives[1, 0] = True           # rows 0 and 1 show one image: not negatives of each other
    r = in_batch_ranking(scores, 0.2, True, torch.tensor(0.0), positives)
    assert int(r.hits) == 6                            # row 1 and column 0 now only compete with row/column 2
    assert float(r.expected) == pytest.approx(4 / 2 + 2 / 3)


def _step(hits: float, b: int = 16) -> StepRanking:
    p = 1 / b
    return StepRanking(hits=hits, expected=2 * b * p, variance=2 * b * p * (1 - p), trials=2 * b, hinge=6.4,
                       hinge_at_equal_scores=6.4)


def test_monitor_fires_once_after_a_stretch_at_chance_and_never_above_it():
    monitor = CollapseMonitor()
    events = [monitor.observe(step, _step(2.0)) for step in range(1, 3 * STRETCH)]
    fired = [e for e in events if e is not None]
    assert len(fired) == 1 and fired[0]["step"] == STRETCH and fired[0]["chance"] == pytest.approx(1 / 16)
    line = collapse_message(fired[0], epoch=3)
    assert "\n" not in line and "--warmup-epochs" in line and "--sum-violation" in line and "--lr" in line \
        and "--batch-size" in line and "epoch 4" in line
    learning = CollapseMonitor()
    assert all(learning.observe(step, _step(6.0)) is None for step in range(1, 5 * STRETCH))   # 3× chance
    assert all(CollapseMonitor().observe(step, None) is None for step in range(1, 3 * STRETCH))


def test_monitor_state_round_trips_in_plain_types():
    monitor = CollapseMonitor()
    for step in range(1, STRETCH // 2):
        monitor.observe(step, _step(2.0))
    state = json.loads(json.dumps(monitor.state_dict()))
    restored = CollapseMonitor()
    restored.load_state_dict(state)
    rest = range(STRETCH // 2, 2 * STRETCH)
    assert [monitor.observe(s, _step(2.0)) for s in rest] == [restored.observe(s, _step(2.0)) for s in rest]


def test_chance_recalls_equal_brute_force_over_every_ordering():
    caption_image = np.array([0, 0, 1, 1, 1, 2])       # 3 images, 6 captions, uneven
    chance = chance_recalls(caption_image, ks=(1, 2, 4))
    for k in (1, 2, 4):
        hits = [sum(caption_image[list(order[:k])].tolist().count(i) > 0 for i in range(3)) / 3
                for order in itertools.permutations(range(6))]
        assert chance["i2t"][k] == pytest.approx(np.mean(hits))
        assert chance["t2i"][k] == pytest.approx(min(k, 3) / 3)


def test_recall_at_chance_tells_a_random_model_from_a_learned_one():
    caption_image = np.repeat(np.arange(100), 5)
    chance = chance_recalls(caption_image)
    at_chance = {d: {f"r{k}": 100 * p for k, p in chance[d].items()} for d in ("i2t", "t2i")}
    at_chance["rsum"] = sum(v for d in ("i2t", "t2i") for v in at_chance[d].values())
    event = recall_at_chance(at_chance, caption_image)
    assert event is not None and event["chance_rsum"] == pytest.approx(at_chance["rsum"])
    learned = {d: {"r1": 20.0, "r5": 40.0, "r10": 50.0} for d in ("i2t", "t2i")}
    learned["rsum"] = 220.0
    assert recall_at_chance(learned, caption_image) is None


# ------------------------------------------------------------------------------------------------ the loop

def _train(features, manifest, out, epochs, *extra):
    return CliRunner().invoke(cli, ["scan", "--features", str(features), "--manifest", str(manifest), "--out",
                                    str(out), "--epochs", str(epochs), *TINY, *extra], catch_exceptions=False)


def _events(run, kind):
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line.get("event") == kind]


@pytest.fixture(scope="module")
def data(synthetic_data, tmp_path_factory):
    manifest, features = synthetic_data(images=60)          # 48 training images: 15 steps an epoch
    folder = manifest.parent
    return folder, manifest, features, write_uninformative_regions(folder, out=tmp_path_factory.mktemp("collapse"))


@pytest.mark.slow
def test_a_run_that_cannot_rank_warns_once_even_quiet_and_says_validation_is_at_chance(data, tmp_path):
    folder, manifest, _, same = data
    result = _train(same, manifest, tmp_path / "run", 2)
    assert result.exit_code == 0
    lines = [line for line in result.output.splitlines() if "collapsed" in line]
    assert len(lines) == 1 and "--warmup-epochs" in lines[0] and lines[0].startswith("warning: ")
    [event] = _events(tmp_path / "run", "collapse")
    assert event["step"] == STRETCH and event["in_batch_top1"] < event["chance"]
    assert "validation recall is still at chance" in result.output
    assert len(_events(tmp_path / "run", "val_at_chance")) == 1


def _events_free(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
            if "event" not in json.loads(line)]


@pytest.fixture()
def hinge_modes(monkeypatch):
    """Every hinge the models compute, as (epoch the loop is in, hardest negatives?)."""
    calls: list[bool] = []
    real = base.hinge_triplet_loss

    def spy(scores, margin=0.2, max_violation=True, positives=None):
        calls.append(bool(max_violation))
        return real(scores, margin, max_violation, positives)
    monkeypatch.setattr(base, "hinge_triplet_loss", spy)
    return calls


@pytest.mark.slow
def test_warmup_switches_at_its_epoch_and_resumes_mid_warmup(data, tmp_path, hinge_modes):
    folder, manifest, features, _ = data
    steps = 15
    assert _train(features, manifest, tmp_path / "straight", 3, "--warmup-epochs", "2").exit_code == 0
    assert hinge_modes == [False] * 2 * steps + [True] * steps
    config = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert config["warmup_epochs"] == 2
    hinge_modes.clear()
    assert _train(features, manifest, tmp_path / "split", 1, "--warmup-epochs", "2").exit_code == 0
    assert _train(features, manifest, tmp_path / "split", 3, "--warmup-epochs", "2", "--resume").exit_code == 0
    assert hinge_modes == [False] * 2 * steps + [True] * steps      # epoch 2 of the resumed run still warms up
    straight, split = _events_free(tmp_path / "straight"), _events_free(tmp_path / "split")
    assert [line.get("loss") for line in straight] == [line.get("loss") for line in split]


def test_warmup_is_a_documented_option_defaulting_to_zero():
    result = CliRunner().invoke(cli, ["scan", "--help"], terminal_width=200)
    text = " ".join(result.output.split())
    assert "--warmup-epochs INTEGER" in text and "sum of violations" in text
    start = text.index("--warmup-epochs")
    assert "[default: 0]" in text[start:start + 300]
    for model in ("vsepp", "smfea", "seam", "sman", "jgcar"):
        assert "--warmup-epochs" in CliRunner().invoke(cli, [model, "--help"]).output


#: models whose authors' schedule starts with the mean-violation warm-up (VSE∞: one epoch, its docs V-table)
WARMUP_BY_THE_AUTHORS = {"vse-infinity": 1}


def test_published_presets_warm_up_only_where_the_authors_do():
    for spec in map(get_spec, list_models()):
        for name, values in spec.presets.items():
            assert values.get("warmup_epochs", 0) == WARMUP_BY_THE_AUTHORS.get(spec.name, 0), (spec.name, name)
