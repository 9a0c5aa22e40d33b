"""``retr-pipeline extract`` (one extractor, with the ``butd-regions`` options :data:`BUTD_OPTIONS`) and
``extract-preset`` (fetch or generate the dataset and weights, then every extractor; docs/extraction.md).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import click

from retr.common.cli import InputPath, LazyChoice, OutputPath, error_message, quiet_option
from retr.common.downloads import is_offline
from retr.common.errors import MissingResourceError, ParameterError, RetrError, UserError
from retr.manifests.schema import read_manifest
from retr.pipeline.commands.fetch import apply_network_options, network_options
from retr.pipeline.weights import ensure_weights, weights_catalog, weights_items
from retr.common.devices import resolve_device
from retr.manifests.fetch import fetch_dataset
from retr.manifests.presets import SYNTHETIC_IMAGES, get_preset
from retr.manifests.synthetic import generate_synthetic


# ------------------------------------------------------------------------------------------------ butd-regions
# The options of the ``butd-regions`` extractor, added to ``extract``. The extractor itself
# (:func:`retr.extractors.butd.extractor.build_butd_regions`) takes these as plain keyword arguments; each option's
# parameter name is the builder's, so the command passes them on unchanged and the builder's errors
# (``post_nms_topk … must be at least max_boxes``) come back in these flags. Every option defaults to None (or
# off), meaning "the extractor's own default"; the original's settings are the defaults, and the
# size/proposal/pool options below them are documented speed options.

BUTD_OPTIONS = [
    click.option("--short-side", type=int, default=None,
                 help="butd-regions: Caffe scaling target of the short side (default 600)."),
    click.option("--max-side", type=int, default=None,
                 help="butd-regions: cap on the long side (default 1000)."),
    click.option("--pre-nms-topk", type=int, default=None,
                 help="butd-regions: RPN boxes kept before NMS (default 6000)."),
    click.option("--post-nms-topk", type=int, default=None,
                 help="butd-regions: proposals kept after NMS (default 300; fewer is faster, must be >= --max-boxes)."),
    click.option("--pooled-size", type=int, default=None,
                 help="butd-regions: ROI pool side before res5 (default 14; 7 is ~4x faster, not the original)."),
    click.option("--min-boxes", type=int, default=None, help="butd-regions: MIN_BOXES (default 36)."),
    click.option("--max-boxes", type=int, default=None, help="butd-regions: MAX_BOXES (default 36)."),
    click.option("--conf-threshold", type=float, default=None,
                 help="butd-regions: max_conf threshold of the box selection (default 0.2)."),
    click.option("--object-vocab", type=InputPath("file", "a vocabulary file, one name a line"), default=None,
                 help="butd-regions: objects_vocab.txt (1600 lines), recorded in the feature set."),
    click.option("--attr-vocab", type=InputPath("file", "a vocabulary file, one name a line"), default=None,
                 help="butd-regions: attributes_vocab.txt (400 lines), recorded in the feature set."),
    click.option("--detector-batch", type=click.IntRange(min=1), default=None,
                 help="butd-regions: images per detector forward, padded to the largest (default 4 on CUDA, 1 on "
                      "CPU; at most --batch-size). Each image's regions are its one-image forward's up to the "
                      "convolution library's summation order; recorded in the feature set."),
    click.option("--allow-partial", is_flag=True,
                 help="butd-regions: load a checkpoint even if keys are missing or unexpected."),
    click.option("--trust-checkpoint", is_flag=True,
                 help="butd-regions: allow a checkpoint holding Python objects beyond tensors (trusted files only)."),
]


def butd_options(f: Callable) -> Callable:
    """Decorate a click command with :data:`BUTD_OPTIONS` (passed on as keyword arguments)."""
    for option in reversed(BUTD_OPTIONS):
        f = option(f)
    return f


# torch (behind the extractors and the stage) is imported when an extraction runs or its choices are listed,
# not when retr-pipeline starts: every other command starts in a fraction of the time and memory.
def available_extractors() -> list[str]:
    """The registered extractor names (:func:`retr.extractors.base.available_extractors`)."""
    from retr.extractors.base import available_extractors as names  # cost: torch (retr-pipeline --help loads none)
    return names()


class RegisteredExtractors(LazyChoice):
    """``--extractor``'s choices: the registry's names each time click needs them (imported on the first, not when
    ``retr-pipeline`` starts), so an extractor registered later in the process is a choice too."""

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self._names())

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ assigns (); the registry's names win
        pass


def extract_features(*args: Any, **kwargs: Any):
    """The extraction stage (:func:`retr.pipeline.extract.extract_features`)."""
    from retr.pipeline.extract import extract_features as run  # cost: torch
    return run(*args, **kwargs)


def _run_options(f):
    """Options shared by both commands: weights, batching, device, precision (each adds its own --image-root)."""
    options = [
        click.option("--weights", default=None,
                     help="imagenet | a torchvision weight name (e.g. IMAGENET1K_V2) | random | PATH to a state "
                          "dict (clip-*: openai or another open_clip tag). Default: the extractor's own (imagenet "
                          "for the torchvision backbones, openai for clip-*), "
                          "downloaded on first use unless --offline."),
        click.option("--batch-size", type=int, default=8, show_default=True, help="Images per network call."),
        click.option("--workers", type=int, default=2, show_default=True,
                     help="DataLoader processes decoding images while the network runs (0: decode in-process)."),
        click.option("--device", default="auto", show_default=True, help="auto (cuda if any), cpu, cuda or cuda:N."),
        click.option("--half", is_flag=True, help="Run the network in float16 (CUDA only)."),
        click.option("--decode", type=click.Choice(["auto", "cpu", "device"]), default="auto", show_default=True,
                     help="Where images are decoded: cpu (Pillow in the workers), device (JPEGs in batches with "
                          "torchvision's decode_jpeg on the extraction device, others by Pillow), auto (device on "
                          "CUDA, else cpu). Backbone extractors only."),
        click.option("--autocast", type=click.Choice(["none", "bfloat16", "float16"]), default="none",
                     show_default=True,
                     help="Run the float32 network under torch.autocast in this dtype (CPU and CUDA; not with "
                          "--half). Backbone extractors only."),
        click.option("--channels-last", is_flag=True,
                     help="Network and inputs in channels-last memory format. Backbone extractors only."),
        click.option("--tf32", is_flag=True,
                     help="Run with PyTorch's default float32 settings on CUDA, which let cuDNN's convolutions use "
                          "TF32 (faster: butd-regions about 3x on an H200, but a batch then keeps other boxes than "
                          "its images alone); default: exact float32, the CPU's features to rounding. Recorded in "
                          "the feature set."),
        click.option("--dtype", type=click.Choice(["float16", "float32"]), default="float16", show_default=True,
                     help="On-disk type of the features."),
        click.option("--num-shards", type=int, default=None,
                     help="Split the manifest into this many shards (contiguous rows). Under torchrun: the world "
                          "size unless given."),
        click.option("--allow-outside-root", is_flag=True,
                     help="Read manifest paths that leave the image root (absolute, or '..' above it); by "
                          "default they are recorded in errors, unread."),
        network_options,
        quiet_option,
    ]
    for option in reversed(options):
        f = option(f)
    return f


#: Options of the backbone extractors' image path, given on the command line for all of a preset's extractors.
IMAGE_PATH_OPTIONS = ("decode", "autocast", "channels_last")


def _builder_options(weights: str | None, device: str, half: bool, decode: str = "auto", autocast: str = "none",
                     channels_last: bool = False, **specific: Any) -> dict[str, Any]:
    """Options for the extractor builder: only what the user set, so each builder keeps its own defaults (and an
    extractor without the option — butd-regions has no ``decode`` — is asked for it only when it is given)."""
    options: dict[str, Any] = {"device": str(resolve_device(device))}     # "auto": cuda when there is one
    if weights is not None:
        options["weights"] = weights
    if half:
        options["half"] = True
    if decode != "auto":
        options["decode"] = decode
    if autocast != "none":
        options["autocast"] = autocast
    if channels_last:
        options["channels_last"] = True
    options.update({k: v for k, v in specific.items() if v is not None and v is not False})
    return options


@click.command("extract")
@click.option("--manifest", type=InputPath("file", "a JSON Lines manifest", path_type=Path), required=True,
              help="The dataset manifest (JSON Lines).")
@click.option("--extractor", "name", type=RegisteredExtractors(lambda: available_extractors()), required=True,
              help="The registered extractor to run.")
@click.option("--out", type=OutputPath("folder", path_type=Path), required=True,
              help="Features folder: writes OUT/NAME/shard-*.h5 and the index OUT/NAME.h5.")
@click.option("--shard-index", type=int, default=None, help="Run only this shard (with --num-shards).")
@click.option("--image-size", type=int, default=None,
              help="Input side in pixels: the square resize for grid/maps (default 448), the crop side for "
                   "tencrop (default 224; 299 for tencrop-irv2).")
@click.option("--grid-size", type=int, default=None,
              help="resnet152-grid only: 7 (default; 448 input pooled 2×2) or 14 (the raw res5c map).")
@click.option("--exif-orientation", is_flag=True,
              help="Rotate images by their EXIF orientation tag (off by default, like the published features).")
@butd_options
@_run_options
@click.option("--image-root", type=InputPath("folder", "a folder of images", path_type=Path), default=None,
              help="Folder the manifest's image paths are relative to (default: the manifest's folder).")
def extract_command(manifest: Path, name: str, out: Path, shard_index: int | None, image_size: int | None,
                    grid_size: int | None, exif_orientation: bool, weights: str | None, batch_size: int,
                    workers: int, device: str, half: bool, decode: str, autocast: str, channels_last: bool,
                    dtype: str, num_shards: int | None, image_root: Path | None, allow_outside_root: bool,
                    offline: bool, mirror: str | None, quiet: bool, **butd: Any) -> None:
    """Extract one feature set from the images of a manifest (sharded, resumable).

    Writes OUT/NAME/shard-RRRRR-of-WWWWW.h5 (each renamed into place when complete) and, once every shard
    exists, the index OUT/NAME.h5. Re-running skips complete shards. Images that cannot be read are listed
    in the feature set's errors and the run goes on. Under torchrun, rank r of w takes shard r. Default
    weights not yet cached are downloaded on first use (see retr-pipeline fetch-weights), unless --offline.

    \b
    Example:
      retr-pipeline extract --manifest data/synthetic/manifest.jsonl \\
          --extractor resnet152-grid --out data/synthetic/features --weights random
      torchrun --nproc-per-node 2 --no-python retr-pipeline extract \\
          --manifest data/coco/manifest.jsonl --extractor vgg16-maps --out data/coco/features
    """
    apply_network_options(offline, mirror)
    options = _builder_options(weights, device, half, decode, autocast, channels_last, image_size=image_size,
                               grid_size=grid_size, exif_orientation=exif_orientation, **butd)
    summary = extract_features(manifest, name, out, image_root=image_root, options=options, batch_size=batch_size,
                               workers=workers, num_shards=num_shards, shard_index=shard_index, dtype=dtype,
                               quiet=quiet, allow_outside_root=allow_outside_root)
    click.echo(summary.line())


@click.command("extract-preset")
@click.argument("dataset")
@click.option("--manifest", type=InputPath("file", "a JSON Lines manifest", path_type=Path), default=None,
              help="Use this manifest instead of the preset's.")
@click.option("--out", type=OutputPath("folder", path_type=Path), default=None,
              help="Use this features folder instead of the preset's.")
@click.option("--only", "only", multiple=True, help="Run only this extractor (repeatable).")
@_run_options
@click.option("--image-root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Use this image folder instead of the preset's (made when the preset's images are fetched).")
def extract_preset_command(dataset: str, manifest: Path | None, out: Path | None, only: tuple[str, ...],
                           weights: str | None, batch_size: int, workers: int, device: str, half: bool,
                           decode: str, autocast: str, channels_last: bool, tf32: bool, dtype: str,
                           num_shards: int | None, image_root: Path | None, allow_outside_root: bool,
                           offline: bool, mirror: str | None, quiet: bool) -> None:
    """Run every extractor of a dataset preset (coco, f30k, synthetic) into its features folder, in turn.

    From nothing to features: when the preset's manifest is missing, coco is fetched first (retr-pipeline
    fetch-data coco: images, splits, manifest), f30k asks for its gated images (fetch-data f30k --images-zip),
    synthetic is generated (240 images; extracted with random weights at the demo's CPU sizes, no network).
    Then every missing weight file is downloaded (retr-pipeline fetch-weights), and the extractors run.
    With --offline (or RETR_OFFLINE=1) a missing dataset or missing weights stop it before anything runs, in
    one line naming the command to run on a connected machine.

    An extractor that is not available in this installation is reported and skipped; one that fails is
    reported in one line and the others still run; the exit status is non-zero if any failed.

    \b
    Example:
      retr-pipeline extract-preset coco --device cuda
      retr-pipeline extract-preset synthetic --only vgg16-maps
    """
    apply_network_options(offline, mirror)
    preset = get_preset(dataset, images=image_root, manifest=manifest, features=out)
    if manifest is None and not preset.manifest.exists():
        _make_dataset(preset, mirror, quiet)
    records = read_manifest(preset.manifest)
    if not records:  # a bad manifest is one error here, not one per extractor
        raise UserError(f"manifest {preset.manifest} has no images")
    if manifest is None:
        _check_images(preset, records)
    names = list(only) if only else list(preset.extractors)
    registered = available_extractors()
    unknown = [n for n in only if n not in preset.extractors and n not in registered]
    if unknown:
        raise UserError(f"unknown extractor {unknown[0]!r} (the {dataset} preset runs {', '.join(preset.extractors)})")
    runnable = [name for name in names if name in registered]
    plans = {name: _preset_options(preset, name, weights) for name in runnable}
    by_extractor = weights_catalog().extractors
    needed = sorted({by_extractor[name] for name, (w, _) in plans.items()
                     if name in by_extractor and w in (None, "imagenet")})
    if needed:   # every missing weight file at once: offline, one line for all of them
        ensure_weights(weights_items(needed), quiet=quiet, mirror=mirror)
    from retr.extractors.base import declared_options  # cost: torch

    failed = []
    for name in names:
        if name not in registered:
            click.echo(f"{name}: not available yet in this installation (no extractor registered under that name); "
                       f"skipped")
            continue
        name_weights, specific = plans[name]
        options = _builder_options(name_weights, device, half, decode, autocast, channels_last, tf32=tf32,
                                   **specific)
        not_applying = sorted(set(options) & {*IMAGE_PATH_OPTIONS, "tf32"} - declared_options(name))
        if not_applying:     # the backbones' image-path options: a preset runs butd-regions beside them
            for option in not_applying:
                del options[option]
            if not quiet:
                click.echo(f"{name}: {', '.join('--' + o.replace('_', '-') for o in not_applying)} "
                           f"not used by this extractor", err=True)
        try:
            summary = extract_features(preset.manifest, name, preset.features, image_root=preset.images,
                                       options=options, batch_size=batch_size, workers=workers,
                                       num_shards=num_shards, dtype=dtype, quiet=quiet,
                                       allow_outside_root=allow_outside_root)
        except (RetrError, ParameterError) as exc:
            failed.append(name)
            click.echo(f"{name}: error: {error_message(exc)}", err=True)
            continue
        click.echo(summary.line())
    if failed:
        raise UserError(f"{len(failed)} of {len(names)} extractors failed: {', '.join(failed)}")


def _preset_options(preset, name: str, weights: str | None) -> tuple[str | None, dict[str, Any]]:
    """``(weights, other builder options)`` of one extractor: the flag's weights, else the preset's; the
    preset's other options (the synthetic preset's sizes)."""
    specific = dict(preset.extract_options.get(name, {}))
    preset_weights = specific.pop("weights", None)
    return (weights if weights is not None else preset_weights), specific


def _make_dataset(preset, mirror: str | None, quiet: bool) -> None:
    """The preset's manifest is missing: generate (synthetic) or fetch (coco, f30k) the dataset, or say in one
    line which command does."""
    if preset.generated:
        folder = preset.manifest.parent
        if preset.manifest.name != "manifest.jsonl":
            raise UserError(f"manifest {preset.manifest} does not exist; run retr-pipeline synth --out FOLDER and "
                            f"point RETR_SYNTHETIC_MANIFEST at FOLDER/manifest.jsonl")
        click.echo(f"{preset.manifest} does not exist: generating the synthetic dataset ({SYNTHETIC_IMAGES} images) "
                   f"in {folder}", err=True)
        generate_synthetic(folder, num_images=SYNTHETIC_IMAGES, seed=0)
        return
    if not preset.fetchable:
        raise UserError(f"manifest {preset.manifest} does not exist")

    command = f"retr-pipeline fetch-data {preset.name}" + (" --images-zip FILE" if preset.name == "f30k" else "")
    if is_offline():
        raise MissingResourceError(f"the {preset.name} dataset (manifest {preset.manifest.name})",
                                   str(preset.manifest.parent),
                                   f"run {command} on a connected machine (RETR_OFFLINE is set, so retr does not "
                                   f"download here) and copy {preset.manifest.parent} over")
    click.echo(f"{preset.manifest} does not exist: fetching {preset.name} ({command})", err=True)
    summary = fetch_dataset(preset.name, mirror=mirror, quiet=quiet)
    click.echo(summary.line(), err=True)


def _check_images(preset, records, probe: int = 20) -> None:
    """One line when none of the first ``probe`` images of the preset's manifest is on disk (every extractor
    would record them all as errors); names fetch-data for a fetchable preset."""
    root = preset.images
    if any((root / r.path).is_file() for r in records[:probe]):
        return
    how = (f"; run retr-pipeline fetch-data {preset.name}" + (" --images-zip FILE" if preset.name == "f30k" else "")
           if preset.fetchable else "; give the image folder with --image-root")
    raise UserError(f"none of the first {min(probe, len(records))} images of {preset.manifest} is under {root} "
                    f"(e.g. {records[0].path}){how}")
