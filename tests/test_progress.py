"""common/progress.py: off a terminal a bar prints a line per interval, never the same count twice, and a stage
names the bars made inside it."""
from __future__ import annotations

import time

from retr.common.progress import progress, stage


def test_a_log_never_repeats_a_count(capsys, monkeypatch):
    monkeypatch.setenv("RETR_PROGRESS_SECONDS", "0.02")
    bar = progress(total=10, desc="score", unit="block")
    for _ in range(4):
        bar.update(1)
        time.sleep(0.03)
    time.sleep(0.1)              # a stall: the interval passes with nothing new
    bar.close()                  # closed where its last line left it
    lines = capsys.readouterr().err.splitlines()
    counts = [line.split("|")[-1].split()[0] for line in lines]
    assert counts and counts[-1] == "4/10"
    assert len(counts) == len(set(counts))
    assert all(line.startswith("score:") for line in lines)


def test_a_short_stage_prints_nothing_in_a_log_and_a_stage_names_its_bars(capsys, monkeypatch):
    monkeypatch.setenv("RETR_PROGRESS_SECONDS", "30")
    for _ in progress(range(3), desc="encode images"):
        pass
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RETR_PROGRESS_SECONDS", "0.01")
    with stage("validation"):
        for _ in progress(range(3), desc="encode images"):
            time.sleep(0.02)
    err = capsys.readouterr().err.splitlines()
    assert err and all(line.startswith("validation: encode images:") for line in err)
    for _ in progress(range(2), desc="after", quiet=True):
        pass
    assert capsys.readouterr().err == ""
