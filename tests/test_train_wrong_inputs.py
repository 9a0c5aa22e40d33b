"""Every ``retr-train`` command, given a file of the wrong kind where it expects another — an empty file, a folder,
HDF5 where text is expected and text where HDF5 is, non-UTF-8 text — answers with one ``error:`` line and a
non-zero exit status, never a traceback (the pipeline's side is ``tests/test_pipeline_wrong_inputs.py``)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from retr.trainers.commands import cli
from test_pipeline_wrong_inputs import KINDS, assert_one_error_line

TINY = ["--embed-size", "16", "--word-dim", "8", "--batch-size", "16", "--quiet", "--val-images", "10",
        "--device", "cpu", "--epochs", "1"]


@pytest.fixture(scope="module")
def files(synthetic_data, synthetic_run, tmp_path_factory):
    """One file of each wrong kind, plus a small dataset and a trained run (this module's copy: the commands below
    are given it) for the slots a case does not test; ``root`` is this module's output folder."""
    root = tmp_path_factory.mktemp("train_wrong_inputs")
    manifest, features = synthetic_data(images=40)
    run = synthetic_run("vsepp", *TINY, copy_to=root / "run")
    paths = {"empty": root / "empty.txt", "folder": root / "a_folder", "jsonl": manifest,
             "latin1": root / "latin1.jsonl", "hdf5": features}
    paths["empty"].write_bytes(b"")
    paths["folder"].mkdir()
    first = manifest.read_text().splitlines()[0]
    paths["latin1"].write_bytes(first.encode() + b"\n" + first.replace("synth_", "other_").encode()
                                .replace(b'captions": ["', b'captions": ["caf\xe9 ') + b"\n")
    good = {"manifest": manifest, "features": features, "run": run, "root": root, "sims": root / "sims.npy"}
    np.save(good["sims"], np.zeros((3, 15)))                # a matrix with no ids file beside it
    return paths, good


def _slots(good=None):
    """``name → (function of the wrong input → argv, the kind the slot expects)``."""
    good = good or {k: Path(k) for k in ("manifest", "features", "run", "root", "sims")}
    m, f, run, out = good["manifest"], good["features"], good["run"], good["root"] / "out"
    train = lambda model, **inputs: [model, "--features", inputs.pop("features", f), "--manifest",   # noqa: E731
                                     inputs.pop("manifest", m), "--out", inputs.pop("out", out / model), *TINY,
                                     *[x for k, v in inputs.items() for x in (f"--{k}", v)]]
    show = ["--protocol", "f30k-1k", "--allow-size-mismatch", "--quiet", "--out", out / "report"]
    return {
        "vsepp --features": (lambda x: train("vsepp", features=x), "hdf5"),
        "vsepp --manifest": (lambda x: train("vsepp", manifest=x), "jsonl"),
        "vsepp --vocab": (lambda x: train("vsepp", vocab=x), None),
        "vsepp --config": (lambda x: ["vsepp", "--config", x, "--out", out / "c"], None),
        "scan --features": (lambda x: train("scan", features=x), "hdf5"),
        "smfea --trees": (lambda x: train("smfea", trees=x), "hdf5"),
        "smfea --concepts": (lambda x: train("smfea", trees=f, concepts=x), "hdf5"),
        "jgcar --labels": (lambda x: train("jgcar", labels=x), None),
        "sman --features": (lambda x: train("sman", features=x), "hdf5"),
        "seam --manifest": (lambda x: train("seam", manifest=x), "jsonl"),
        "vsepp --resume --out": (lambda x: ["vsepp", "--resume", "--out", x], "folder"),
        "eval RUNS": (lambda x: ["eval", x, "--protocol", "f30k-1k", "--allow-size-mismatch", "--quiet"], "folder"),
        "eval --features": (lambda x: ["eval", run, "--features", x, "--protocol", "f30k-1k",
                                       "--allow-size-mismatch", "--quiet"], "hdf5"),
        "eval --manifest": (lambda x: ["eval", run, "--manifest", x, "--protocol", "f30k-1k",
                                       "--allow-size-mismatch", "--quiet"], "jsonl"),
        "table RUNS": (lambda x: ["table", x], "folder"),
        "eval-sims FILE.npy": (lambda x: ["eval-sims", x], None),
        "eval-sims --ids": (lambda x: ["eval-sims", good["sims"], "--ids", x], None),
        "eval-sims --manifest": (lambda x: ["eval-sims", good["sims"], "--manifest", x, "--extended"], "jsonl"),
        "export RUN": (lambda x: ["export", x, "--out", out / "export"], "folder"),
        "push RUN": (lambda x: ["push", x, "--repo", "my-lab/model"], "folder"),
        "search RUN": (lambda x: ["search", x, "--query", "a cat"], "folder"),
        "plot RUNS": (lambda x: ["plot", x, "--out", out / "p.png"], "folder"),
        "show RUNS": (lambda x: ["show", x, *show], "folder"),
        "show --features": (lambda x: ["show", run, "--features", x, *show], "hdf5"),
        "show --manifest": (lambda x: ["show", run, "--manifest", x, *show], "jsonl"),
        "show --image-root": (lambda x: ["show", run, "--image-root", x, *show], "folder"),
        "show --sims": (lambda x: ["show", run, "--sims", x, *show], None),
        "search --features": (lambda x: ["search", run, "--features", x, "--query", "a cat"], "hdf5"),
        "search --manifest": (lambda x: ["search", run, "--manifest", x, "--query", "a cat"], "jsonl"),
        "import-scan-checkpoint CHECKPOINT": (lambda x: ["import-scan-checkpoint", x, "--vocab", good["run"] /
                                                         "vocab.json", "--out", out / "i"], None),
        "import-scan-checkpoint --vocab": (lambda x: ["import-scan-checkpoint", good["run"] / "best.pt",
                                                      "--vocab", x, "--out", out / "i"], None),
        "import-vsepp-checkpoint CHECKPOINT": (lambda x: ["import-vsepp-checkpoint", x, "--vocab", good["run"] /
                                                          "vocab.json", "--out", out / "j"], None),
        "import-vse-infinity-checkpoint CHECKPOINT": (lambda x: ["import-vse-infinity-checkpoint", x, "--vocab",
                                                                 good["run"] / "vocab.json", "--out", out / "k"],
                                                      None),
        "reproduce --features": (lambda x: ["reproduce", "vsepp-f30k-fixed-resnet-1crop", "--features", x, "--manifest", m,
                                            "--out", out / "r", "--quiet"], "hdf5"),
        "reproduce --manifest": (lambda x: ["reproduce", "vsepp-f30k-fixed-resnet-1crop", "--features", f, "--manifest", x,
                                            "--out", out / "r", "--quiet"], "jsonl"),
        "vse-infinity --features": (lambda x: train("vse-infinity", features=x), "hdf5"),
        "eval-clip --features": (lambda x: ["eval-clip", "--features", x, "--manifest", m, "--protocol", "f30k-1k",
                                            "--allow-size-mismatch", "--device", "cpu"], "hdf5"),
        "eval-clip --manifest": (lambda x: ["eval-clip", "--features", f, "--manifest", x, "--protocol", "f30k-1k",
                                            "--allow-size-mismatch", "--device", "cpu"], "jsonl"),
        "index RUN": (lambda x: ["index", x, "--images", good["root"] / "a_folder", "--out", out / "idx", "--quiet"],
                      "folder"),
        "index --manifest": (lambda x: ["index", run, "--manifest", x, "--out", out / "idx", "--device", "cpu",
                                        "--workers", "0", "--quiet"], "jsonl"),
        "index --out": (lambda x: ["index", run, "--manifest", m, "--out", x, "--device", "cpu", "--workers", "0",
                                   "--quiet"], "folder"),
        "search --index": (lambda x: ["search", run, "--index", x, "--query", "a cat"], "folder"),
        # every wrong kind is refused before anything listens (no test here may leave a server running)
        "serve RUN": (lambda x: ["serve", x, "--port", "0", "--quiet"], "folder"),
        "serve --index": (lambda x: ["serve", run, "--index", x, "--port", "0", "--quiet"], "folder"),
    }


CASES = [(slot, kind) for slot, (_argv, expected) in _slots().items() for kind in KINDS if kind != expected]


@pytest.mark.parametrize("slot, kind", CASES)
def test_a_wrong_kind_of_input_is_one_error_line(files, run_cli, slot, kind):
    paths, good = files
    argv, _expected = _slots(good)[slot]
    code, stdout, stderr = run_cli.as_user("train", *argv(paths[kind]))
    assert_one_error_line(code, stdout, stderr)


def test_every_command_is_covered():
    commands = set(cli.commands) - {"recipes"}          # recipes takes no file
    assert commands - {slot.split()[0] for slot in _slots()} == set()


def test_a_latin1_caption_in_training_names_the_line(files, run_cli):
    paths, good = files
    code, _out, err = run_cli.as_user("train", *_slots(good)["vsepp --manifest"][0](paths["latin1"]))
    assert code == 1 and f"{paths['latin1']} line 2: not UTF-8" in err


def test_a_run_config_json_still_starts_a_new_run(files):
    """config.json now also records the data's identity, which ``--config`` must not take for a setting."""
    _paths, good = files
    assert "data_identity" in json.loads((good["run"] / "config.json").read_text())
    result = CliRunner().invoke(cli, ["vsepp", "--config", str(good["run"] / "config.json"), "--out",
                                      str(good["root"] / "again"), "--quiet"])
    assert result.exit_code == 0, result.output


# a setting outside its bounds, in a model's settings or the run's: one line naming the option, and no run folder
OUT_OF_BOUNDS = [("vse-infinity", "--embed-size", "0"), ("vse-infinity", "--pe-dim", "0"), ("scan", "--word-dim", "0"),
                 ("scan", "--num-layers", "0"), ("jgcar", "--dropout", "1"), ("sman", "--shortlist", "-1"),
                 ("seam", "--hops", "0"), ("vsepp", "--batch-size", "1"), ("vsepp", "--ema", "1.5"),
                 ("vsepp", "--accum-steps", "3"), ("vsepp", "--lr", "-0.1"), ("vsepp", "--val-images", "-1")]


@pytest.mark.parametrize("model, flag, value", OUT_OF_BOUNDS)
def test_a_setting_outside_its_bounds_is_one_line_before_any_work(files, run_cli, model, flag, value):
    _paths, good = files
    out = good["root"] / "bounds" / f"{model}{flag}"
    argv = [model, "--features", good["features"], "--manifest", good["manifest"], "--out", out, *TINY, flag, value]
    code, stdout, stderr = run_cli.as_user("train", *argv)
    assert_one_error_line(code, stdout, stderr)
    assert flag in stderr and not out.exists()


def test_settings_are_checked_when_made_not_when_trained():
    """Python callers meet the same bounds as the command line: TrainConfig and every model's settings."""
    from retr.trainers.config import TrainConfig, setting_fields, field_types
    from retr.trainers.models.registry import get_spec, list_models

    specs = [get_spec(name) for name in list_models()]

    with pytest.raises(ValueError, match="batch_size must be ≥ 2, not 1"):
        TrainConfig(batch_size=1)
    with pytest.raises(ValueError, match="accum_steps 3 must divide batch_size 128"):
        TrainConfig(accum_steps=3)
    for spec in specs:
        with pytest.raises(ValueError, match="embed_size must be ≥ 1, not 0"):
            spec.config_class(embed_size=0)                 # the dataclass checks its bounds as it is made
    # every whole-number setting states its bounds (a new size setting cannot forget them)
    for cls in (TrainConfig, *(spec.config_class for spec in specs)):
        types = field_types(cls)
        unbounded = [f.name for f in setting_fields(cls) if types[f.name] in (int, int | None)
                     and f.metadata.get("at_least") is None]
        assert unbounded == [], (cls.__name__, unbounded)


EIGHT = " 0.1" * 8             # TINY's --word-dim
WORD_VECTORS = {"not-a-number.txt": (b"the 0.1 0.2 abc 0.4\n", "its first line is not a word and numbers"),
                "other-size.txt": (b"the 0.1 0.2\n", "holds 2-d vectors: give --word-dim 2 (not 8)"),
                "short-line.txt": (f"zzzq{EIGHT}\na 0.3\n".encode(), "line 2: 1 value where the first line has 8"),
                "text.zip": (b"the 0.1 0.2\n", "is named .zip but is not a zip archive"),
                "no-words-of-the-vocabulary.txt": (f"zzzq{EIGHT}\n".encode(), "covers none of the"),
                "folder": (None, "is a folder, not a GloVe-format"),
                "absent.txt": (None, "vectors/absent.txt does not exist (expected a GloVe-format")}


@pytest.mark.parametrize("name", list(WORD_VECTORS))
def test_a_wrong_word_vectors_file_is_one_line_before_any_work(files, run_cli, name):
    _paths, good = files
    content, message = WORD_VECTORS[name]
    vectors = good["root"] / "vectors" / name
    vectors.parent.mkdir(exist_ok=True)
    if content is not None:
        vectors.write_bytes(content)
    elif name == "folder":
        vectors.mkdir(exist_ok=True)
    out = good["root"] / "vectors-run" / name
    code, stdout, stderr = run_cli.as_user("train", "scan", "--features", good["features"], "--manifest",
                                           good["manifest"], "--out", out, *TINY, "--word-vectors", vectors)
    assert_one_error_line(code, stdout, stderr)
    assert message in stderr and not out.exists()


SETTINGS_FILES = {"bad.yaml": ("lr: [1, 2\nepochs: 3\n", "bad.yaml line 2, column 7: not YAML (expected ',' or ']', "
                                                         "but got ':')"),
                  "bad.json": ('{"lr": 1e-4,\n "epochs": }\n', "bad.json line 2, column 12: not JSON (Expecting "
                                                                "value); settings files are JSON, or YAML named "
                                                                ".yaml/.yml"),
                  "list.yaml": ("- lr\n- epochs\n", "list.yaml holds list, not a mapping of settings"),
                  "empty.json": ("", "empty.json line 1, column 1: not JSON (Expecting value)")}


@pytest.mark.parametrize("name", list(SETTINGS_FILES))
def test_a_settings_file_that_does_not_parse_is_one_line_with_its_line_and_column(files, run_cli, name):
    """A parser's traceback was 73 lines: now the file, the line and column, and what the parser expected."""
    _paths, good = files
    content, message = SETTINGS_FILES[name]
    path = good["root"] / "settings" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(content)
    out = good["root"] / "settings-run" / name
    code, stdout, stderr = run_cli.as_user("train", "vsepp", "--config", path, "--out", out)
    assert_one_error_line(code, stdout, stderr)
    assert stderr.startswith(f"error: --config {path.parent}/") and message in stderr and not out.exists()
