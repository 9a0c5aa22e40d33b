"""Every command's paths, given wrong as users give them: each input that does not exist, a folder where a file goes
and a file where a folder goes; each output in a read-only folder (made by this module: permissions, or a read-only
mount where the tests run as root, whom permissions do not stop), under ``/proc``, below a file, a file where a
folder goes and a folder where a file goes, and a non-empty folder that is not what the command writes. Each case is
one ``error:`` line naming the option and saying which mistake it is, before any work, and leaves every file as it
was and nothing new behind.

The cases are :data:`SLOTS` × the wrong values of each slot's kind (:data:`WRONG`): one table, and
:func:`test_every_path_option_is_in_the_table` fails for a command or path option it does not list, so the next one
gets the same treatment. Every case runs through the console scripts' entry point in this process, from a folder
of its own with relative paths (as a shell would); a sample of them runs as the installed console scripts too.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import click
import pytest

from test_pipeline_wrong_inputs import assert_one_error_line
from trainer_synthetic import write_trees_and_concepts

TINY = ["--embed-size", "16", "--word-dim", "8", "--batch-size", "16", "--epochs", "1", "--val-images", "10",
        "--device", "cpu", "--quiet"]
#: what each model needs beyond TINY to reach the check under test on the 4-region synthetic features
MODEL_EXTRA = {"jgcar": ["--num-regions", "4"],
               "smfea": ["--trees", "data/trees.h5", "--concepts", "data/concepts.h5", "--num-regions", "4"]}
#: the correct inputs the cases use for the paths not under test (relative to the module's folder)
F, M, RUN, IMAGES, CONLLU = "data/scene-regions.h5", "data/manifest.jsonl", "run", "data/images", "data/captions.conllu"


@dataclass(frozen=True)
class Slot:
    """One path a command takes: ``program`` and ``command``, ``name`` as the message writes it (an option's flag,
    an argument's metavar), its ``kind`` (a key of :data:`WRONG`), ``argv(value)`` the command line with ``value``
    in that place, and for a folder a command fills with its own layout, ``refusal``: the telling part of the line
    refusing a non-empty folder of other files."""

    program: str
    command: str
    name: str
    kind: str
    argv: Callable[[str], list]
    refusal: str | None = None

    @property
    def key(self) -> str:
        return f"{self.program} {self.command} {self.name}"


#: kind → {wrong value's label: (the value, the error's telling part)}; ``{name}``, ``{value}``: the slot's
WRONG = {
    "in-file": {"absent": ("nowhere/thing.txt", "{name} {value} does not exist"),
                "a folder": ("full", "{name} {value} is a folder, not ")},
    # a checkpoint file or a released model's folder holding model_best.pth
    "in-checkpoint": {"absent": ("nowhere/thing.txt", "{name} {value} does not exist"),
                      "a folder": ("full", "checkpoint folder {value} holds no model_best.pth")},
    "in-folder": {"absent": ("nowhere/folder", "{name} {value} does not exist"),
                  "a file": ("a-file", "{name} {value} is a file, not ")},
    # a download the user makes (annotations, parser models): absent, the missing-resource line (what, where, how)
    "in-resource-file": {"absent": ("nowhere/thing.txt", "not found (looked in nowhere)"),
                         "a folder": ("full", "{name} {value} is a folder, not ")},
    "in-resource-folder": {"absent": ("nowhere/folder", "not found (looked in nowhere/folder"),
                           "a file": ("a-file", "{name} {value} is a file, not ")},
    # a download given as its files, its folder or its archive: any of them exists is right
    "in-resource-any": {"absent": ("nowhere/thing.txt", "not found (looked in nowhere)")},
    "in-run": {"absent": ("nowhere/run", "{name} {value} does not exist"),
               "a file": ("a-file", "{name} {value} is a file, not "),
               "no run": ("full", "{name} {value} holds no config.json, so it is not a run folder")},
    "in-trained-run": {"absent": ("nowhere/run", "{name} {value} does not exist"),
                       "a file": ("a-file", "{name} {value} is a file, not "),
                       "no run": ("full", "{name} {value} holds no metrics.jsonl, so it is not a training run")},
    "out-file": {"read-only": ("ro/new.out", "{name} {value}: cannot write in ro ("),
                 "/proc": ("/proc/retr-test/new.out", "{name} {value}: cannot write in /proc ("),
                 "below a file": ("a-file/new.out", "{name} {value}: a-file is a file, so the file cannot be made"),
                 "a folder": ("full", "{name} {value} is a folder, not a file")},
    "out-folder": {"read-only": ("ro/new", "{name} {value}: cannot write in ro ("),
                   "/proc": ("/proc/retr-test/new", "{name} {value}: cannot write in /proc ("),
                   "below a file": ("a-file/new", "{name} {value}: a-file is a file, so the folder cannot be made"),
                   "a file": ("a-file", "{name} {value} is a file, not a folder")},
    # a folder the command fills with its own layout: the above, and a folder of other files
    "out-own-folder": {"not empty": ("full", "{refusal}")},
    # `retr-pipeline index FOLDER` writes FOLDER.h5 beside the folder it reads
    "out-beside": {"read-only": ("ro/shards", "the index ro/shards.h5: cannot write in ro ("),
                   "/proc": ("/proc/self", "the index /proc/self.h5: cannot write in /proc ("),
                   "a folder": ("full", "the index full.h5 is a folder, not a file")},
}
WRONG["out-own-folder"] = {**WRONG["out-folder"], **WRONG["out-own-folder"]}


def _train_slots() -> list[Slot]:
    """Every model's command: its data and output settings (checked before the first step), its side files and
    ``--config`` (checked when parsed)."""
    from retr.trainers.models import get_spec, list_models

    slots = []
    for model in list_models():
        extra = MODEL_EXTRA.get(model, [])

        def train(flag, value, model=model, extra=extra):
            given = {"--features": F, "--manifest": M, "--out": "made/run",
                     **dict(zip(extra[::2], extra[1::2])), flag: value}
            return [model, *[x for pair in given.items() for x in pair], *TINY]

        slots += [Slot("retr-train", model, "--features", "in-file", lambda v, t=train: t("--features", v)),
                  Slot("retr-train", model, "--manifest", "in-file", lambda v, t=train: t("--manifest", v)),
                  Slot("retr-train", model, "--out", "out-own-folder", lambda v, t=train: t("--out", v),
                       "{name} {value} is not empty and is not a run (1 entry: notes.txt)"),
                  Slot("retr-train", model, "--vocab", "in-file", lambda v, t=train: t("--vocab", v)),
                  *([Slot("retr-train", model, "--word-vectors", "in-file",
                          lambda v, t=train: t("--word-vectors", v))]
                    if "word_vectors" in get_spec(model).setting_names else []),
                  Slot("retr-train", model, "--config", "in-file",
                       lambda v, model=model: [model, "--config", v, "--out", "made/config"])]
        for side in get_spec(model).inputs:
            flag = "--" + side.name.replace("_", "-")
            slots.append(Slot("retr-train", model, flag, "in-file", lambda v, t=train, f=flag: t(f, v)))
    return slots


def _trainer_slots() -> list[Slot]:
    protocol = ["--protocol", "f30k-1k", "--allow-size-mismatch", "--device", "cpu", "--quiet"]
    eval_ = lambda *a: ["eval", *a, *protocol]                                           # noqa: E731
    clip = lambda *a: ["eval-clip", *a, *protocol]                                       # noqa: E731
    show = lambda *a: ["show", *a, *protocol]                                            # noqa: E731
    search = lambda *a: ["search", *a, "--query", "a red circle", "--device", "cpu", "--quiet"]     # noqa: E731
    serve = lambda *a: ["serve", *a, "--port", "0", "--quiet"]                          # noqa: E731
    index = lambda *a: ["index", *a, "--device", "cpu", "--workers", "0", "--quiet"]    # noqa: E731
    recipe = lambda flag, v: ["reproduce", "scan-f30k-t2i-avg", *[x for pair in {  # noqa: E731
        "--features": F, "--manifest": M, "--out": "made/runs", flag: v}.items() for x in pair]]
    t = "retr-train"
    slots = [
        Slot(t, "eval", "RUNS", "in-run", lambda v: eval_(v)),
        Slot(t, "eval", "--features", "in-file", lambda v: eval_(RUN, "--features", v)),
        Slot(t, "eval", "--manifest", "in-file", lambda v: eval_(RUN, "--manifest", v)),
        Slot(t, "eval", "--save-sims", "out-file", lambda v: eval_(RUN, "--save-sims", v)),
        # any file stands for the matrix where another path is under test: the paths are checked when parsed
        Slot(t, "eval-sims", "FILE.npy", "in-file", lambda v: ["eval-sims", v]),
        Slot(t, "eval-sims", "--ids", "in-file", lambda v: ["eval-sims", M, "--ids", v]),
        Slot(t, "eval-sims", "--manifest", "in-file", lambda v: ["eval-sims", M, "--manifest", v]),
        Slot(t, "eval-clip", "--features", "in-file", lambda v: clip("--features", v, "--manifest", M)),
        Slot(t, "eval-clip", "--manifest", "in-file", lambda v: clip("--features", F, "--manifest", v)),
        Slot(t, "eval-clip", "--weights", "in-file", lambda v: clip("--features", F, "--manifest", M, "--weights", v)),
        Slot(t, "table", "RUNS", "in-run", lambda v: ["table", v]),
        Slot(t, "export", "RUN", "in-run", lambda v: ["export", v, "--out", "made/export"]),
        Slot(t, "export", "--out", "out-own-folder", lambda v: ["export", RUN, "--out", v],
             "{name} {value} is not empty; give a new folder for the export"),
        Slot(t, "push", "RUN", "in-run", lambda v: ["push", v, "--repo", "my-lab/model"]),
        Slot(t, "plot", "RUNS", "in-trained-run", lambda v: ["plot", v, "--out", "made/curves.png"]),
        Slot(t, "plot", "--out", "out-file", lambda v: ["plot", RUN, "--out", v]),
        Slot(t, "show", "RUNS", "in-run", lambda v: show(v, "--out", "made/report")),
        Slot(t, "show", "--out", "out-own-folder", lambda v: show(RUN, "--out", v),
             "{name} {value} is not empty and is not a report (1 entry: notes.txt)"),
        Slot(t, "show", "--image-root", "in-folder", lambda v: show(RUN, "--out", "made/report", "--image-root", v)),
        Slot(t, "show", "--features", "in-file", lambda v: show(RUN, "--out", "made/report", "--features", v)),
        Slot(t, "show", "--manifest", "in-file", lambda v: show(RUN, "--out", "made/report", "--manifest", v)),
        Slot(t, "show", "--sims", "in-file", lambda v: show(RUN, "--out", "made/report", "--sims", v)),
        Slot(t, "search", "RUN", "in-run", lambda v: search(v)),
        Slot(t, "search", "--index", "in-folder", lambda v: search(RUN, "--index", v)),
        Slot(t, "search", "--images", "in-folder", lambda v: search(RUN, "--images", v)),
        Slot(t, "search", "--extractor-weights", "in-file", lambda v: search(RUN, "--extractor-weights", v)),
        Slot(t, "search", "--features", "in-file", lambda v: search(RUN, "--features", v)),
        Slot(t, "search", "--manifest", "in-file", lambda v: search(RUN, "--manifest", v)),
        Slot(t, "serve", "RUN", "in-run", lambda v: serve(v)),
        Slot(t, "serve", "--index", "in-folder", lambda v: serve(RUN, "--index", v)),
        Slot(t, "serve", "--features", "in-file", lambda v: serve(RUN, "--features", v)),
        Slot(t, "serve", "--manifest", "in-file", lambda v: serve(RUN, "--manifest", v)),
        Slot(t, "serve", "--image-root", "in-folder", lambda v: serve(RUN, "--image-root", v)),
        Slot(t, "index", "RUN", "in-run", lambda v: index(v, "--images", IMAGES, "--out", "made/index")),
        Slot(t, "index", "--images", "in-folder", lambda v: index(RUN, "--images", v, "--out", "made/index")),
        Slot(t, "index", "--manifest", "in-file", lambda v: index(RUN, "--manifest", v, "--out", "made/index")),
        Slot(t, "index", "--image-root", "in-folder",
             lambda v: index(RUN, "--manifest", M, "--image-root", v, "--out", "made/index")),
        Slot(t, "index", "--out", "out-own-folder", lambda v: index(RUN, "--images", IMAGES, "--out", v),
             "{value} is not a gallery index (no meta.json) and holds other files"),
        Slot(t, "index", "--features", "in-file",
             lambda v: index(RUN, "--images", IMAGES, "--out", "made/index", "--features", v)),
        Slot(t, "index", "--extractor-weights", "in-file",
             lambda v: index(RUN, "--images", IMAGES, "--out", "made/index", "--extractor-weights", v)),
        *[Slot(t, "reproduce", flag, "out-folder" if flag == "--out" else "in-file",
               lambda v, flag=flag: recipe(flag, v))
          for flag in ("--features", "--manifest", "--out", "--trees", "--concepts", "--concept-vectors",
                       "--labels")],
    ]
    for command in ("import-scan-checkpoint", "import-vsepp-checkpoint", "import-vse-infinity-checkpoint"):
        def imported(checkpoint="run/best.pt", vocab="run/vocab.json", out="made/imported", command=command):
            return [command, checkpoint, "--vocab", vocab, "--out", out]
        kind = "in-checkpoint" if command == "import-vse-infinity-checkpoint" else "in-file"
        slots += [Slot(t, command, "CHECKPOINT", kind, lambda v, i=imported: i(checkpoint=v)),
                  Slot(t, command, "--vocab", "in-file", lambda v, i=imported: i(vocab=v)),
                  Slot(t, command, "--out", "out-own-folder", lambda v, i=imported: i(out=v),
                       "{name} {value} is not empty and is not a run (1 entry: notes.txt)")]
    return slots + _train_slots()


def _pipeline_slots() -> list[Slot]:
    p = "retr-pipeline"
    extract = lambda *a: ["extract", "--extractor", "tencrop-resnet152", "--weights", "random",  # noqa: E731
                          "--workers", "0", "--quiet", *a]
    concepts = lambda *a: ["build-concepts", *a, "--select", "frequency"]                          # noqa: E731
    trees = lambda *a: ["parse-trees", *a, "--quiet"]                                              # noqa: E731
    coco = lambda *a: ["labels", "coco", *a]                                                       # noqa: E731
    f30k = lambda *a: ["labels", "f30k-entities", *a]                                              # noqa: E731
    return [
        Slot(p, "build-concepts", "--manifest", "in-file", lambda v: concepts("--manifest", v, "--out", "made/c.h5")),
        Slot(p, "build-concepts", "--out", "out-file", lambda v: concepts("--manifest", M, "--out", v)),
        Slot(p, "build-concepts", "--conllu", "in-file",
             lambda v: ["build-concepts", "--manifest", M, "--conllu", v, "--out", "made/c.h5"]),
        Slot(p, "extract", "--manifest", "in-file", lambda v: extract("--manifest", v, "--out", "made/f")),
        Slot(p, "extract", "--out", "out-folder", lambda v: extract("--manifest", M, "--out", v)),
        Slot(p, "extract", "--object-vocab", "in-file",
             lambda v: extract("--manifest", M, "--out", "made/f", "--object-vocab", v)),
        Slot(p, "extract", "--attr-vocab", "in-file",
             lambda v: extract("--manifest", M, "--out", "made/f", "--attr-vocab", v)),
        Slot(p, "extract", "--image-root", "in-folder",
             lambda v: extract("--manifest", M, "--out", "made/f", "--image-root", v)),
        Slot(p, "extract-preset", "--manifest", "in-file",
             lambda v: ["extract-preset", "synthetic", "--manifest", v, "--out", "made/f", "--quiet"]),
        Slot(p, "extract-preset", "--out", "out-folder",
             lambda v: ["extract-preset", "synthetic", "--manifest", M, "--out", v, "--quiet"]),
        Slot(p, "fetch-data", "--root", "out-folder", lambda v: ["fetch-data", "coco", "--root", v, "--quiet"]),
        Slot(p, "fetch-data", "--images-zip", "in-file",
             lambda v: ["fetch-data", "f30k", "--root", "made/f30k", "--images-zip", v, "--quiet"]),
        Slot(p, "fetch-parser-models", "MODEL_DIR", "out-folder", lambda v: ["fetch-parser-models", v]),
        Slot(p, "fetch-weights", "--stanza-dir", "out-folder",
             lambda v: ["fetch-weights", "stanza", "--stanza-dir", v]),
        Slot(p, "import-npz", "FOLDER", "in-folder", lambda v: ["import-npz", v, "--out", "made/f", "--quiet"]),
        Slot(p, "import-npz", "--out", "out-folder", lambda v: ["import-npz", "data", "--out", v, "--quiet"]),
        Slot(p, "import-scan", "DATA_DIR", "in-folder", lambda v: ["import-scan", v, "--out", "made/s", "--quiet"]),
        Slot(p, "import-scan", "--data-dir", "in-folder",
             lambda v: ["import-scan", "--data-dir", v, "--out", "made/s", "--quiet"]),
        Slot(p, "import-scan", "--out", "out-folder", lambda v: ["import-scan", "data", "--out", v, "--quiet"]),
        Slot(p, "import-tsv", "TSV", "in-file", lambda v: ["import-tsv", v, "--out", "made/f", "--quiet"]),
        Slot(p, "import-tsv", "--out", "out-folder", lambda v: ["import-tsv", CONLLU, "--out", v, "--quiet"]),
        Slot(p, "index", "FOLDER", "in-folder", lambda v: ["index", v]),
        Slot(p, "index", "the index", "out-beside", lambda v: ["index", v]),
        Slot(p, "inspect", "PATHS", "in-file", lambda v: ["inspect", F, v]),
        Slot(p, "labels coco", "--instances", "in-resource-file",
             lambda v: coco("--instances", v, "--manifest", M, "--out", "made/l.json")),
        Slot(p, "labels coco", "MORE_INSTANCES", "in-resource-file",
             lambda v: coco("--instances", "data/instances.json", v, "--manifest", M, "--out", "made/l.json")),
        Slot(p, "labels coco", "--manifest", "in-file",
             lambda v: coco("--instances", CONLLU, "--manifest", v, "--out", "made/l.json")),
        Slot(p, "labels coco", "--out", "out-file", lambda v: coco("--instances", CONLLU, "--manifest", M, "--out", v)),
        Slot(p, "labels f30k-entities", "--sentences", "in-resource-folder",
             lambda v: f30k("--sentences", v, "--manifest", M, "--out", "made/l.json")),
        Slot(p, "labels f30k-entities", "--annotations", "in-resource-folder",
             lambda v: f30k("--sentences", IMAGES, "--annotations", v, "--manifest", M, "--out", "made/l.json")),
        Slot(p, "labels f30k-entities", "--manifest", "in-file",
             lambda v: f30k("--sentences", IMAGES, "--manifest", v, "--out", "made/l.json")),
        Slot(p, "labels f30k-entities", "--out", "out-file",
             lambda v: f30k("--sentences", IMAGES, "--manifest", M, "--out", v)),
        Slot(p, "manifest check", "MANIFEST", "in-file", lambda v: ["manifest", "check", v]),
        Slot(p, "manifest check", "--image-root", "in-folder", lambda v: ["manifest", "check", M, "--image-root", v]),
        Slot(p, "manifest karpathy", "KARPATHY_FILE", "in-file",
             lambda v: ["manifest", "karpathy", v, "--out", "made/m.jsonl"]),
        Slot(p, "manifest karpathy", "--out", "out-file", lambda v: ["manifest", "karpathy", CONLLU, "--out", v]),
        Slot(p, "manifest karpathy", "--coco-captions", "in-resource-any",
             lambda v: ["manifest", "karpathy", CONLLU, "--coco-captions", v, "--out", "made/m.jsonl"]),
        Slot(p, "manifest coco-caption-ids", "MANIFEST", "in-file",
             lambda v: ["manifest", "coco-caption-ids", v, "--annotations", IMAGES]),
        Slot(p, "manifest coco-caption-ids", "--annotations", "in-resource-any",
             lambda v: ["manifest", "coco-caption-ids", M, "--annotations", v]),
        Slot(p, "manifest coco-caption-ids", "--out", "out-file",
             lambda v: ["manifest", "coco-caption-ids", M, "--annotations", IMAGES, "--out", v]),
        Slot(p, "parse-trees", "--manifest", "in-file",
             lambda v: trees("--manifest", v, "--conllu", CONLLU, "--out", "made/t.h5")),
        Slot(p, "parse-trees", "--out", "out-file", lambda v: trees("--manifest", M, "--conllu", CONLLU, "--out", v)),
        Slot(p, "parse-trees", "--conllu", "in-file",
             lambda v: trees("--manifest", M, "--conllu", v, "--out", "made/t.h5")),
        Slot(p, "parse-trees", "--stanza-dir", "in-resource-folder",
             lambda v: trees("--manifest", M, "--stanza-dir", v, "--out", "made/t.h5")),
        Slot(p, "parse-trees", "--dictionaries", "in-file",
             lambda v: trees("--manifest", M, "--conllu", CONLLU, "--dictionaries", v, "--out", "made/t.h5")),
        Slot(p, "show-tree", "--conllu", "in-file", lambda v: ["show-tree", "a cat", "--conllu", v]),
        Slot(p, "show-tree", "--stanza-dir", "in-resource-folder", lambda v: ["show-tree", "a cat", "--stanza-dir", v]),
        Slot(p, "show-tree", "--dictionaries", "in-file",
             lambda v: ["show-tree", "a cat", "--conllu", CONLLU, "--dictionaries", v]),
        Slot(p, "synth", "--out", "out-own-folder", lambda v: ["synth", "--out", v, "--images", "3", "--quiet"],
             "{name} {value} is not empty and is not a synthetic dataset (1 entry: notes.txt)"),
    ]


#: every path a command takes, with its kind: the table of this module
SLOTS = _pipeline_slots() + _trainer_slots()
#: path options not in the table, and why
EXEMPT = {
    "retr-pipeline verify PATHS": "reports each path's problem in its list of problems, and goes on with the next "
                                  "(tests/test_pipeline_wrong_inputs.py)",
    "retr-pipeline extract-preset --image-root": "may name the folder a preset's images are fetched into",
}
#: the settings of every training command that name paths (options of type str: a --config file may give them)
TRAINING_PATH_SETTINGS = ("--features", "--manifest", "--out", "--vocab", "--word-vectors", "--config")


def _cases() -> list[tuple[Slot, str]]:
    return [(slot, label) for slot in SLOTS for label in WRONG[slot.kind]]


CASES = _cases()


# ------------------------------------------------------------------------------------------------ the folders

def _state(folder: Path) -> dict:
    """Every path under ``folder`` (the read-only one left out) with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
            for p in folder.rglob("*") if p.relative_to(folder).parts[0] != "ro"}


def _made_read_only(folder: Path) -> str | None:
    """Make ``folder`` (already filled) refuse new files, for everyone: by permissions where the tests do not run
    as root, else by remounting a tmpfs holding a copy of it read-only; returns how (None: this machine cannot)."""
    if os.geteuid() != 0:
        for path in [folder, *folder.rglob("*")]:
            if path.is_dir():
                path.chmod(0o555)
        return "permissions"
    copy = folder.with_name(folder.name + ".contents")
    shutil.copytree(folder, copy)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        shutil.rmtree(copy)
        return None
    shutil.copytree(copy, folder, dirs_exist_ok=True)
    shutil.rmtree(copy)
    if subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True).returncode != 0:
        subprocess.run(["umount", str(folder)], capture_output=True)
        return None
    return "a read-only mount"


def _undo_read_only(folder: Path, how: str | None) -> None:
    if how == "permissions":
        for path in [folder, *folder.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)
    elif how == "a read-only mount":
        subprocess.run(["umount", str(folder)], check=True, capture_output=True)


@pytest.fixture(scope="module")
def world(synthetic_data, synthetic_run, tmp_path_factory):
    """The folder every case runs from: ``data/`` (the synthetic dataset, its feature set, trees, concepts and an
    empty COCO instances file),
    ``run/`` (a trained VSE++ run), ``a-file``, ``full/`` (a folder of someone's notes), ``full.h5/`` (a folder
    named like an index), ``ro/`` (read-only: a run and a shard folder in it). Yields ``(folder, how ro/ was made
    read-only or None)``."""
    from retr.common.paths import write_problem

    root = tmp_path_factory.mktemp("paths")
    manifest, _features = synthetic_data(images=40, copy_to=root / "data")
    write_trees_and_concepts(manifest, root / "data")
    synthetic_run("vsepp", *TINY, copy_to=root / "run")
    (root / "data" / "instances.json").write_text('{"images": [], "annotations": [], "categories": []}\n')
    (root / "a-file").write_text("a file, not a folder\n")
    (root / "full").mkdir()
    (root / "full" / "notes.txt").write_text("someone's notes\n")
    (root / "full.h5").mkdir()
    read_only = root / "ro"
    read_only.mkdir()
    (read_only / "shards").mkdir()
    shutil.copytree(root / "run", read_only / "run")
    how = _made_read_only(read_only)
    assert how is None or write_problem(read_only) is not None, f"{read_only} still takes files ({how})"
    yield root, how
    _undo_read_only(read_only, how)


def _run_case(world, run_cli, slot: Slot, label: str, monkeypatch) -> tuple[int, str, str, str]:
    """Run one case in-process from the module's folder; returns (exit code, stdout, stderr, the expected part)."""
    root, how = world
    value, telling = WRONG[slot.kind][label]
    if value.startswith("ro/") and how is None:
        pytest.skip("no read-only folder can be made on this machine as root (no mount permission)")
    if value.startswith("/proc/") and not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    monkeypatch.chdir(root)
    expected = telling.format(name=slot.name, value=value, refusal=(slot.refusal or "").format(name=slot.name,
                                                                                                value=value))
    code, stdout, stderr = run_cli.as_user("pipeline" if slot.program == "retr-pipeline" else "train",
                                           *slot.argv(value))
    return code, stdout, stderr, expected


@pytest.mark.parametrize("slot, label", CASES, ids=[f"{s.key} {label}" for s, label in CASES])
def test_a_wrong_path_is_one_line_before_any_work_and_changes_nothing(world, run_cli, monkeypatch, slot, label):
    root, _ = world
    before = _state(root)
    code, stdout, stderr, expected = _run_case(world, run_cli, slot, label, monkeypatch)
    assert_one_error_line(code, stdout, stderr)
    assert expected in stderr, stderr
    assert _state(root) == before, "a refused command changed, lost or left a file"


def _console_cases() -> list[tuple[Slot, str]]:
    """A case of each wrong value, the two programs taking turns: run again as the installed console scripts."""
    chosen: dict[str, tuple[Slot, str]] = {}
    for turn, label in enumerate(dict.fromkeys(label for _slot, label in CASES)):
        program = ("retr-pipeline", "retr-train")[turn % 2]
        candidates = [(s, lab) for s, lab in CASES if lab == label]
        chosen[label] = next(((s, lab) for s, lab in candidates if s.program == program), candidates[0])
    return list(chosen.values())


@pytest.mark.slow
@pytest.mark.parametrize("slot, label", _console_cases(), ids=[f"{s.key} {label}" for s, label in _console_cases()])
def test_the_installed_console_scripts_say_the_same(world, run_cli, monkeypatch, slot, label):
    root, _ = world
    code, _stdout, stderr, expected = _run_case(world, run_cli, slot, label, monkeypatch)
    before = _state(root)
    done = run_cli.console_script(slot.program, *slot.argv(WRONG[slot.kind][label][0]), cwd=root)
    assert (done.returncode, done.stderr) == (code, stderr) and expected in done.stderr
    assert _state(root) == before


# ------------------------------------------------------------------------------------------------ the table

def _commands(group: click.Group, prefix: str = ""):
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from _commands(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", command


def _path_options() -> set[str]:
    """``program command name`` of every path parameter of every command: click paths, retr's path types, and the
    training settings that name paths."""
    from retr.common.cli import InputPath, OutputPath, _name
    from retr.pipeline.commands import cli as pipeline
    from retr.trainers.commands import cli as trainer
    from retr.trainers.models import list_models

    found = set()
    for program, group in (("retr-pipeline", pipeline), ("retr-train", trainer)):
        for command_name, command in _commands(group):
            for param in command.params:
                if isinstance(param.type, (click.Path, InputPath, OutputPath)):
                    found.add(f"{program} {command_name} {_name(param)}")
    for model in list_models():
        flags = {opt for param in trainer.commands[model].params for opt in getattr(param, "opts", ())}
        found |= {f"retr-train {model} {flag}" for flag in TRAINING_PATH_SETTINGS if flag in flags}
    found.add("retr-pipeline index the index")
    return found


def test_every_path_option_is_in_the_table():
    listed = {slot.key for slot in SLOTS}
    assert _path_options() - listed - set(EXEMPT) == set(), "add the new path options to SLOTS"
    assert listed - _path_options() == set(), "SLOTS names options that no command has"


def test_every_path_option_is_checked_when_parsed():
    """A new path option is typed InputPath or OutputPath (its checks come with the type), not click.Path."""
    from retr.common.cli import _name
    from retr.pipeline.commands import cli as pipeline
    from retr.trainers.commands import cli as trainer

    untyped = {f"{program} {name} {_name(param)}" for program, group in (("retr-pipeline", pipeline),
                                                                          ("retr-train", trainer))
               for name, command in _commands(group) for param in command.params
               if isinstance(param.type, click.Path)}
    assert untyped == set(EXEMPT)


# ------------------------------------------------------------------------------------------------ beyond the table

def test_a_run_folder_that_takes_no_files_is_evaluated_and_said_first(world, run_cli, monkeypatch):
    """``eval`` records its result in the run's eval.json: a run in a read-only folder is evaluated all the same,
    with a note before the work; ``search`` keeps its gallery cache elsewhere."""
    root, how = world
    if how is None:
        pytest.skip("no read-only folder can be made on this machine as root (no mount permission)")
    monkeypatch.chdir(root)
    code, stdout, stderr = run_cli.as_user("train", "eval", "ro/run", "--protocol", "f30k-1k",
                                           "--allow-size-mismatch", "--device", "cpu", "--quiet")
    assert code == 0, stderr
    assert stderr.splitlines()[0].startswith("note: cannot write in ro/run (") and \
        stderr.splitlines()[0].endswith("): the result is not recorded in its eval.json"), stderr
    assert "rsum:" in stdout
    code, stdout, stderr = run_cli.as_user("train", "search", "ro/run", "--query", "a red circle", "--device", "cpu",
                                           "--quiet")
    assert code == 0 and stdout.startswith("a red circle"), stderr


def test_a_non_empty_out_is_written_among_other_files_when_the_user_says_so(world, run_cli, tmp_path):
    """``--allow-nonempty-out`` trains there, keeping what was there; ``synth`` writes its dataset beside it."""
    root, _ = world
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    run_cli("train", "vsepp", "--features", root / F, "--manifest", root / M, "--out", out, *TINY,
            "--allow-nonempty-out")
    assert (out / "notes.txt").read_text() == "mine\n" and (out / "best.pt").is_file()
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("mine\n")
    run_cli("pipeline", "synth", "--out", data, "--images", "3", "--allow-nonempty-out", "--quiet")
    assert (data / "notes.txt").read_text() == "mine\n" and (data / "manifest.jsonl").is_file()
    run_cli("pipeline", "synth", "--out", data, "--images", "3", "--quiet")        # a synthetic dataset: rewritten


def test_a_missing_choice_is_one_line(world, run_cli, monkeypatch):
    """click lists a choice's values one per line; the console scripts print them on the error's one line."""
    root, _ = world
    monkeypatch.chdir(root)
    code, stdout, stderr = run_cli.as_user("train", "eval", RUN)
    assert_one_error_line(code, stdout, stderr)
    assert stderr.splitlines()[-1] == ("error: Missing option '--protocol'. Choose from: f30k-1k, coco-1k, "
                                       "coco-5k, coco-1k-first")


@pytest.mark.parametrize("content, telling", [('{"architectures": ["BertModel"]}', "it names no model"),
                                              ("not json", "not JSON")])
def test_a_folder_with_another_tools_config_json_is_no_run(tmp_path, run_cli, monkeypatch, content, telling):
    """A Hugging Face model folder holds a config.json too: one line, not a KeyError."""
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(content)
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = run_cli.as_user("train", "eval", "bert", "--protocol", "f30k-1k")
    assert_one_error_line(code, stdout, stderr)
    assert stderr.startswith("error: bert/config.json is not a") and telling in stderr
