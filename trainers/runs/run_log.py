"""A run's log: typed ``metrics.jsonl`` lines and TensorBoard event files (``--log tensorboard``); record types:
docs/trainer.md ("Run directory").
"""
from __future__ import annotations

import json
from pathlib import Path

from retr.common.errors import UserError
from retr.common.optional import require
from retr.trainers.runs.checkpoint import METRICS

TENSORBOARD = "tensorboard"
LOG_TARGETS = ("tensorboard",)


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
        raise UserError(f"{run} has no {METRICS} (not a training run?)")
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
    else ``None``; an unknown target is a :class:`UserError`. :func:`~retr.trainers.training.loop.train` calls it
    before anything is written, :class:`RunLog` to open the writer."""
    unknown = sorted(set(targets) - set(LOG_TARGETS))
    if unknown:
        raise UserError(f"--log {unknown[0]}: choose among {', '.join(LOG_TARGETS)}")
    if "tensorboard" not in targets:
        return None
    return require("torch.utils.tensorboard", "tensorboard", "--log tensorboard").SummaryWriter


class RunLog:
    """Appends typed records to ``metrics.jsonl`` and mirrors them to TensorBoard when asked. Methods take the
    loop's 0-based epoch index and write it 1-based."""

    def __init__(self, folder: Path, targets: tuple[str, ...] = (), purge_step: int | None = None):
        self.folder = Path(folder)
        self.writer = None
        writer_class = summary_writer(targets)
        if writer_class is not None:
            self.writer = writer_class(str(self.folder / TENSORBOARD), purge_step=purge_step)

    def _append(self, record: dict) -> None:
        with open(self.folder / METRICS, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    def step(self, epoch: int, step: int, loss: float, pairs: int, lr: float,
             in_batch_top1: float | None = None) -> None:
        record = {"type": "step", "epoch": epoch + 1, "step": step, "loss": loss, "loss_mean": loss / max(1, pairs),
                  "lr": lr}
        if in_batch_top1 is not None:
            record["in_batch_top1"] = in_batch_top1
        self._append(record)
        if self.writer is not None:
            for name in ("loss", "loss_mean", "lr", "in_batch_top1"):
                if name in record:
                    self.writer.add_scalar(f"train/{name}", record[name], step)

    def epoch(self, epoch: int, step: int, losses: list[float], pairs: list[int], lr: float, val: dict,
              best: bool, seconds: float) -> None:
        train_loss = sum(losses) / len(losses) if losses else None
        mean = sum(losses) / max(1, sum(pairs)) if losses else None
        self._append({"type": "epoch", "epoch": epoch + 1, "step": step, "train_loss": train_loss,
                      "train_loss_mean": mean, "lr": lr, "val": val, "best": best, "seconds": round(seconds, 3)})
        if self.writer is not None:
            self.writer.add_scalar("val/rsum", val["rsum"], step)
            for direction in ("i2t", "t2i"):
                for k in ("r1", "r5", "r10"):
                    self.writer.add_scalar(f"val/{direction}_{k}", val[direction][k], step)
            if mean is not None:
                self.writer.add_scalar("train/epoch_loss_mean", mean, step)
            self.writer.flush()

    def event(self, record: dict, epoch: int) -> None:
        self._append({"type": "event", **record, "epoch": epoch + 1})
        if self.writer is not None:
            self.writer.add_text(f"events/{record.get('event')}", json.dumps(record), record.get("step", 0))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
