"""The HTML the report (``retr-train show``) and the search page (``retr-train serve``) share: the jinja2 templates
of :data:`TEMPLATES` rendered with every value escaped (:func:`render`, the ``report`` extra), the page's
:data:`CSS`, and the summary's tables of a run (:func:`member_rows`, :func:`stored_results`,
:func:`metrics_table`). A piece comes back as :class:`markupsafe.Markup` — built HTML, which a page's template
embeds as is."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from retr.common.errors import UserError
from retr.common.optional import require
from retr.trainers.evaluation.coco_extended import METRIC_LABELS, METRIC_NAMES
from retr.trainers.evaluation.runs import has_extended, table_rows
from retr.trainers.runs.layout import EVAL
from retr.trainers.runs.run_log import read_metrics

#: the report's jinja2 templates (package data: ``pyproject.toml``'s ``package-data``)
TEMPLATES = Path(__file__).resolve().parent / "templates"


@functools.cache
def environment():
    """The jinja2 environment of :data:`TEMPLATES` (the ``report`` extra): every value autoescaped unless it is
    built HTML (:class:`markupsafe.Markup`: another template's output, the CSS), a missing value an error."""
    jinja2 = require("jinja2", "report", "the report's pages")
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True, trim_blocks=True,
                              lstrip_blocks=True, undefined=jinja2.StrictUndefined)


def render(template: str, **values):
    """``template`` of :data:`TEMPLATES` rendered with ``values`` (escaped there), as :class:`markupsafe.Markup`:
    built HTML that another template embeds as is."""
    html = environment().get_template(template).render(**values)
    return require("markupsafe", "report", "the report's pages").Markup(html)


CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1400px; }
h1 { font-size: 22px; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 4px; margin-top: 32px; }
table { border-collapse: collapse; margin: 8px 0; } td, th { border: 1px solid #ddd; padding: 3px 7px; }
th { background: #f4f4f4; text-align: left; } .small { color: #666; font-size: 12px; }
.note { background: #fff6e0; border-left: 4px solid #f0a000; padding: 4px 10px; }
.query { border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; margin: 10px 0; }
.results { display: flex; flex-wrap: wrap; gap: 8px; align-items: flex-start; }
figure { margin: 0; text-align: center; font-size: 12px; } figure img { display: block; margin: auto; }
.truth img { outline: 4px solid #1ea03c; } .truth figcaption, li.truth { color: #13782c; font-weight: 600; }
.ellipsis { align-self: center; color: #888; font-size: 20px; }
.panels { display: flex; flex-wrap: wrap; gap: 6px; } .pair { margin: 10px 0 24px; }
.strip td { font-family: monospace; } .tree td { text-align: center; min-width: 80px; }
.tree td.rel { color: #8a3b00; } .trees { display: flex; gap: 24px; } .tree caption { font-weight: 600; }
ol { margin: 4px 0; } img.matrix { max-width: 100%; }
"""


@dataclass
class Member:
    """One run of the report (an ensemble has several)."""

    run: str
    config: dict
    model: object
    vocab: object
    checkpoint: Path
    feature_set: object
    records: list = field(default_factory=list)          # metrics.jsonl records (typed)
    data: object = None                                   # the split (SplitData) through the run's vocabulary
    manifest: str = ""

    @property
    def name(self) -> str:
        return Path(self.run).resolve().name

    @property
    def kind(self) -> str:
        return str(self.feature_set.attrs.get("kind", ""))


def run_metrics(run: str) -> list[dict]:
    """The run's ``metrics.jsonl`` records (typed), or none when it has no readable log."""
    try:
        return read_metrics(run)
    except UserError:
        return []


def metrics_table(result: dict):
    """The protocol's numbers of ``result`` (eval's dict) as a table (Markup), and its ECCV Caption and CxC
    numbers when it has them (``--extended``)."""
    return render("metrics.html.j2", result=result, extended_names=METRIC_NAMES, extended_labels=METRIC_LABELS)


def stored_results(runs: Sequence[str]):
    """The results stored in the ``eval.json`` of ``runs`` as a table with its notes (Markup; the search page
    shows it too)."""
    with_eval = [r for r in runs if (Path(r) / EVAL).is_file()]
    if not with_eval:
        return render("stored.html.j2", header=None, rows=[], notes=[], title=None)
    header, rows, notes = table_rows(with_eval)
    tables = render("stored.html.j2", header=header, rows=rows, notes=notes, title=None)
    if has_extended(with_eval):
        header, rows, notes = table_rows(with_eval, extended=True)
        tables += render("stored.html.j2", header=header, rows=rows, notes=notes,
                         title="ECCV Caption and CxC (eval --extended): every true match counted")
    return tables


def best_epoch(records: list[dict]) -> str:
    """The epoch of the best validation rSum among ``records`` (``metrics.jsonl``'s), as the summary shows it."""
    epochs = [r for r in records if r["type"] == "epoch" and isinstance(r.get("val"), dict)]
    if not epochs:
        return "-"
    best = max(epochs, key=lambda r: r["val"]["rsum"])
    return f"epoch {int(best['epoch'])} of {len(epochs)} (val rSum {best['val']['rsum']:.1f})"


def member_rows(members: list[Member]):
    """The summary's table of ``members`` (Markup; the search page shows it too): model, preset, seed, features,
    checkpoint, best validation epoch, parameter count."""
    rows = []
    for m in members:
        c, fs = m.config, m.feature_set
        model = c.get("model", "?") + (f" ({c['model_args']['direction']})" if (c.get("model_args") or {})
                                       .get("direction") else "")
        rows.append({"run": m.run, "model": model, "preset": c.get("preset") or "-", "seed": c.get("seed", "-"),
                     "features": fs.path, "kind": fs.attrs.get("kind"), "extractor": fs.attrs.get("extractor"),
                     "positions": fs.feature_shape[0], "dim": fs.feature_shape[1], "checkpoint": m.checkpoint.name,
                     "best": best_epoch(m.records), "parameters": sum(p.numel() for p in m.model.parameters())})
    return render("members.html.j2", members=rows)
