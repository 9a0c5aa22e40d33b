"""A run's log: typed ``metrics.jsonl`` lines, mirrored to TensorBoard event files (``--log tensorboard``) and to
Weights & Biases (``--log wandb``: the same scalars and the run's settings as its config; ``WANDB_MODE=offline``
writes ``RUN/wandb/`` only); record types: docs/trainer.md ("Run directory").
"""
from __future__ import annotations

import json
import secrets
from pathlib import Path

from retr.common.errors import UserError
from retr.common.optional import require
from retr.trainers.runs.layout import METRICS

TENSORBOARD = "tensorboard"
WANDB = "wandb"
LOG_TARGETS = (TENSORBOARD, WANDB)
#: the file in ``RUN/wandb/`` that keeps the W&B run's id, so a resumed run goes on logging to the same W&B run
WANDB_ID = "run-id"


def record_type(record: dict) -> str:
    """``step``, ``epoch`` or ``event`` (also for lines written before records carried their type)."""
    if "type" in record:
        return record["type"]
    return "event" if "event" in record else "epoch" if "val" in record else "step"


def epoch_index(record: dict) -> int:
    """The 0-based epoch of a stored record (1-based in typed records, 0-based in older ones)."""
    return int(record.get("epoch", 0)) - (1 if "type" in record else 0)


def read_metrics(run: str | Path) -> list[dict]:
    """Every record of ``RUN/metrics.jsonl``, each with its ``type`` and a 1-based ``epoch``."""
    path = Path(run) / METRICS
    if not path.is_file():
        what = ("does not exist" if not Path(run).exists() else "is a file, not a run folder"
                if not Path(run).is_dir() else f"holds no {METRICS}, so it is not a training run's folder")
        raise UserError(f"{run} {what}")
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:          # a half-written last line of a killed run
            continue
        if "epoch" in record:
            record["epoch"] = epoch_index(record) + 1
        records.append({**record, "type": record_type(record)})
    return records


def summary_writer(targets: tuple[str, ...]):
    """TensorBoard's ``SummaryWriter`` class when ``targets`` name ``tensorboard`` (the ``tensorboard`` extra),
    else ``None``; an unknown target, or a missing extra of any target, is a :class:`UserError`.
    :func:`~retr.trainers.training.loop.train` calls it before anything is written, :class:`RunLog` to open
    the writer."""
    unknown = sorted(set(targets) - set(LOG_TARGETS))
    if unknown:
        raise UserError(f"--log {unknown[0]}: choose among {', '.join(LOG_TARGETS)}")
    if WANDB in targets:
        require("wandb", "wandb", "--log wandb")
    if TENSORBOARD not in targets:
        return None
    return require("torch.utils.tensorboard", "tensorboard", "--log tensorboard").SummaryWriter


class _TensorBoard:
    """The TensorBoard mirror: ``RUN/tensorboard/`` event files."""

    def __init__(self, writer_class, folder: Path, purge_step: int | None):
        self.writer = writer_class(str(folder / TENSORBOARD), purge_step=purge_step)

    def scalars(self, values: dict, step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def text(self, name: str, text: str, step: int) -> None:
        self.writer.add_text(name, text, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    """The Weights & Biases mirror: one W&B run per retr run (its id kept in ``RUN/wandb/run-id``, so a resume
    continues it), the run's settings as its config, files under ``RUN/wandb/``."""

    def __init__(self, folder: Path, config: dict, project: str, name: str | None):
        wandb = require("wandb", "wandb", "--log wandb")
        keep = folder / WANDB / WANDB_ID
        keep.parent.mkdir(parents=True, exist_ok=True)
        run_id = keep.read_text().strip() if keep.is_file() else None
        if not run_id:
            run_id = secrets.token_hex(6)            # W&B run ids are short lowercase alphanumerics
            keep.write_text(run_id + "\n")
        self.run = wandb.init(project=project, name=name or folder.resolve().name, id=run_id, resume="allow",
                              dir=str(folder), config=json.loads(json.dumps(config, default=str)))

    def scalars(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def text(self, name: str, text: str, step: int) -> None:
        self.run.log({name: text}, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class RunLog:
    """Appends typed records to ``metrics.jsonl`` and mirrors them to TensorBoard and W&B when asked
    (``targets``; ``config``, ``wandb_project``, ``wandb_name``: the W&B run's). Methods take the loop's 0-based
    epoch index and write it 1-based."""

    def __init__(self, folder: Path, targets: tuple[str, ...] = (), purge_step: int | None = None,
                 config: dict | None = None, wandb_project: str = "retr", wandb_name: str | None = None):
        self.folder = Path(folder)
        self.mirrors = []
        writer_class = summary_writer(targets)
        if writer_class is not None:
            self.mirrors.append(_TensorBoard(writer_class, self.folder, purge_step))
        if WANDB in targets:
            self.mirrors.append(_WandB(self.folder, config or {}, wandb_project, wandb_name))

    def _append(self, record: dict) -> None:
        with open(self.folder / METRICS, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    def _scalars(self, values: dict, step: int) -> None:
        for mirror in self.mirrors:
            mirror.scalars(values, step)

    def step(self, epoch: int, step: int, loss: float, pairs: int, lr: float,
             in_batch_top1: float | None = None) -> None:
        record = {"type": "step", "epoch": epoch + 1, "step": step, "loss": loss, "loss_mean": loss / max(1, pairs),
                  "lr": lr}
        if in_batch_top1 is not None:
            record["in_batch_top1"] = in_batch_top1
        self._append(record)
        self._scalars({f"train/{name}": record[name] for name in ("loss", "loss_mean", "lr", "in_batch_top1")
                       if name in record}, step)

    def epoch(self, epoch: int, step: int, losses: list[float], pairs: list[int], lr: float, val: dict,
              best: bool, seconds: float) -> None:
        train_loss = sum(losses) / len(losses) if losses else None
        mean = sum(losses) / max(1, sum(pairs)) if losses else None
        self._append({"type": "epoch", "epoch": epoch + 1, "step": step, "train_loss": train_loss,
                      "train_loss_mean": mean, "lr": lr, "val": val, "best": best, "seconds": round(seconds, 3)})
        values = {"val/rsum": val["rsum"], **{f"val/{d}_{k}": val[d][k] for d in ("i2t", "t2i")
                                              for k in ("r1", "r5", "r10")}}
        if mean is not None:
            values["train/epoch_loss_mean"] = mean
        self._scalars(values, step)
        for mirror in self.mirrors:
            mirror.flush()

    def event(self, record: dict, epoch: int) -> None:
        self._append({"type": "event", **record, "epoch": epoch + 1})
        for mirror in self.mirrors:
            mirror.text(f"events/{record.get('event')}", json.dumps(record), record.get("step", 0))

    def close(self) -> None:
        for mirror in self.mirrors:
            mirror.close()
