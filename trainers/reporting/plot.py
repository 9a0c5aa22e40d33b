"""Training curves of one or several runs into a PNG: the report's three panels (:func:`draw.curves_png`:
training loss per step, validation R@1 both ways and rSum per epoch), runs overlaid and labelled by folder name,
collapse events marked on the loss panel."""
from __future__ import annotations

from pathlib import Path

from retr.common.errors import UserError
from retr.trainers.reporting.draw import curves_png, pyplot
from retr.trainers.runs.run_log import read_metrics


def plot_runs(runs: list[str], out: str | Path) -> Path:
    """Draw ``runs``' curves into ``out`` (PNG); returns its path."""
    pyplot()   # the report extra, before any work
    series = []
    for run in runs:
        records = read_metrics(run)
        if not any(r["type"] in ("step", "epoch") for r in records):
            raise UserError(f"{run}: metrics.jsonl holds no step or epoch records yet")
        series.append((Path(run).resolve().name, records))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return curves_png(out, series)
