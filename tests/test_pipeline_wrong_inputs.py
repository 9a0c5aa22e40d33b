"""Every ``retr-pipeline`` command, given a file of the wrong kind where it expects another — an empty file, a
folder, HDF5 where text is expected and text where HDF5 is, non-UTF-8 text — answers with one ``error:`` line
and a non-zero exit status, never a traceback (the README's promise)."""
from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from retr.store.features import ShardWriter, shard_name
from tests.conftest import grid_attrs

#: The wrong kinds of input every slot is tried with (each slot leaves out the kind it does expect).
KINDS = ("empty", "folder", "hdf5", "jsonl", "latin1")

CONLLU = ("# sent_id = a#0\n# text = a cat\n"
          "1\ta\ta\tDET\tDT\t_\t2\tdet\t_\t_\n2\tcat\tcat\tNOUN\tNN\t_\t0\troot\t_\t_\n\n")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One file of each kind, plus correct inputs for the slots a case does not test."""
    root = tmp_path_factory.mktemp("wrong_inputs")
    paths = {"empty": root / "empty.txt", "folder": root / "a_folder", "jsonl": root / "manifest.jsonl",
             "latin1": root / "latin1.jsonl"}
    paths["empty"].write_bytes(b"")
    paths["folder"].mkdir()
    record = {"id": "a", "path": "a.jpg", "split": "train", "captions": ["a cat"]}
    paths["jsonl"].write_text(json.dumps(record) + "\n")
    # a caption written in Latin-1 (é as the single byte 0xe9), on the second line
    paths["latin1"].write_bytes(json.dumps(record).encode() + b"\n" +
                                b'{"id": "b", "path": "b.jpg", "split": "train", "captions": ["caf\xe9"]}\n')
    hdf5 = root / "features" / shard_name(0, 1)
    with ShardWriter(hdf5, grid_attrs(), (49, 2048)) as writer:
        writer.append(["a"], np.zeros((1, 49, 2048)))
    paths["hdf5"] = hdf5
    good = {"manifest": paths["jsonl"], "conllu": root / "captions.conllu", "root": root}
    good["conllu"].write_text(CONLLU)
    # folders holding files of the wrong kind under the names a command looks for
    scan = root / "scan_garbage"
    scan.mkdir()
    (scan / "train_ims.npy").write_bytes(hdf5.read_bytes())
    (scan / "train_caps.txt").write_text("".join(f"c{i}\n" for i in range(5)))
    scan_latin1 = root / "scan_latin1"
    scan_latin1.mkdir()
    np.save(scan_latin1 / "train_ims.npy", np.zeros((1, 2, 2048), np.float32))
    (scan_latin1 / "train_caps.txt").write_bytes(b"one\ntwo\ncaf\xe9\nfour\nfive\n")
    npz = root / "npz_garbage"
    npz.mkdir()
    (npz / "1.npz").write_bytes(paths["jsonl"].read_bytes())
    shards = root / "shards_garbage" / "grid"
    shards.mkdir(parents=True)
    (shards / shard_name(0, 1)).write_text("not HDF5\n")
    captions = root / "captions_garbage"          # COCO's caption files by name: HDF5 and Latin-1 text
    captions.mkdir()
    (captions / "captions_train2014.json").write_bytes(hdf5.read_bytes())
    (captions / "captions_val2014.json").write_bytes(paths["latin1"].read_bytes())
    good.update(scan_garbage=scan, scan_latin1=scan_latin1, npz_garbage=npz, shards_garbage=shards,
                captions_garbage=captions)
    return paths, good


def _slots(good=None):
    """``name → (function of the wrong input → argv, the kind the slot expects)`` (``good``: the correct inputs
    for the other slots; placeholders when only the names and kinds are wanted)."""
    good = good or {"root": Path("."), "manifest": Path("m.jsonl"), "conllu": Path("c.conllu")}
    out = good["root"] / "out"
    m, c = good["manifest"], good["conllu"]
    extract = ["extract", "--extractor", "tencrop-resnet152", "--image-size", "32", "--workers", "0", "--quiet"]
    return {
        "manifest karpathy FILE": (lambda x: ["manifest", "karpathy", x, "--out", out / "m.jsonl"], None),
        "manifest check MANIFEST": (lambda x: ["manifest", "check", x], "jsonl"),
        "manifest coco-caption-ids MANIFEST": (lambda x: ["manifest", "coco-caption-ids", x, "--annotations",
                                                          good["root"]], "jsonl"),
        "manifest coco-caption-ids --annotations": (lambda x: ["manifest", "coco-caption-ids", m, "--annotations",
                                                               x, "--out", out / "ids.jsonl"], None),
        "labels coco --instances": (lambda x: ["labels", "coco", "--instances", x, "--manifest", m,
                                               "--out", out / "l.json"], None),
        "labels coco --manifest": (lambda x: ["labels", "coco", "--instances", m, "--manifest", x,
                                              "--out", out / "l.json"], "jsonl"),
        "labels f30k-entities --sentences": (lambda x: ["labels", "f30k-entities", "--sentences", x,
                                                        "--manifest", m, "--out", out / "l.json"], "folder"),
        "labels f30k-entities --manifest": (lambda x: ["labels", "f30k-entities", "--sentences", good["root"],
                                                       "--manifest", x, "--out", out / "l.json"], "jsonl"),
        "synth --out": (lambda x: ["synth", "--out", x, "--images", "3", "--quiet"], "folder"),
        "verify PATH": (lambda x: ["verify", x], "hdf5"),
        "inspect PATH": (lambda x: ["inspect", x], "hdf5"),
        "index FOLDER": (lambda x: ["index", x], "folder"),
        "parse-trees --manifest": (lambda x: ["parse-trees", "--manifest", x, "--conllu", c, "--out",
                                              out / "t.h5", "--quiet"], "jsonl"),
        "parse-trees --conllu": (lambda x: ["parse-trees", "--manifest", m, "--conllu", x, "--out", out / "t.h5",
                                            "--quiet"], None),
        "parse-trees --dictionaries": (lambda x: ["parse-trees", "--manifest", m, "--conllu", c, "--dictionaries",
                                                  x, "--out", out / "t.h5", "--quiet"], None),
        "show-tree --conllu": (lambda x: ["show-tree", "a cat", "--conllu", x], None),
        "show-tree --dictionaries": (lambda x: ["show-tree", "a cat", "--conllu", c, "--dictionaries", x], None),
        "fetch-parser-models MODEL_DIR": (lambda x: ["fetch-parser-models", x], "folder"),
        "extract --manifest": (lambda x: [*extract, "--manifest", x, "--out", out / "f", "--weights", "random"],
                               "jsonl"),
        "extract --weights": (lambda x: [*extract, "--manifest", m, "--out", out / "f", "--weights", x], None),
        "extract --out": (lambda x: [*extract, "--manifest", m, "--out", x, "--weights", "random"], "folder"),
        "extract --image-root": (lambda x: [*extract, "--manifest", m, "--out", out / "f", "--weights", "random",
                                            "--image-root", x], "folder"),
        "extract-preset --manifest": (lambda x: ["extract-preset", "synthetic", "--manifest", x, "--out",
                                                 out / "f", "--weights", "random", "--quiet"], "jsonl"),
        "build-concepts --manifest": (lambda x: ["build-concepts", "--manifest", x, "--out", out / "c.h5",
                                                 "--select", "frequency"], "jsonl"),
        "build-concepts --conllu": (lambda x: ["build-concepts", "--manifest", m, "--conllu", x, "--out",
                                               out / "c.h5"], None),
        "import-scan --data-dir": (lambda x: ["import-scan", "--data-dir", x, "--out", out / "s", "--quiet"],
                                   "folder"),
        "import-tsv TSV": (lambda x: ["import-tsv", x, "--out", out / "s", "--quiet"], None),
        "import-npz FOLDER": (lambda x: ["import-npz", x, "--out", out / "s", "--quiet"], "folder"),
        "fetch-data --root": (lambda x: ["fetch-data", "coco", "--root", x, "--quiet"], "folder"),
        "fetch-data --images-zip": (lambda x: ["fetch-data", "f30k", "--root", out / "f30k", "--images-zip", x,
                                               "--quiet"], None),
        "fetch-weights --stanza-dir": (lambda x: ["fetch-weights", "stanza", "--stanza-dir", x], "folder"),
    }


#: (slot, wrong kind): every slot with every kind but the one it expects.
CASES = [(slot, kind) for slot, (_argv, expected) in _slots().items() for kind in KINDS if kind != expected]
#: Folders whose contents are of the wrong kind, for the slots that take a folder.
FOLDER_CASES = [("index FOLDER", "shards_garbage"), ("import-scan --data-dir", "scan_garbage"),
                ("import-scan --data-dir", "scan_latin1"), ("import-npz FOLDER", "npz_garbage"),
                ("manifest coco-caption-ids --annotations", "captions_garbage")]


def assert_one_error_line(code: int, stdout: str, stderr: str) -> None:
    assert code not in (0, None), f"exit status {code}; stdout: {stdout!r}"
    assert "Traceback" not in stderr + stdout
    lines = stderr.splitlines()
    assert [line for line in lines if line.startswith("error: ")] == [lines[-1]], stderr
    if code == 2:   # a usage error: click's usage and hint lines come first
        assert len(lines) == 3 and lines[0].startswith("Usage: ") and lines[1].startswith("Try "), stderr
    else:
        assert len(lines) == 1, stderr


@pytest.mark.parametrize("slot, kind", CASES)
def test_a_wrong_kind_of_input_is_one_error_line(files, run_cli, slot, kind):
    paths, good = files
    argv, _expected = _slots(good)[slot]
    code, stdout, stderr = run_cli.as_user("pipeline", *argv(paths[kind]))
    assert_one_error_line(code, stdout, stderr)


@pytest.mark.parametrize("slot, folder", FOLDER_CASES)
def test_a_folder_of_wrong_files_is_one_error_line(files, run_cli, slot, folder):
    _paths, good = files
    argv, _expected = _slots(good)[slot]
    code, stdout, stderr = run_cli.as_user("pipeline", *argv(good[folder]))
    assert_one_error_line(code, stdout, stderr)


def test_every_command_is_covered():
    from retr.pipeline.commands import cli

    commands = {name if not hasattr(command, "commands") else f"{name} {sub}"
                for name, command in cli.commands.items()
                for sub in (getattr(command, "commands", None) or [None])}
    tried = {" ".join(slot.split()[:2]) if slot.split()[0] in ("manifest", "labels") else slot.split()[0]
             for slot in _slots()}
    assert commands - tried == {"manifest preset", "fetch-word-vectors"}   # take a name, no file


def test_a_latin1_caption_names_the_file_and_line(files, run_cli):
    paths, good = files
    latin1 = paths["latin1"]
    expected = (f"error: {latin1} line 2: not UTF-8 text (byte 65 is 0xe9); a manifest is JSON Lines in UTF-8 — "
                f"re-encode it (e.g. iconv -f latin1 -t utf-8)\n")
    assert run_cli.as_user("pipeline", "manifest", "check", latin1) == (1, "", expected)
    code, _out, stderr = run_cli.as_user("pipeline", "parse-trees", "--manifest", latin1, "--conllu", good["conllu"],
                                         "--out", good["root"] / "out" / "t.h5", "--quiet")
    assert (code, stderr) == (1, expected)
    code, _out, stderr = run_cli.as_user("pipeline", "manifest", "check", paths["hdf5"])
    assert (code, stderr) == (1, f"error: {paths['hdf5']} is an HDF5 file, not a manifest (JSON Lines in UTF-8)\n")
    code, _out, stderr = run_cli.as_user("pipeline", "import-scan", "--data-dir", good["scan_latin1"], "--out",
                                         good["root"] / "out" / "s", "--quiet")
    assert stderr == (f"error: {good['scan_latin1'] / 'train_caps.txt'} line 3: not UTF-8 text (byte 0xe9); "
                      f"re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)\n")


def test_an_empty_manifest_is_an_error_for_check(files, run_cli):
    paths, _good = files
    assert run_cli.as_user("pipeline", "manifest", "check", paths["empty"]) == (
        1, "", f"error: {paths['empty']} holds no images (a manifest has one JSON object per line)\n")


def test_a_raw_pickle_weights_file_is_one_line_without_torch_warnings(files, run_cli, tmp_path, capfd):
    """``pickle.dump`` of a state dict: torch's weights-only reader refuses it, and used to print a two-line
    UserWarning about the pickle protocol first."""
    import pickle

    import torch

    raw = tmp_path / "state.pkl"
    with open(raw, "wb") as handle:
        pickle.dump({"conv.weight": torch.zeros(2, 2)}, handle, protocol=4)
    _paths, good = files
    argv, _ = _slots(good)["extract --weights"]
    code, stdout, stderr = run_cli.as_user("pipeline", *argv(raw))
    assert_one_error_line(code, stdout, stderr)
    assert stderr == (f"error: {raw} is not a torch.save file but another pickle (e.g. pickle.dump), which is read "
                      f"only as tensors and plain values (Unsupported operand 149); where you trust it, re-save it "
                      f"with torch.save(state_dict, PATH)\n")
    leaked = capfd.readouterr()   # warnings go to the real stderr, past the helper's redirect
    assert "Warning" not in leaked.err and "Warning" not in leaked.out


def test_a_verify_of_several_paths_reports_each(files, run_cli):
    paths, _good = files
    code, stdout, stderr = run_cli.as_user("pipeline", "verify", paths["hdf5"], paths["jsonl"], paths["folder"])
    assert code == 1 and stderr == "error: 2 of 3 feature set(s) failed verification\n"
    assert f"{paths['hdf5']}: ok" in stdout
    assert f"{paths['jsonl']} is not a readable HDF5 file" in stdout
    assert f"{paths['folder']} is a folder, not a feature-set file" in stdout
    with h5py.File(paths["hdf5"], "r") as f:
        assert "checksums" in f


@pytest.mark.parametrize("case", ["unknown name", "cache is a file", "offline and absent"])
def test_fetch_word_vectors_refuses_in_one_line(run_cli, tmp_path, monkeypatch, case):
    """``fetch-word-vectors`` takes names, not files: an unknown name, a cache folder ($RETR_WORD_VECTORS) that is
    a file, and a set absent while offline are each one line, and nothing is downloaded or created."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("RETR_WORD_VECTORS", str(cache))
    monkeypatch.setenv("RETR_MIRROR", "http://127.0.0.1:9/")      # nothing listens: no test reaches a network
    name = "glove-6b"
    if case == "unknown name":
        name, expected = "glove-7b", "unknown word vectors 'glove-7b' (known: glove, glove-6b)"
    elif case == "cache is a file":
        cache.write_text("not a folder")
        expected = f"the word-vectors folder {cache} is a file"
    else:
        monkeypatch.setenv("RETR_OFFLINE", "1")
        expected = "not found (looked in"
    before = sorted(tmp_path.rglob("*"))
    code, stdout, stderr = run_cli.as_user("pipeline", "fetch-word-vectors", name)
    assert_one_error_line(code, stdout, stderr)
    assert expected in stderr and sorted(tmp_path.rglob("*")) == before
