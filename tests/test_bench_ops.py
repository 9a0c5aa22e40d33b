"""bench/ops.py at small sizes: a line per count, each scoring line with its baseline counted in the same run, and
the counts that the op-count tests bound below their baselines."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_count_is_a_json_line_and_scoring_is_far_below_the_authors_loop():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "ops.py"), "--images", "50", "--captions", "20",
                           "--dim", "8", "--batch", "8"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines()]
    scoring = [r for r in records if r["stage"] == "scoring"]
    assert {(r["model"], r["block_policy"], r["precision"]) for r in scoring} == {
        (f"scan {d} lse", policy, precision) for d in ("t2i", "i2t") for policy in ("cpu", "gpu")
        for precision in ("float32", "float64", "refined")}
    for r in scoring:
        assert r["ops"] >= r["launching"] > 0 and r["ops"] < r["baseline"]["ops"], r
    trained = {r["model"]: r for r in records if r["stage"] == "train"}
    assert set(trained) == {"vsepp", "scan", "seam", "sman", "jgcar", "smfea", "vse-infinity", "jgcar co-attention"}
    for name in ("vsepp", "scan", "sman", "jgcar", "smfea", "vse-infinity"):      # the RNN models
        r = trained[name]
        assert r["launching"] <= r["ops"] < r["baseline"]["ops"] and r["ops"] < r["cpu_ops"], r
    co_attention = trained["jgcar co-attention"]
    assert 0 < co_attention["co_attention_ops"] < trained["jgcar"]["cpu_ops"]
    assert co_attention["baseline"]["one_side_logits_fwd_bwd_ops"] > 0
