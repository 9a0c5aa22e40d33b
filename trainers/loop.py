"""The training loop shared by every model (plain PyTorch; :func:`train` reads on one screen).

``train`` = :func:`build_run` (run directory, data, model, optimiser), then per epoch :func:`train_one_epoch`,
:func:`validate`, :func:`save_epoch` and :func:`should_stop`.

Per epoch: shuffle captions from ``(seed, epoch)``; for each batch encode → (gather across ranks) → score →
loss → backward → clip the gradient norm → optimiser step (the model's ``configure_optimizer``, Adam by
default); the learning rate is multiplied by 0.1 every ``lr_update`` epochs (the authors' step schedule).
After each epoch rank 0 computes the validation rSum (``val_images`` first images of the validation split, as
the authors' 1,000-image dev set), writes ``checkpoint-NNN.pt`` and, when the rSum improved, ``best.pt``;
``metrics.jsonl`` gets a line per ``log_every`` steps and one per epoch. ``resume=True`` continues from the
newest checkpoint with the same model, optimizer, scheduler, AMP scaler and RNG states, so the losses are those
of an uninterrupted run.

Models that need side files (SMFEA's trees and concepts, JGCAR's labels) get them through their spec's
``load_inputs`` (tensors, handed to ``prepare_training``). Mixed precision (``amp``) runs the forward pass
under ``torch.autocast`` in float16 with a gradient scaler on CUDA only (``GradScaler(enabled=False)``
elsewhere). DDP: see :mod:`retr.trainers.distributed`.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from retr.common.cli import progress
from retr.common.devices import resolve_device
from retr.common.errors import UserError
from retr.common.version import __version__
from retr.store.features import FeatureSet
from retr.trainers import checkpoint as ckpt
from retr.trainers.collapse import (CollapseMonitor, StepRanking, collapse_message, recall_at_chance,
                                    val_at_chance_message)
from retr.trainers.config import TrainConfig
from retr.trainers.data import CaptionBatches, EpochBatchSampler, ImageFeatures, SplitData, load_split
from retr.trainers.distributed import DistInfo, barrier, cleanup, gather_embeddings, init_from_env
from retr.trainers.evaluation import retrieval_metrics
from retr.trainers.models import ModelInputs, create_model, get_spec
from retr.trainers.models.base import MatchingModel
from retr.trainers.similarity import similarity_matrix
from retr.store.vocab import Vocabulary

__all__ = ["TrainConfig", "train", "train_step", "resolve_device"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------------ the loop

def train(cfg: TrainConfig, resume: bool = False, quiet: bool = False, log=print,
          trust_checkpoint: bool = False) -> dict:
    """Train ``cfg.model``; returns the last epoch's validation metrics. Resumable with ``resume=True``
    (``trust_checkpoint``: read a checkpoint holding other Python objects, see :func:`checkpoint.load_checkpoint`)."""
    device = resolve_device(cfg.device)
    info = init_from_env(device.type)
    if info.enabled and device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    try:
        run = build_run(cfg, resume, device, info, log, trust_checkpoint)
        last_val: dict = {}
        epoch = run.start_epoch - 1
        for epoch in range(run.start_epoch, run.cfg.epochs):
            started = time.time()
            losses = train_one_epoch(run, epoch, quiet, log)
            if info.is_main:
                last_val = validate(run)
                is_best = run.record_epoch(epoch, losses, last_val)
                save_epoch(run, epoch, is_best, losses, last_val, time.time() - started, log)
            else:
                run.scheduler.step()
            if should_stop(run, epoch, log):
                break
        if info.is_main and last_val:
            report_val_at_chance(run, last_val, epoch, log)
        return last_val
    finally:
        cleanup(info)


# ------------------------------------------------------------------------------------------------ build

@dataclass
class Run:
    """Everything one training run holds: its settings, data, model, optimiser and progress."""

    cfg: TrainConfig
    folder: Path
    device: torch.device
    info: DistInfo
    vocab: Vocabulary
    train_data: SplitData
    val_data: SplitData
    val_feats: ImageFeatures
    model: MatchingModel
    net: torch.nn.Module                 # the model, DDP-wrapped under torchrun
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    sampler: EpochBatchSampler
    loader: torch.utils.data.DataLoader
    start_epoch: int = 0
    step: int = 0
    best_rsum: float = -1.0
    best_epoch: int = -1
    monitor: CollapseMonitor = field(default_factory=CollapseMonitor)

    def record_epoch(self, epoch: int, losses: list[float], val: dict) -> bool:
        """Update the best validation rSum; True when this epoch is the best so far."""
        is_best = val["rsum"] > self.best_rsum
        self.best_rsum = max(self.best_rsum, val["rsum"])
        self.best_epoch = epoch if is_best else self.best_epoch
        return is_best


def build_run(cfg: TrainConfig, resume: bool, device: torch.device, info: DistInfo, log,
              trust_checkpoint: bool = False) -> Run:
    """Open (or resume) the run directory, load the data, build the model, optimiser and data loader."""
    folder, state = _open_run_folder(cfg, resume, info, trust_checkpoint)
    features = FeatureSet(cfg.features)
    if state is not None:
        cfg = _resumed_config(cfg, state, folder)
        vocab = Vocabulary.from_json(state["vocab"])
    elif cfg.vocab:
        vocab = Vocabulary.load(cfg.vocab)
    else:
        from retr.manifests.schema import read_manifest
        records = read_manifest(cfg.manifest, splits=list(cfg.train_splits))
        vocab = Vocabulary.build((c for r in records for c in r.captions), cfg.vocab_threshold)
    train_data, absent = load_split(cfg.manifest, list(cfg.train_splits), vocab, features, missing="skip")
    if absent and info.is_main:
        log(f"note: {len(absent)} training image(s) have no features and are left out (first: {absent[0]})")
    val_data, _ = load_split(cfg.manifest, [cfg.val_split], vocab, features, missing="skip")
    if cfg.val_images and val_data.num_images > cfg.val_images:
        val_data = val_data.subset_images(0, cfg.val_images)
    train_feats = ImageFeatures(features, train_data.image_ids, cfg.preload)
    val_feats = ImageFeatures(features, val_data.image_ids, cfg.preload)

    spec = get_spec(cfg.model)
    config = spec.make_config({k: v for k, v in cfg.model_args.items() if k in _config_names(spec)})
    inputs = (spec.load_inputs(train_data, dict(cfg.inputs), config, len(vocab)) if spec.load_inputs
              else ModelInputs())
    if info.is_main:
        for note in inputs.notes:
            log(f"note: {note}")
    # config.json keeps the model's full config (not only the values given), so a later default change cannot
    # alter what a stored run means (the specs' upgrade_args fill absent fields with their old values)
    cfg.model_args = {**cfg.model_args, **asdict(config), "vocab_size": len(vocab),
                      "img_dim": int(features.feature_shape[1]), **inputs.sizes}
    seed_everything(cfg.seed)
    model = create_model(cfg.model, **cfg.model_args).to(device)
    model.prepare_training(inputs.tensors)
    optimizer = model.configure_optimizer(cfg.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, cfg.lr_update), gamma=0.1)
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp and device.type == "cuda")
    net = model
    if info.enabled:
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = EpochBatchSampler(train_data.num_captions, cfg.batch_size, cfg.seed, info.rank, info.world_size)
    loader = torch.utils.data.DataLoader(CaptionBatches(train_data, train_feats), sampler=sampler, batch_size=None,
                                         num_workers=cfg.workers, pin_memory=device.type == "cuda")
    run = Run(cfg, folder, device, info, vocab, train_data, val_data, val_feats, model, net, optimizer, scheduler,
              scaler, sampler, loader)
    if state is not None:
        _restore(run, state)
    elif info.is_main:
        vocab.save(folder / ckpt.VOCAB)
        ckpt.write_json(folder / ckpt.CONFIG, {**asdict(cfg), "retr_version": __version__,
                                               "feature_attrs": features.attrs, "vocab_size": len(vocab),
                                               "train_images": train_data.num_images,
                                               "val_images_used": val_data.num_images})
    if info.is_main and run.start_epoch < cfg.epochs:
        log(f"training {cfg.model} on {train_data.num_images} images / {train_data.num_captions} captions "
            f"({'preloaded' if train_feats.preloaded else 'read per batch'}), device {device}, "
            f"epochs {run.start_epoch + 1}..{cfg.epochs}")
    return run


def _config_names(spec) -> set[str]:
    from dataclasses import fields
    return {f.name for f in fields(spec.config_class)}


def _open_run_folder(cfg: TrainConfig, resume: bool, info: DistInfo,
                     trust_checkpoint: bool = False) -> tuple[Path, dict | None]:
    """The run directory and, with ``resume``, its newest checkpoint's state."""
    folder = Path(cfg.out)
    existing = ckpt.list_checkpoints(folder) if folder.is_dir() else []
    if resume:
        if not existing:
            raise UserError(f"nothing to resume in {folder} (no checkpoint-*.pt); start without --resume")
        return folder, ckpt.load_checkpoint(existing[-1][1], trust=trust_checkpoint)
    if existing or (folder / ckpt.METRICS).exists():
        raise UserError(f"{folder} already holds a run; pass --resume to continue it or choose another --out")
    if info.is_main:
        folder.mkdir(parents=True, exist_ok=True)
    return folder, None


def _resumed_config(cfg: TrainConfig, state: dict, folder: Path) -> TrainConfig:
    """The run's own config, with today's epochs/device/workers/preload; refuses other model settings."""
    saved = ckpt.upgrade_config(state["config"])
    spec = get_spec(saved["model"])
    names = _config_names(spec)

    def own(config: dict) -> tuple[dict, dict]:
        args = {k: v for k, v in config["model_args"].items() if k in names}
        return asdict(spec.make_config(args)), dict(config.get("inputs") or {})
    if saved["model"] != cfg.model or own(saved) != own(ckpt.upgrade_config(asdict(cfg))):
        raise UserError(f"{folder} was trained as {saved['model']} with other settings; resume with the same "
                        "options (or choose another --out)")
    known = {f for f in TrainConfig.__dataclass_fields__}
    return TrainConfig(**{**{k: v for k, v in saved.items() if k in known}, "epochs": cfg.epochs,
                          "device": cfg.device, "workers": cfg.workers, "preload": cfg.preload})


def _restore(run: Run, state: dict) -> None:
    """Model, optimiser, scheduler, scaler, progress and RNG states of a checkpoint."""
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    if state.get("scaler"):
        run.scaler.load_state_dict(state["scaler"])
    run.start_epoch, run.best_rsum, run.step = state["epoch"] + 1, state["best_rsum"], state["step"]
    run.best_epoch = state.get("best_epoch", state["epoch"])
    if state.get("collapse_monitor"):
        run.monitor.load_state_dict(state["collapse_monitor"])
    if run.cfg.early_stop and state["epoch"] - run.best_epoch >= run.cfg.early_stop:
        run.start_epoch = run.cfg.epochs           # the run had already stopped early: nothing left to do
    ckpt.set_rng_state(state["rng"])


# ------------------------------------------------------------------------------------------------ one epoch

def train_step(model, batch: dict, optimizer, scaler: torch.amp.GradScaler | None, grad_clip: float,
               device: torch.device, dist_info: DistInfo = DistInfo(), amp: bool = False) -> float:
    """One optimisation step on ``batch``; returns the (global-batch) loss. ``model`` may be DDP-wrapped;
    ``scaler`` (None: no mixed precision) scales the loss for float16 autocast."""
    scaler = scaler if scaler is not None else torch.amp.GradScaler("cuda", enabled=False)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    tensors = [batch[k].to(device, non_blocking=True) for k in ("features", "mask", "tokens", "lengths")]
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    extras = {k: batch[k].to(device) for k in inner.batch_extras}
    gather = gather_embeddings if dist_info.enabled else None
    with torch.autocast(device_type=device.type, dtype=torch.float16, enabled=amp and device.type == "cuda"):
        loss = model(*tensors, gather=gather, **extras)
    scaled = loss * dist_info.world_size          # DDP averages gradients; the global loss needs their sum
    scaler.scale(scaled).backward()
    scaler.unscale_(optimizer)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    return float(loss.detach())


def train_one_epoch(run: Run, epoch: int, quiet: bool, log=print) -> list[float]:
    """One pass over the training captions; a metrics line every ``log_every`` steps, the collapse monitor
    after every step (:mod:`retr.trainers.collapse`). Returns the losses.

    The first ``warmup_epochs`` epochs train on the sum of violations (``model.warming_up``)."""
    cfg, info = run.cfg, run.info
    run.sampler.set_epoch(epoch)
    run.model.warming_up = epoch < cfg.warmup_epochs
    if info.is_main and cfg.warmup_epochs and epoch == cfg.warmup_epochs and run.model.max_violation:
        log(f"epoch {epoch + 1}: warm-up over ({cfg.warmup_epochs} epoch(s) on the sum of violations), "
            "training on hardest negatives")
    losses = []
    bar = progress(run.loader, total=len(run.sampler), desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="batch",
                   quiet=quiet or not info.is_main)
    for batch in bar:
        run.model.batch_ranking = None
        loss = train_step(run.net, batch, run.optimizer, run.scaler, cfg.grad_clip, run.device, info,
                          run.scaler.is_enabled())
        losses.append(loss)
        run.step += 1
        if not info.is_main:
            continue
        ranking = StepRanking.of(run.model.batch_ranking) if run.model.batch_ranking is not None else None
        if cfg.log_every and run.step % cfg.log_every == 0:
            record = {"epoch": epoch, "step": run.step, "loss": loss, "lr": run.optimizer.param_groups[0]["lr"]}
            if ranking is not None and ranking.trials:
                record["in_batch_top1"] = ranking.hits / ranking.trials
            _append_metrics(run.folder, record)
        event = run.monitor.observe(run.step, ranking)
        if event is not None:
            _append_metrics(run.folder, {**event, "epoch": epoch})
            log(collapse_message(event, epoch))
        if hasattr(bar, "set_postfix"):           # a tqdm bar (not the plain iterator of --quiet)
            bar.set_postfix(loss=f"{loss:.3f}")
    return losses


def validate(run: Run) -> dict:
    """Validation metrics of the model as it is evaluated: two-step for models with a shortlist."""
    model = run.model
    if model.shortlist:
        from retr.trainers.two_step import two_step_split
        return two_step_split(model, run.val_data, run.val_feats, run.device, model.shortlist, "mixed")["two_step"]
    sims = similarity_matrix(model, run.val_data, run.val_feats, run.device, precision="refined", quiet=True)
    return retrieval_metrics(sims, run.val_data.caption_image)


# ------------------------------------------------------------------------------------------------ save

def save_epoch(run: Run, epoch: int, is_best: bool, losses: list[float], val: dict, seconds: float, log) -> None:
    """Metrics line, scheduler step, ``checkpoint-NNN.pt`` (and ``best.pt``), pruning, one log line."""
    _append_metrics(run.folder, {"epoch": epoch, "step": run.step,
                                 "train_loss": float(np.mean(losses)) if losses else None,
                                 "lr": run.optimizer.param_groups[0]["lr"], "val": val, "best": is_best,
                                 "seconds": round(seconds, 3)})
    run.scheduler.step()
    state = {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
             "scheduler": run.scheduler.state_dict(),
             "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
             "vocab": run.vocab.to_json(), "epoch": epoch, "step": run.step, "best_rsum": run.best_rsum,
             "best_epoch": run.best_epoch, "rng": ckpt.rng_state(), "config": asdict(run.cfg),
             "collapse_monitor": run.monitor.state_dict()}
    path = ckpt.save_checkpoint(ckpt.checkpoint_path(run.folder, epoch), state)
    if is_best:
        ckpt.save_checkpoint(run.folder / ckpt.BEST, state)
    ckpt.prune_checkpoints(run.folder, run.cfg.keep_checkpoints)
    log(f"epoch {epoch + 1}/{run.cfg.epochs}: loss {np.mean(losses):.4f}, val rsum {val['rsum']:.1f} "
        f"(i2t R@1 {val['i2t']['r1']:.1f}, t2i R@1 {val['t2i']['r1']:.1f}){' best' if is_best else ''} "
        f"→ {path.name}")


def report_val_at_chance(run: Run, val: dict, epoch: int, log) -> None:
    """At the end of training: one warning line (and a ``metrics.jsonl`` event) when the last validation recall
    is no better than a random ordering of the validation split."""
    event = recall_at_chance(val, run.val_data.caption_image)
    if event is not None:
        _append_metrics(run.folder, {**event, "epoch": epoch, "step": run.step})
        log(val_at_chance_message(event, epoch + 1))


def should_stop(run: Run, epoch: int, log) -> bool:
    """Early stop (``early_stop`` epochs without a better validation rSum), decided by rank 0 for all ranks."""
    cfg, info = run.cfg, run.info
    stop = bool(cfg.early_stop) and info.is_main and epoch - run.best_epoch >= cfg.early_stop
    if info.enabled:
        flag = torch.tensor([int(stop)], device=run.device)
        torch.distributed.broadcast(flag, src=0)
        stop = bool(flag.item())
    barrier(info)
    if stop and info.is_main:
        log(f"early stop: no better validation rSum for {cfg.early_stop} epochs "
            f"(best {run.best_rsum:.1f} at epoch {run.best_epoch + 1})")
    return stop


def _append_metrics(folder: Path, record: dict) -> None:
    with open(folder / ckpt.METRICS, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
