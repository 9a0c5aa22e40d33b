"""The training loop shared by every model (plain PyTorch, everything visible here).

Per epoch: shuffle captions from ``(seed, epoch)``; for each batch encode → (gather across ranks) → score →
hinge loss → backward → clip the gradient norm → Adam step; the learning rate is multiplied by 0.1 every
``lr_update`` epochs (the authors' step schedule). After each epoch rank 0 computes the validation rSum
(``val_images`` first images of the validation split, as the authors' 1,000-image dev set), writes
``checkpoint-NNN.pt`` and, when the rSum improved, ``best.pt``; ``metrics.jsonl`` gets a line per ``log_every``
steps and one per epoch. ``resume=True`` continues from the newest checkpoint with the same model, optimizer,
scheduler, AMP scaler and RNG states, so the losses are those of an uninterrupted run.

Mixed precision (``amp``) runs the forward pass under ``torch.autocast`` in float16 with a gradient scaler on
CUDA only (it is ignored on CPU). DDP: see :mod:`retr.trainers.distributed`.
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
from retr.common.errors import UserError
from retr.common.version import __version__
from retr.pipeline.store import FeatureSet
from retr.trainers import checkpoint as ckpt
from retr.trainers.data import CaptionBatches, EpochBatchSampler, ImageFeatures, load_split
from retr.trainers.distributed import DistInfo, barrier, cleanup, gather_embeddings, init_from_env
from retr.trainers.evaluation import retrieval_metrics
from retr.trainers.similarity import similarity_matrix
from retr.trainers.models import create_model
from retr.trainers.vocab import DEFAULT_THRESHOLD, Vocabulary


@dataclass
class TrainConfig:
    """Everything a training run depends on (stored in ``config.json``)."""

    model: str
    model_args: dict
    features: str
    manifest: str
    out: str
    epochs: int
    batch_size: int
    lr: float
    lr_update: int
    grad_clip: float = 2.0
    seed: int = 0
    device: str = "auto"
    workers: int = 0
    preload: bool | None = None
    amp: bool = False
    train_splits: list[str] = field(default_factory=lambda: ["train", "restval"])
    val_split: str = "val"
    val_images: int = 1000
    vocab: str | None = None
    vocab_threshold: int = DEFAULT_THRESHOLD
    log_every: int = 10
    keep_checkpoints: int = 2
    preset: str | None = None
    #: stop after this many epochs without a better validation rSum (0: never; JGCAR's paper uses 5)
    early_stop: int = 0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name} asked for, but CUDA is not available here (use --device cpu)")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_step(model, batch: dict, optimizer, scaler, grad_clip: float, device: torch.device,
               dist_info: DistInfo = DistInfo(), amp: bool = False) -> float:
    """One optimisation step on ``batch``; returns the (global-batch) loss. ``model`` may be DDP-wrapped."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    tensors = [batch[k].to(device, non_blocking=True) for k in ("features", "mask", "tokens", "lengths")]
    # hook: batch entries a model asks for by name (e.g. JGCAR's image_index)
    extras = {k: batch[k].to(device) for k in getattr(getattr(model, "module", model), "batch_extras", ())}
    gather = gather_embeddings if dist_info.enabled else None
    with torch.autocast(device_type=device.type, dtype=torch.float16, enabled=amp and device.type == "cuda"):
        loss = model(*tensors, gather=gather, **extras)
    scaled = loss * dist_info.world_size          # DDP averages gradients; the global loss needs their sum
    if scaler is not None:
        scaler.scale(scaled).backward()
        scaler.unscale_(optimizer)
    else:
        scaled.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return float(loss.detach())


def _own_args(model_args: dict) -> dict:
    """Model arguments chosen by the user (not those that follow from the data)."""
    return {k: v for k, v in model_args.items() if k not in ("vocab_size", "img_dim")}


def _append_metrics(run: Path, record: dict) -> None:
    with open(run / ckpt.METRICS, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


def _prepare_run(cfg: TrainConfig, resume: bool, info: DistInfo) -> tuple[Path, dict | None]:
    run = Path(cfg.out)
    existing = ckpt.list_checkpoints(run) if run.is_dir() else []
    if resume:
        if not existing:
            raise UserError(f"nothing to resume in {run} (no checkpoint-*.pt); start without --resume")
        return run, ckpt.load_checkpoint(existing[-1][1])
    if existing or (run / ckpt.METRICS).exists():
        raise UserError(f"{run} already holds a run; pass --resume to continue it or choose another --out")
    if info.is_main:
        run.mkdir(parents=True, exist_ok=True)
    return run, None


def train(cfg: TrainConfig, resume: bool = False, quiet: bool = False, log=print) -> dict:
    """Train ``cfg.model``; returns the last epoch's validation metrics. Resumable with ``resume=True``."""
    device = resolve_device(cfg.device)
    info = init_from_env(device.type)
    if info.enabled and device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    try:
        return _train(cfg, resume, quiet, log, device, info)
    finally:
        cleanup(info)


def _train(cfg: TrainConfig, resume: bool, quiet: bool, log, device: torch.device, info: DistInfo) -> dict:
    run, state = _prepare_run(cfg, resume, info)
    features = FeatureSet(cfg.features)
    if state is not None:
        saved = state["config"]
        if saved["model"] != cfg.model or _own_args(saved["model_args"]) != _own_args(cfg.model_args):
            raise UserError(f"{run} was trained as {saved['model']} with other settings; resume with the same "
                            "options (or choose another --out)")
        cfg = TrainConfig(**{**saved, "epochs": cfg.epochs, "device": cfg.device, "workers": cfg.workers,
                             "preload": cfg.preload})
        vocab = Vocabulary.from_json(state["vocab"])
    elif cfg.vocab:
        vocab = Vocabulary.load(cfg.vocab)
    else:
        from retr.manifests.schema import read_manifest
        records = read_manifest(cfg.manifest, splits=cfg.train_splits)
        vocab = Vocabulary.build((c for r in records for c in r.captions), cfg.vocab_threshold)
    train_data, absent = load_split(cfg.manifest, cfg.train_splits, vocab, features, missing="skip")
    if absent and info.is_main:
        log(f"note: {len(absent)} training image(s) have no features and are left out (first: {absent[0]})")
    val_data, _ = load_split(cfg.manifest, [cfg.val_split], vocab, features, missing="skip")
    if cfg.val_images and val_data.num_images > cfg.val_images:
        val_data = val_data.subset_images(0, cfg.val_images)
    train_feats = ImageFeatures(features, train_data.image_ids, cfg.preload)
    val_feats = ImageFeatures(features, val_data.image_ids, cfg.preload)

    model_args = dict(cfg.model_args, vocab_size=len(vocab), img_dim=int(features.feature_shape[1]))
    cfg.model_args = model_args
    seed_everything(cfg.seed)
    model = create_model(cfg.model, **model_args).to(device)
    if hasattr(model, "prepare_training"):          # hook: per-run data a model derives (JGCAR's labels)
        model.prepare_training(train_data)
    optimizer = (model.configure_optimizer(cfg.lr) if hasattr(model, "configure_optimizer")  # hook: own optimiser
                 else torch.optim.Adam(model.parameters(), lr=cfg.lr))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, cfg.lr_update), gamma=0.1)
    use_amp = cfg.amp and device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda") if use_amp else None
    start_epoch, best_rsum, step, best_epoch = 0, -1.0, 0, -1
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        start_epoch, best_rsum, step = state["epoch"] + 1, state["best_rsum"], state["step"]
        best_epoch = state.get("best_epoch", state["epoch"])
        if cfg.early_stop and state["epoch"] - best_epoch >= cfg.early_stop:
            start_epoch = cfg.epochs            # the run had already stopped early: nothing left to do
        ckpt.set_rng_state(state["rng"])
    elif info.is_main:
        vocab.save(run / ckpt.VOCAB)
        ckpt.write_json(run / ckpt.CONFIG, {**asdict(cfg), "retr_version": __version__,
                                            "feature_attrs": features.attrs, "vocab_size": len(vocab),
                                            "train_images": train_data.num_images,
                                            "val_images_used": val_data.num_images})
    net = model
    if info.enabled:
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)

    sampler = EpochBatchSampler(train_data.num_captions, cfg.batch_size, cfg.seed, info.rank, info.world_size)
    loader = torch.utils.data.DataLoader(CaptionBatches(train_data, train_feats), sampler=sampler, batch_size=None,
                                         num_workers=cfg.workers, pin_memory=device.type == "cuda")
    last_val: dict = {}
    if info.is_main and start_epoch < cfg.epochs:
        log(f"training {cfg.model} on {train_data.num_images} images / {train_data.num_captions} captions "
            f"({'preloaded' if train_feats.preloaded else 'read per batch'}), device {device}, "
            f"epochs {start_epoch + 1}..{cfg.epochs}")
    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        losses = []
        started = time.time()
        bar = progress(loader, total=len(sampler), desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="batch",
                       quiet=quiet or not info.is_main)
        for batch in bar:
            loss = train_step(net, batch, optimizer, scaler, cfg.grad_clip, device, info, use_amp)
            losses.append(loss)
            step += 1
            if info.is_main and cfg.log_every and step % cfg.log_every == 0:
                _append_metrics(run, {"epoch": epoch, "step": step, "loss": loss,
                                      "lr": optimizer.param_groups[0]["lr"]})
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{loss:.3f}")
        if info.is_main:
            if getattr(model, "shortlist", 0):      # hook: two-step models validate as they are evaluated
                from retr.trainers.two_step import two_step_split
                last_val = two_step_split(model, val_data, val_feats, device, model.shortlist, "mixed")["two_step"]
            else:
                sims = similarity_matrix(model, val_data, val_feats, device, precision="refined", quiet=True)
                last_val = retrieval_metrics(sims, val_data.caption_image)
            is_best = last_val["rsum"] > best_rsum
            best_rsum = max(best_rsum, last_val["rsum"])
            best_epoch = epoch if is_best else best_epoch
            _append_metrics(run, {"epoch": epoch, "step": step, "train_loss": float(np.mean(losses)) if losses else None,
                                  "lr": optimizer.param_groups[0]["lr"], "val": last_val, "best": is_best,
                                  "seconds": round(time.time() - started, 3)})
        scheduler.step()
        if info.is_main:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler else None,
                     "vocab": vocab.to_json(), "epoch": epoch, "step": step, "best_rsum": best_rsum,
                     "best_epoch": best_epoch,
                     "rng": ckpt.rng_state(), "config": asdict(cfg)}
            path = ckpt.save_checkpoint(ckpt.checkpoint_path(run, epoch), state)
            if is_best:
                ckpt.save_checkpoint(run / ckpt.BEST, state)
            ckpt.prune_checkpoints(run, cfg.keep_checkpoints)
            log(f"epoch {epoch + 1}/{cfg.epochs}: loss {np.mean(losses):.4f}, val rsum {last_val['rsum']:.1f} "
                f"(i2t R@1 {last_val['i2t']['r1']:.1f}, t2i R@1 {last_val['t2i']['r1']:.1f})"
                f"{' best' if is_best else ''} → {path.name}")
        stop = bool(cfg.early_stop) and info.is_main and epoch - best_epoch >= cfg.early_stop
        if info.enabled:                        # every rank follows rank 0's decision
            flag = torch.tensor([int(stop)], device=device)
            torch.distributed.broadcast(flag, src=0)
            stop = bool(flag.item())
        barrier(info)
        if stop:
            if info.is_main:
                log(f"early stop: no better validation rSum for {cfg.early_stop} epochs "
                    f"(best {best_rsum:.1f} at epoch {best_epoch + 1})")
            break
    return last_val
