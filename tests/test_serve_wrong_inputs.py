"""``retr-train serve`` given a wrong start-up input — an image root or index that does not exist, an address that is
no address, a port in use, a run folder or data file that is not there — answers with one ``error:`` line and a
non-zero exit status, before the model is loaded, and leaves nothing behind: no server, no drawings' folder, no
search cache in the run (the wrong kinds of file per slot: ``tests/test_train_wrong_inputs.py``)."""
from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import pytest

from test_pipeline_wrong_inputs import assert_one_error_line

pytest.importorskip("flask", reason="the serve extra (flask, waitress) is not installed: pip install 'retr[serve]'")


class ModelLoaded(Exception):
    """Raised in place of loading the run's model: a wrong input must be refused before."""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny SCAN run on synthetic images (``tests/report_synthetic.py``), its images under ``data/``."""
    from report_synthetic import make_images, train_tiny, write_scene_boxes

    folder = tmp_path_factory.mktemp("serve_wrong_inputs")
    manifest = make_images(folder / "data", images=40)
    return train_tiny("scan", write_scene_boxes(folder / "data"), manifest, folder / "scan", "--epochs", "1",
                      "--device", "cpu")


@pytest.fixture
def serve(run, tmp_path, monkeypatch, run_cli):
    """``serve(*args) → (code, stdout, stderr)``: ``retr-train serve RUN *args`` as a user runs it, with the model's
    loading replaced by :class:`ModelLoaded` and temporary files going to a folder of the test's own."""
    from retr.trainers.search.retrieval import Retriever

    def refuse(*args, **kwargs):
        raise ModelLoaded("the model was loaded before the input was checked")

    monkeypatch.setattr(Retriever, "from_run", refuse)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    def call(*args, run_folder=run):
        before = sorted(p.relative_to(run) for p in run.rglob("*"))
        result = run_cli.as_user("train", "serve", str(run_folder), "--device", "cpu", "--quiet", *map(str, args))
        assert sorted(p.relative_to(run) for p in run.rglob("*")) == before, "the run folder changed"
        assert list((tmp_path / "tmp").iterdir()) == [], "a temporary file was left behind"
        return result
    return call


@pytest.fixture
def taken_port():
    """A port something else listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def _cases(run: Path, tmp: Path, port: int) -> dict:
    """``name → (argv after RUN, or (run folder, argv), the error line)``; ``tmp`` holds an ``empty`` folder. (A
    file where a folder belongs is click's usage error: ``tests/test_train_wrong_inputs.py``.)"""
    data = run.parent / "data"
    return {
        "nonexistent --image-root": (["--image-root", "nonexistent/"],
                                     "--image-root nonexistent does not exist (expected the folder the "
                                     "manifest's image paths are relative to)"),
        "--image-root one level too deep": (["--image-root", data / "images"],
                                            f"no image of the test split is under {data / 'images'}"),
        "--host not an address": (["--host", "999.1.1.1"], "cannot listen on 999.1.1.1: no such address"),
        "--host no such name": (["--host", "no-such-host.invalid"],
                                "cannot listen on no-such-host.invalid: no such address"),
        "--host of another machine": (["--host", "192.0.2.1"],
                                      "cannot listen on 192.0.2.1:0 (Cannot assign requested address); --host "
                                      "must be an address of this machine"),
        "port in use": (["--port", port], f"cannot listen on 127.0.0.1:{port} (Address already in use); something "
                                          "else listens there: choose another --port (0: any free one)"),
        "run folder that does not exist": ((tmp / "no-run", []), f"RUN {tmp / 'no-run'} does not exist (expected "
                                                                 "a run folder or an export)"),
        "run folder without a run": ((tmp / "empty", []), f"RUN {tmp / 'empty'} holds no config.json, so it is not a "
                                                          "run folder or an export"),
        "--index that does not exist": (["--index", tmp / "no.index"],
                                        f"--index {tmp / 'no.index'} does not exist (expected a gallery index "
                                        "folder)"),
        "--index without meta.json": (["--index", tmp / "empty"],
                                      f"{tmp / 'empty'} is not a gallery index (no meta.json); build one with "
                                      "retr-train index"),
        "--manifest that does not exist": (["--manifest", tmp / "no.jsonl"], f"--manifest {tmp / 'no.jsonl'} does "
                                                                              "not exist"),
        "--features that does not exist": (["--features", tmp / "no.h5"], f"--features {tmp / 'no.h5'} does not "
                                                                          "exist"),
    }


CASES = list(_cases(Path("run"), Path("tmp"), 1))


@pytest.mark.parametrize("case", CASES)
def test_a_wrong_start_up_input_is_one_line_before_the_model_loads(serve, run, tmp_path, taken_port, case):
    (tmp_path / "empty").mkdir()
    args, expected = _cases(run, tmp_path, taken_port)[case]
    folder, args = args if isinstance(args, tuple) else (run, args)
    if "--port" not in args:
        args = [*args, "--port", 0]           # any free one: only the case of a port in use names one
    code, stdout, stderr = serve(*args, run_folder=folder)
    assert_one_error_line(code, stdout, stderr)
    assert stdout == "" and stderr.startswith("error: " + expected), stderr


def test_good_inputs_pass_the_checks_and_reach_the_model(serve):
    """The stand-in for the model's loading is reached with inputs that are right: the cases above stop before."""
    with pytest.raises(ModelLoaded):
        serve("--port", 0)
