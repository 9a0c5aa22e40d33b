"""The training loop shared by every model (plain PyTorch; :func:`train` reads on one screen).

``train`` = :func:`build_run` (the run directory, then :func:`build_data`, :func:`build_model` — from the run's
settings, ``cfg.model_config`` —, :func:`build_optimiser`, :func:`build_distributed` and :func:`record_start`), then
per epoch :func:`train_one_epoch`, :func:`validate`, :func:`save_epoch` and :func:`should_stop`.

Per epoch: shuffle captions from ``(seed, epoch)``; for each batch encode → (gather across ranks) → score →
loss → backward → clip the gradient norm → optimiser step (the model's ``configure_optimizer``, Adam by
default); the learning rate is multiplied by 0.1 every ``lr_update`` epochs (the authors' step schedule).
After each epoch rank 0 computes the validation rSum (``val_images`` first images of the validation split, as
the authors' 1,000-image dev set), writes ``checkpoint-NNN.pt`` and, when the rSum improved, ``best.pt``;
``metrics.jsonl`` gets a line per ``log_every`` steps and one per epoch. ``resume=True`` continues from the
newest checkpoint with the same model, optimizer, scheduler, AMP scaler and RNG states, so the losses are those
of an uninterrupted run.

Models that need side files (SMFEA's trees and concepts, JGCAR's labels) get them through their spec's
``load_inputs`` (tensors, handed to ``prepare_training``). Mixed precision (``--amp``) runs the forward pass
under ``torch.autocast``: ``bf16`` on CPU and CUDA, ``fp16`` with a gradient scaler on CUDA only
(``GradScaler(enabled=False)`` elsewhere). ``--accum-steps N`` backpropagates N micro-batches per optimiser
step (:func:`train_step`). DDP: see :mod:`retr.trainers.training.distributed`.

On the GPU: ``--preload gpu`` holds the features on the device and gathers each batch there; otherwise batches
leave the loader in the stored dtype, pinned, and the next one is copied on a side stream while the current step
computes (:class:`~retr.common.prefetch.DevicePrefetcher`), then converted to float32 on the device.
``--optimizer-impl`` picks torch's fused, foreach or per-parameter update (auto: fused on CUDA), ``--compile``
compiles the model's training scoring function (:meth:`MatchingModel.compile_scoring`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator
import platform
import socket
import subprocess
import sys

import numpy as np
import torch

from retr.common.atomic import atomic_text
from retr.common.progress import progress, stage
from retr.common.devices import resolve_device
from retr.common.errors import UserError
from retr.common.locks import exclusive_lock
from retr.common.prefetch import DevicePrefetcher
from retr.common.version import __version__
from retr.store.features import FeatureSet
from retr.trainers.runs import checkpoint as ckpt
from retr.trainers.training.collapse import (CollapseMonitor, StepRanking, collapse_message, recall_at_chance,
                                    val_at_chance_message)
from retr.trainers.config import TrainConfig, resumed_settings, settings_from_stored
from retr.trainers.runs.run_log import RunLog, epoch_index, summary_writer
from retr.trainers.data.splits import (CaptionBatches, EpochBatchSampler, ImageFeatures, ManifestCaptions, SplitData,
                                       check_feature_contract)
from retr.trainers.runs.resume import check_same_data, data_identity
from retr.trainers.training.distributed import DistInfo, GatherEmbeddings, barrier, cleanup, init_from_env
from retr.trainers.evaluation.metrics import retrieval_metrics
from retr.trainers.models import ModelInputs, get_spec
from retr.trainers.models.base import MatchingModel
from retr.trainers.models.optim import apply_implementation
from retr.trainers.models.side_inputs import add_word_vectors
from retr.trainers.evaluation.similarity import similarity_matrix
from retr.store.vocabularies import CaptionVocabulary, load_vocabulary, vocabulary_from_json
from retr.trainers.runs.layout import BEST, CONFIG, EMA, LOCK, METRICS, VOCAB
from retr.trainers.evaluation.two_step import two_step_split

logger = logging.getLogger(__name__)

__all__ = ["TrainConfig", "train", "train_step", "resolve_device"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------------ the loop

def train(cfg: TrainConfig, resume: bool = False, quiet: bool = False, trust_checkpoint: bool = False,
          notes: tuple[str, ...] = ()) -> dict:
    """Train ``cfg.model``; returns the last epoch's validation metrics. Resumable with ``resume=True``
    (``trust_checkpoint``: read a checkpoint holding other Python objects, see :func:`checkpoint.load_checkpoint`).
    Progress goes to the ``retr`` logger; ``notes`` are logged once the run has started (its settings checked)."""
    summary_writer(tuple(cfg.log))   # an unknown --log target or a missing extra stops before anything is written
    device = resolve_device(cfg.device)
    info = init_from_env(device.type)
    if info.enabled and device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    try:
        with run_lock(cfg.out, info):
            run = build_run(cfg, resume, device, info, trust_checkpoint, notes, quiet)
            last_val: dict = {}
            epoch = run.start_epoch - 1
            for epoch in range(run.start_epoch, run.cfg.epochs):
                started = time.time()
                losses = train_one_epoch(run, epoch, quiet)
                if info.is_main:
                    last_val = validate(run, quiet)
                    is_best = run.record_epoch(epoch, losses, last_val)
                    if epoch == run.cfg.epochs - 1 or run.early_stop_due(epoch):
                        report_val_at_chance(run, last_val, epoch)   # logged before the last checkpoint
                    save_epoch(run, epoch, is_best, losses, last_val, time.time() - started)
                else:
                    run.scheduler.step()
                if should_stop(run, epoch):
                    break
            if run.log is not None:
                run.log.close()
            return last_val
    finally:
        cleanup(info)


@contextlib.contextmanager
def run_lock(out: str, info: DistInfo) -> Iterator[None]:
    """Rank 0 holds ``OUT/run.lock`` (an OS lock, dropped when the process dies) for the run's lifetime: a
    second ``retr-train`` on the same ``--out`` stops in one line naming the holder. A folder this call created
    and nothing but the lock went into is removed again when the run fails to start."""
    if not info.is_main:
        yield
        return
    folder = Path(out)
    created = not folder.exists()
    try:
        with exclusive_lock(folder / LOCK, f"run {folder}",
                            "wait for it to finish, or choose another --out"):
            yield
    except BaseException:
        if created and folder.is_dir() and {p.name for p in folder.iterdir()} <= {LOCK}:
            shutil.rmtree(folder, ignore_errors=True)
        raise


# ------------------------------------------------------------------------------------------------ build

@dataclass
class Run:
    """Everything one training run holds: its settings, data, model, optimiser and progress."""

    cfg: TrainConfig
    folder: Path
    device: torch.device
    info: DistInfo
    vocab: CaptionVocabulary
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
    ema: torch.optim.swa_utils.AveragedModel | None = None   # --ema: the moving average of the weights
    log: RunLog | None = None                                   # metrics.jsonl (+ TensorBoard), rank 0 only
    epoch_pairs: list[int] = field(default_factory=list)        # pairs of each step of the current epoch

    def early_stop_due(self, epoch: int) -> bool:
        """True when ``early_stop`` epochs have passed without a better validation rSum."""
        return bool(self.cfg.early_stop) and epoch - self.best_epoch >= self.cfg.early_stop

    def record_epoch(self, epoch: int, losses: list[float], val: dict) -> bool:
        """Update the best validation rSum; True when this epoch is the best so far."""
        is_best = val["rsum"] > self.best_rsum
        self.best_rsum = max(self.best_rsum, val["rsum"])
        self.best_epoch = epoch if is_best else self.best_epoch
        return is_best


def lr_schedule(optimizer: torch.optim.Optimizer, lr_update: int) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning rate ×0.1 every ``lr_update`` epochs (the authors' ``adjust_learning_rate``), stepped after each
    epoch."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, lr_update), gamma=0.1)


def build_run(cfg: TrainConfig, resume: bool, device: torch.device, info: DistInfo,
              trust_checkpoint: bool = False, notes: tuple[str, ...] = (), quiet: bool = False) -> Run:
    """Open (or resume) the run directory, then build its data, model, optimiser and (distributed) loader, each in
    its builder; a new run saves its vocabulary, every start rewrites ``config.json`` (:func:`record_start`)."""
    folder, state = _open_run_folder(cfg, resume, info, trust_checkpoint)
    if resume:                      # the run's own settings, with what a resume may change taken from cfg
        stored = (settings_from_stored(get_spec(state["config"]["model"]), state["config"]) if state is not None
                  else ckpt.read_settings(folder))
        cfg = resumed_settings(stored, cfg, folder)
    data = build_data(cfg, folder, resume, state, device, info, quiet)
    model = build_model(cfg, data, device, info)
    optimizer, optimizer_impls, scheduler, scaler = build_optimiser(cfg, model, device, info)
    net, sampler, loader = build_distributed(cfg, model, data, device, info)
    run = Run(cfg, folder, device, info, data.vocab, data.train, data.val, data.val_feats, model, net, optimizer,
              scheduler, scaler, sampler, loader)
    if cfg.ema:
        run.ema = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(cfg.ema), use_buffers=True)
    if state is not None:
        _restore(run, state)
        apply_implementation(optimizer, cfg.optimizer_impl, device)     # the checkpoint brought its run's flags
    elif info.is_main:
        data.vocab.save(folder / VOCAB)
    if info.is_main:
        record_start(run, data, resumed=state is not None)
    if info.is_main and run.start_epoch < run.cfg.epochs:
        for note in notes:
            logger.warning(note)
        cfg = run.cfg
        logger.info(f"training {cfg.model}{f' (preset {cfg.preset})' if cfg.preset else ''} on "
                    f"{data.train.num_images} images / {data.train.num_captions} captions "
                    f"({FEATURES_HELD[data.train_feats.where]}), device {device}, optimizer "
                    f"{'+'.join(optimizer_impls)}"
                    f"{f', compiled ({cfg.compile})' if cfg.compile != 'off' and model.compiled_functions else ''}, "
                    f"epochs {run.start_epoch + 1}..{cfg.epochs}")
        logger.info(f"training {data.train_feats.decision}")      # where the features are held, and why
        if data.val_feats.where != data.train_feats.where:
            logger.info(f"validation {data.val_feats.decision}")
    return run


@dataclass
class RunData:
    """What a run reads (:func:`build_data`): the feature set and the identity of the data, the vocabulary, the
    training and validation splits, where their features are held, and the DataLoader workers that go with it."""

    features: FeatureSet
    identity: dict
    vocab: CaptionVocabulary
    train: SplitData
    val: SplitData
    train_feats: ImageFeatures
    val_feats: ImageFeatures
    workers: int


def build_data(cfg: TrainConfig, folder: Path, resume: bool, state: dict | None, device: torch.device,
               info: DistInfo, quiet: bool = False) -> RunData:
    """The feature set (checked; a resumed run's on the data it started with), the vocabulary (the checkpoint's, the
    one the model's settings fix — BERT's WordPiece —, ``--vocab``, or built), the training and validation splits from one pass over the manifest's captions, and
    where their features are held (``--preload``)."""
    if not Path(cfg.manifest).is_file():
        raise UserError(f"manifest {cfg.manifest} {'is a folder' if Path(cfg.manifest).is_dir() else 'does not exist'}"
                        " (expected a JSON Lines file)")
    features = FeatureSet(cfg.features)
    check_feature_contract(features)
    identity = data_identity(features, cfg.manifest, cfg.inputs)
    if resume:                                          # the data the run started on
        check_same_data(folder, identity)
        if state is not None:
            check_feature_contract(features, cfg.sizes.get("img_dim"))
    # the manifest read and every caption tokenised once: the vocabulary and both splits come from that pass
    spec = get_spec(cfg.model)
    fixed = (spec.caption_vocabulary(cfg.model_config, cfg.vocab) if state is None and spec.caption_vocabulary
             else None)                                  # a vocabulary the model's settings fix (BERT's)
    vocab_splits = list(cfg.vocab_splits or cfg.train_splits)
    builds_vocab = state is None and not cfg.vocab and fixed is None
    quiet = quiet or not info.is_main
    captions = ManifestCaptions.read(cfg.manifest, [*cfg.train_splits, cfg.val_split,
                                                    *(vocab_splits if builds_vocab else [])], quiet=quiet)
    if state is not None:
        vocab = vocabulary_from_json(state["vocab"])
    elif fixed is not None:
        vocab = fixed
    elif cfg.vocab:
        vocab = load_vocabulary(cfg.vocab)
    else:
        vocab = captions.vocabulary(vocab_splits, cfg.vocab_threshold)
    train, absent = captions.split(list(cfg.train_splits), vocab, features, missing="skip")
    if absent and info.is_main:
        logger.warning(f"note: {len(absent)} training image(s) have no features and are left out (first: {absent[0]})")
    val, _ = captions.split([cfg.val_split], vocab, features, missing="skip")
    del captions
    if cfg.val_images and val.num_images > cfg.val_images:
        val = val.subset_images(0, cfg.val_images)
    train_feats = ImageFeatures(features, train.image_ids, cfg.preload, device=device, quiet=quiet)
    val_feats = ImageFeatures(features, val.image_ids, cfg.preload, device=device, quiet=quiet)
    workers = cfg.workers
    if info.is_main:
        for note in dict.fromkeys(f.note for f in (train_feats, val_feats) if f.note):
            logger.warning(f"note: {note}")
        if cfg.preload == "gpu" and device.type != "cuda":
            logger.warning(f"note: --preload gpu on {device}: the features are held in host memory")
    if train_feats.where == "gpu" and workers:
        if info.is_main:
            logger.warning("note: the features are held on the device and batches are gathered there, in the "
                           "training process; --workers is ignored")
        workers = 0
    return RunData(features, identity, vocab, train, val, train_feats, val_feats, workers)


def build_model(cfg: TrainConfig, data: RunData, device: torch.device, info: DistInfo) -> MatchingModel:
    """The model, built from the run's settings (``cfg.model_config``, its config dataclass) and the sizes that
    follow from the data (``cfg.sizes``, recorded in ``config.json``): the side files its spec reads (and the
    settings they fix), ``--word-vectors``, the seed, ``prepare_training`` and ``--compile``."""
    spec = get_spec(cfg.model)
    inputs = (spec.load_inputs(data.train, dict(cfg.inputs), cfg.model_config, data.vocab) if spec.load_inputs
              else ModelInputs())
    inputs = add_word_vectors(inputs, cfg.model_config, data.vocab, cfg.sizes.get("word_vectors_file", ""))
    if info.is_main:
        for note in inputs.notes:
            logger.warning(f"note: {note}")
    if inputs.settings:                                   # e.g. fixed concept vectors fix their size
        cfg.model_config = dataclasses.replace(cfg.model_config, **inputs.settings)
    sizes = {"vocab_size": len(data.vocab), "img_dim": int(data.features.feature_shape[1]), **inputs.sizes}
    changed = sorted(k for k in set(sizes) & set(cfg.sizes) if sizes[k] != cfg.sizes[k])
    if changed:                                           # a resumed run: its data must give the model it built
        raise UserError(f"this run's model was built with {changed[0]} {cfg.sizes[changed[0]]!r}; its data and "
                        f"settings now give {sizes[changed[0]]!r}")
    cfg.sizes = sizes
    seed_everything(cfg.seed)
    model = spec.model_class(config=cfg.model_config, **cfg.sizes).to(device)
    model.prepare_training(inputs.tensors)
    if cfg.compile != "off":
        model.compile_scoring(mode=cfg.compile)
        if not model.compiled_functions and info.is_main:
            logger.warning(f"note: --compile: {cfg.model} scores a batch with one matrix product; nothing to compile, "
                           "training runs eager")
    return model


def build_optimiser(cfg: TrainConfig, model: MatchingModel, device: torch.device, info: DistInfo):
    """``(optimizer, its implementations, the lr schedule, the AMP gradient scaler)``: the model's own optimiser
    (``configure_optimizer``) with ``--optimizer-impl`` applied, the step schedule of ``--lr-update``, and a scaler
    enabled for ``--amp fp16`` on CUDA."""
    optimizer = model.configure_optimizer(cfg.lr)
    optimizer_impls = apply_implementation(optimizer, cfg.optimizer_impl, device)
    scheduler = lr_schedule(optimizer, cfg.lr_update)
    if cfg.amp == "fp16" and device.type != "cuda" and info.is_main:
        logger.warning("note: --amp fp16 needs CUDA; training in float32 on " + str(device) + " (--amp bf16 runs on CPU)")
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp == "fp16" and device.type == "cuda")
    return optimizer, optimizer_impls, scheduler, scaler


def build_distributed(cfg: TrainConfig, model: MatchingModel, data: RunData, device: torch.device, info: DistInfo):
    """``(net, sampler, loader)``: the model DDP-wrapped under ``torchrun`` (else itself), each rank's slice of every
    epoch's batches (``(seed, epoch)`` only) and the DataLoader that reads them."""
    net = model
    if info.enabled:
        # device_ids None: DDP leaves the inputs where train_step put them (with device_ids it would copy the
        # host-side lengths and indices to the GPU, and the models would read them back)
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=None)
    sampler = EpochBatchSampler(data.train.num_captions, cfg.batch_size, cfg.seed, info.rank, info.world_size,
                                cfg.drop_last)
    # batches leave the loader in the stored dtype (float16: half the bytes over the bus), pinned on CUDA so the
    # copy is asynchronous; train_step converts them to float32 on the device. --preload gpu gathers them there.
    loader = torch.utils.data.DataLoader(CaptionBatches(data.train, data.train_feats, as_stored=True), sampler=sampler,
                                         batch_size=None, num_workers=data.workers,
                                         pin_memory=device.type == "cuda" and data.train_feats.where != "gpu")
    return net, sampler, loader


def record_start(run: Run, data: RunData, resumed: bool) -> None:
    """Rank 0 at every start: the metrics log opened (a resume purges what an interrupted run logged after its
    checkpoint), and ``config.json`` written — the settings (a resume records those it changed: more epochs,
    another device), data paths absolute and relative to the run (:func:`checkpoint.read_config` resolves them),
    the feature set's attributes, the data's identity and the environment."""
    cfg = run.cfg
    run.log = RunLog(run.folder, tuple(cfg.log), purge_step=run.step + 1 if resumed else None, config=cfg.as_stored(),
                     wandb_project=cfg.wandb_project, wandb_name=cfg.wandb_name)
    cfg = run.cfg = ckpt.absolute_paths(cfg)
    ckpt.write_json(run.folder / CONFIG, {**cfg.as_stored(), "paths_from_run": ckpt.paths_from_run(cfg, run.folder),
                                          "retr_version": __version__, "feature_attrs": data.features.attrs,
                                          "vocab_size": len(data.vocab), "train_images": data.train.num_images,
                                          "val_images_used": data.val.num_images, "data_identity": data.identity,
                                          "environment": environment()})


#: how the start line names where the training features are held (:attr:`ImageFeatures.where`)
FEATURES_HELD = {"host": "preloaded", "gpu": "held on the device", "file": "read per batch"}


def environment() -> dict:
    """Where and with what a run (re)started: versions (retr, its git commit when run from a checkout, torch,
    CUDA, Python), the host and the command line — recorded in ``config.json`` at every start."""
    commit = None
    try:
        found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, text=True,
                               capture_output=True, timeout=10)
        commit = found.stdout.strip() if found.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"retr": __version__, "git_commit": commit, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "host": socket.gethostname(), "command": sys.argv,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _open_run_folder(cfg: TrainConfig, resume: bool, info: DistInfo,
                     trust_checkpoint: bool = False) -> tuple[Path, dict | None]:
    """The run directory and, with ``resume``, its newest checkpoint's state (None: start from the beginning).

    ``resume`` on a run that stopped before its first checkpoint starts it again from the beginning (its
    settings are still checked against its ``config.json``); what the stopped start had logged is discarded."""
    folder = Path(cfg.out)
    existing = ckpt.list_checkpoints(folder) if folder.is_dir() else []
    if resume:
        if existing:
            return folder, ckpt.load_checkpoint(existing[-1][1], trust=trust_checkpoint)
        if not (folder / CONFIG).is_file():
            raise UserError(f"nothing to resume in {folder} (no run there); start without --resume")
        if info.is_main:
            logger.warning(f"note: {folder} stopped before its first checkpoint; starting it again from the beginning")
            for name in (METRICS, BEST):
                (folder / name).unlink(missing_ok=True)
        return folder, None
    if existing or (folder / METRICS).exists() or (folder / CONFIG).exists():
        raise UserError(f"{folder} already holds a run; pass --resume to continue it or choose another --out")
    if info.is_main:
        folder.mkdir(parents=True, exist_ok=True)
    return folder, None


def _restore(run: Run, state: dict) -> None:
    """Model, optimiser, scheduler, scaler, progress and RNG states of a checkpoint."""
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    if state.get("scaler"):
        run.scaler.load_state_dict(state["scaler"])
    run.start_epoch, run.best_rsum, run.step = state["epoch"] + 1, state["best_rsum"], state["step"]
    run.best_epoch = state.get("best_epoch", state["epoch"])
    if run.ema is not None and state.get("ema"):
        run.ema.load_state_dict(state["ema"])
    if state.get("collapse_monitor"):
        run.monitor.load_state_dict(state["collapse_monitor"])
    if run.early_stop_due(state["epoch"]):
        run.start_epoch = run.cfg.epochs           # the run had already stopped early: nothing left to do
    if run.info.is_main:
        truncate_metrics(run.folder, state, continuing=run.start_epoch < run.cfg.epochs)
    ckpt.set_rng_state(state["rng"])


def truncate_metrics(folder: Path, state: dict, continuing: bool = True) -> None:
    """Cut ``metrics.jsonl`` back to what it held when ``state`` was saved, so a resumed run's log equals an
    uninterrupted run's line for line: a killed run leaves the lines of its unfinished epoch, perhaps half a
    line. Kept: the lines up to the first one past the checkpoint's step and epoch (the file is append-only, so
    everything after that is from the lost stretch), less the end-of-training ``val_at_chance`` event when the
    run is ``continuing`` past that end. Rewritten atomically."""
    path = folder / METRICS
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    kept = []
    for line in text.splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            break
        if not line.endswith("\n") or record.get("step", 0) > state["step"] or epoch_index(record) > state["epoch"]:
            break
        if not (continuing and record.get("event") == "val_at_chance"):   # said at an end this resume goes past
            kept.append(line)
    if len(kept) < len(text.splitlines(keepends=True)) or not text.endswith("\n") and text:
        with atomic_text(path) as handle:
            handle.write("".join(kept))


# ------------------------------------------------------------------------------------------------ one epoch

def autocast_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``--amp`` on ``device`` (None: no autocast): bf16 anywhere, fp16 on CUDA only."""
    if amp == "bf16":
        return torch.bfloat16
    if amp == "fp16" and device.type == "cuda":
        return torch.float16
    return None


def train_step(model, batch: dict, optimizer, scaler: torch.amp.GradScaler | None, grad_clip: float,
               device: torch.device, dist_info: DistInfo = DistInfo(), amp: str = "off",
               accum_steps: int = 1) -> float:
    """One optimisation step on ``batch``; returns the (global-batch) loss. ``model`` may be DDP-wrapped;
    ``amp`` (``off``, ``fp16``, ``bf16``) is the autocast of the forward pass, ``scaler`` (None: none) scales the
    loss for fp16.

    ``accum_steps`` N cuts the batch into N micro-batches (in order), each scored and backpropagated on its own,
    and steps the optimiser once: the gradients add up to those of the N micro-batch losses, and the returned
    loss is their sum. A negative is another pair of the same micro-batch (hardest negatives among B/N − 1).
    """
    scaler = scaler if scaler is not None else torch.amp.GradScaler("cuda", enabled=False)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    keys = ("features", "mask", "tokens", "lengths", *inner.batch_extras)
    size = batch["features"].shape[0]
    cuts = np.array_split(np.arange(size), max(1, min(accum_steps, size)))
    gather = GatherEmbeddings(dist_info.world_size) if dist_info.enabled else None
    dtype = autocast_dtype(amp, device)
    losses = []
    for n, rows in enumerate(cuts):
        part = {k: batch[k][torch.from_numpy(rows)] if len(cuts) > 1 else batch[k] for k in keys}
        tensors = [part[k].to(device, non_blocking=True) for k in ("features", "mask", "tokens")]
        tensors[0] = tensors[0].float()          # the loader may hand over the stored float16
        # lengths and the extras (table indices) stay on the host: the models read them there (a caption's length
        # packs its RNN input, an index looks up a host table) and move to the device what they compute with, so
        # no step waits on the device to read them back
        tensors.append(part["lengths"].cpu())
        extras = {k: part[k].cpu() for k in inner.batch_extras}
        sync = n == len(cuts) - 1 or not dist_info.enabled       # DDP all-reduces on the last micro-batch only
        context = model.no_sync() if not sync else contextlib.nullcontext()
        with context:
            with torch.autocast(device_type=device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = model(*tensors, gather=gather, **extras)
            scaler.scale(loss * dist_info.world_size).backward()   # DDP averages gradients; the loss is a sum
        losses.append(loss.detach())
    scaler.unscale_(optimizer)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    return sum(float(loss) for loss in losses)     # read once the whole step is queued: one wait, at its end


def train_one_epoch(run: Run, epoch: int, quiet: bool) -> list[float]:
    """One pass over the training captions; a metrics line every ``log_every`` steps, the collapse monitor
    after every step (:mod:`retr.trainers.training.collapse`). Returns the losses.

    The first ``warmup_epochs`` epochs train on the sum of violations (``model.warming_up``)."""
    cfg, info = run.cfg, run.info
    run.sampler.set_epoch(epoch)
    run.model.warming_up = epoch < cfg.warmup_epochs
    if info.is_main and cfg.warmup_epochs and epoch == cfg.warmup_epochs and run.model.max_violation:
        logger.info(f"epoch {epoch + 1}: warm-up over ({cfg.warmup_epochs} epoch(s) on the sum of violations), "
            "training on hardest negatives")
    losses = []
    run.epoch_pairs = []
    batches = DevicePrefetcher(run.loader, lambda batch: to_device(batch, run.device), run.device)
    bar = progress(batches, total=len(run.sampler), desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="batch",
                   quiet=quiet or not info.is_main)
    for batch in bar:
        run.model.batch_ranking = None
        loss = train_step(run.net, batch, run.optimizer, run.scaler, cfg.grad_clip, run.device, info, cfg.amp,
                          cfg.accum_steps)
        if not math.isfinite(loss):
            raise UserError(non_finite_message(run, batch, epoch, loss))
        if run.ema is not None:
            run.ema.update_parameters(run.model)
        losses.append(loss)
        run.epoch_pairs.append(int(batch["features"].shape[0]) * info.world_size)
        run.step += 1
        if not info.is_main:
            continue
        ranking = StepRanking.of(run.model.batch_ranking) if run.model.batch_ranking is not None else None
        if cfg.log_every and run.step % cfg.log_every == 0:
            run.log.step(epoch, run.step, loss, int(batch["features"].shape[0]) * info.world_size,
                         run.optimizer.param_groups[0]["lr"],
                         ranking.hits / ranking.trials if ranking is not None and ranking.trials else None)
        event = run.monitor.observe(run.step, ranking)
        if event is not None:
            run.log.event(event, epoch)
            logger.warning(collapse_message(event, epoch))
        if hasattr(bar, "set_postfix"):           # a tqdm bar (not the plain iterator of --quiet)
            # shown at the bar's next redraw: refreshing here would print a line a batch off a terminal
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
    return losses


#: the batch entries the prefetcher copies to the device ahead (lengths and extras stay where models read them:
#: on the host)
DEVICE_KEYS = ("features", "mask", "tokens")


def to_device(batch: dict, device: torch.device) -> dict:
    """``batch`` with its :data:`DEVICE_KEYS` tensors on ``device`` (``non_blocking``: from the DataLoader's pinned
    memory on CUDA, the copy runs on the prefetcher's side stream while the previous step computes)."""
    return {k: v.to(device, non_blocking=True) if k in DEVICE_KEYS else v for k, v in batch.items()}


def non_finite_message(run: Run, batch: dict, epoch: int, loss: float) -> str:
    """One line for a step whose loss is not finite: the images whose features are not finite, else the
    batch's first images and what to try. The run on disk stays at its last checkpoint."""
    ids = [run.train_data.image_ids[i] for i in batch["image_index"].tolist()]
    bad = ~torch.isfinite(batch["features"].float()).flatten(1).all(1)
    where = f"step {run.step + 1} (epoch {epoch + 1})"
    if bool(bad.any()):
        named = sorted({ids[i] for i in torch.nonzero(bad).view(-1).tolist()})
        return (f"the features of image(s) {', '.join(named[:5])}{' …' if len(named) > 5 else ''} are not finite "
                f"(loss {loss} at {where}); run `retr-pipeline verify {run.cfg.features}` and re-extract them")
    return (f"the loss became {loss} at {where} (batch images {', '.join(ids[:3])} …); try a lower --lr or "
            "--grad-clip; the run stays at its last checkpoint (--resume continues from there)")


def validate(run: Run, quiet: bool = False) -> dict:
    """Validation metrics of the model as it is evaluated: two-step for models with a shortlist. Its encoding and
    scoring show progress as ``validation: …`` bars (unless ``quiet``)."""
    model = run.model
    with stage("validation"):
        if model.shortlist:
            return two_step_split(model, run.val_data, run.val_feats, run.device, model.shortlist, "mixed",
                                  quiet=quiet)["two_step"]
        sims = similarity_matrix(model, run.val_data, run.val_feats, run.device, precision="refined", quiet=quiet)
    return retrieval_metrics(sims, run.val_data.caption_image)


# ------------------------------------------------------------------------------------------------ save

def save_epoch(run: Run, epoch: int, is_best: bool, losses: list[float], val: dict, seconds: float) -> None:
    """Metrics line, scheduler step, ``checkpoint-NNN.pt`` (and ``best.pt``), pruning, one log line."""
    run.log.epoch(epoch, run.step, losses, run.epoch_pairs, run.optimizer.param_groups[0]["lr"], val, is_best,
                  seconds)
    run.scheduler.step()
    state = {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
             "scheduler": run.scheduler.state_dict(),
             "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
             "vocab": run.vocab.to_json(), "epoch": epoch, "step": run.step, "best_rsum": run.best_rsum,
             "best_epoch": run.best_epoch, "rng": ckpt.rng_state(), "config": run.cfg.as_stored(),
             "collapse_monitor": run.monitor.state_dict(),
             **({"ema": run.ema.state_dict()} if run.ema is not None else {})}
    # best.pt before the epoch checkpoint: a run killed between the two redoes the epoch and rewrites both
    if is_best:
        ckpt.save_checkpoint(run.folder / BEST, state)
    if run.ema is not None:         # the averaged weights as a checkpoint of their own (eval --checkpoint ema.pt)
        ckpt.save_checkpoint(run.folder / EMA, {**state, "model": run.ema.module.state_dict()})
    path = ckpt.save_checkpoint(ckpt.checkpoint_path(run.folder, epoch), state)
    ckpt.prune_checkpoints(run.folder, run.cfg.keep_checkpoints)
    logger.info(f"epoch {epoch + 1}/{run.cfg.epochs}: loss {np.mean(losses):.4f}, val rsum {val['rsum']:.1f} "
        f"(i2t R@1 {val['i2t']['r1']:.1f}, t2i R@1 {val['t2i']['r1']:.1f}){' best' if is_best else ''} "
        f"→ {path.name}")


def report_val_at_chance(run: Run, val: dict, epoch: int) -> None:
    """At the end of training: one warning line (and a ``metrics.jsonl`` event) when the last validation recall
    is no better than a random ordering of the validation split."""
    event = recall_at_chance(val, run.val_data.caption_image)
    if event is not None:
        run.log.event({**event, "step": run.step}, epoch)
        logger.warning(val_at_chance_message(event, epoch + 1))


def should_stop(run: Run, epoch: int) -> bool:
    """Early stop (``early_stop`` epochs without a better validation rSum), decided by rank 0 for all ranks."""
    cfg, info = run.cfg, run.info
    stop = info.is_main and run.early_stop_due(epoch)
    if info.enabled:
        flag = torch.tensor([int(stop)], device=run.device)
        torch.distributed.broadcast(flag, src=0)
        stop = bool(flag.item())
    barrier(info)
    if stop and info.is_main:
        logger.info(f"early stop: no better validation rSum for {cfg.early_stop} epochs "
            f"(best {run.best_rsum:.1f} at epoch {run.best_epoch + 1})")
    return stop
