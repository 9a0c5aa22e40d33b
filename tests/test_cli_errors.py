"""Library errors name parameters; the commands print them with their own flags (``retr.common.cli``)."""
from __future__ import annotations

import pickle

import click
import pytest
from click.testing import CliRunner

from retr.common.cli import LazyChoice, flags_in_errors, parameter_flags, run
from retr.common.errors import with_flags
from retr.common.errors import MissingResourceError, ParameterError, RetrError, UserError


def _group(callback) -> click.Group:
    """A toy console script: one command whose option names differ from their flags, like the real ones."""

    @click.group()
    @click.option("--verbose", "loud", is_flag=True)
    def toy(loud: bool) -> None:
        """Toy."""

    @toy.command("go")
    @click.argument("dataset")
    @click.option("--extractor", "name", default="x")
    @click.option("--image-size", type=int, default=448)
    @click.option("--half/--no-half", default=False)
    def go(dataset: str, name: str, image_size: int, half: bool) -> None:
        callback()

    return toy


def _raise(exc: BaseException):
    def callback():
        raise exc
    return callback


def _run(group: click.Group, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        run(group, ["go", "coco"])
    return exited.value.code, capsys.readouterr().err


def test_parameter_error_is_a_value_error_naming_the_parameter():
    error = ParameterError("image_size must be a multiple of 32, not 100", "image_size", "grid_size")
    assert isinstance(error, ValueError) and not isinstance(error, RetrError)
    assert str(error) == "image_size must be a multiple of 32, not 100"
    assert error.parameter == "image_size" and error.parameters == ("image_size", "grid_size")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is ParameterError and again.parameters == error.parameters and str(again) == str(error)
    assert UserError("plain").parameters == () and MissingResourceError("x", "y", "z").parameters == ()


def test_a_command_prints_the_flag_in_one_line(capsys):
    group = _group(_raise(ParameterError("image_size must be a multiple of 32, not 100", "image_size")))
    code, stderr = _run(group, capsys)
    assert code == 1 and stderr == "error: --image-size must be a multiple of 32, not 100\n"


def test_names_map_through_the_commands_own_parameters(capsys):
    """``name`` is the parameter of ``--extractor``; arguments show as their metavar; a group's options count."""
    message = "name 'x' refuses image_size 7 with half (half-precision, self.half, image_size_max, dataset, loud)"
    group = _group(_raise(ParameterError(message, "name", "image_size", "half", "dataset", "loud", "grid_size")))
    code, stderr = _run(group, capsys)
    assert code == 1
    assert stderr == ("error: --extractor 'x' refuses --image-size 7 with --half (half-precision, self.half, "
                      "image_size_max, DATASET, --verbose)\n")


def test_names_the_command_does_not_have_stay(capsys):
    group = _group(_raise(ParameterError("post_nms_topk must be at least max_boxes", "post_nms_topk", "max_boxes")))
    assert _run(group, capsys) == (1, "error: post_nms_topk must be at least max_boxes\n")


def test_a_retr_error_naming_parameters_keeps_its_class():
    group = flags_in_errors(_group(_raise(UserError("x.pkl: if you trust the file, set half",
                                                    parameters=["half"]))))
    result = CliRunner().invoke(group, ["go", "coco"])
    assert type(result.exception) is UserError and str(result.exception) == "x.pkl: if you trust the file, set --half"


def test_a_plain_value_error_is_a_bug_and_keeps_its_traceback():
    group = _group(_raise(ValueError("image_size went wrong inside")))
    with pytest.raises(ValueError, match="image_size went wrong inside"):
        run(group, ["go", "coco"])


def test_outside_a_command_the_library_text_stays():
    assert with_flags("image_size must be even", ["image_size"], {}) == "image_size must be even"
    assert parameter_flags(None) == {}


def test_real_commands_map_their_own_names(tmp_path, capsys):
    """``retr-pipeline synth --images`` is the parameter ``num_images`` of :func:`generate_synthetic`."""
    from retr.pipeline.commands import cli

    with pytest.raises(SystemExit) as exited:
        run(cli, ["synth", "--out", str(tmp_path / "s"), "--images", "2"])
    assert exited.value.code == 1
    assert capsys.readouterr().err == "error: --images must be at least 3 (one each for train, val and test), got 2\n"


def test_lazy_choice_looks_names_up_only_when_needed():
    calls = []

    def names():
        calls.append(1)
        return ["b", "a"]

    @click.command()
    @click.option("--pick", type=LazyChoice(names), required=True)
    def pick(pick: str) -> None:
        click.echo(pick)

    assert calls == []
    assert CliRunner().invoke(pick, ["--pick", "a"]).output == "a\n"
    bad = CliRunner().invoke(pick, ["--pick", "c"])
    assert bad.exit_code == 2 and "'c' is not one of 'b', 'a'" in bad.output
    assert "[b|a]" in CliRunner().invoke(pick, ["--help"]).output
    assert calls == [1]


def test_a_parameter_name_inside_a_path_stays():
    flags = {"out": "--out"}
    assert with_flags("/data/out/x.h5 exists; choose another out", ["out"], flags) == \
        "/data/out/x.h5 exists; choose another --out"
    assert with_flags(r"C:\out\x exists", ["out"], flags) == r"C:\out\x exists"


def test_progress_off_a_terminal_is_a_line_every_few_seconds(monkeypatch, capsys):
    import time

    from retr.common.progress import progress

    monkeypatch.setenv("RETR_PROGRESS_SECONDS", "0.05")
    for _ in progress(range(8), desc="stage", unit="img"):
        time.sleep(0.03)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and len(lines) >= 2 and all(line.startswith("stage:") for line in lines)
    assert "8/8" in lines[-1] and "img/s" in lines[-1]
    monkeypatch.setenv("RETR_PROGRESS_SECONDS", "30")
    for _ in progress(range(3), desc="short"):                 # a short stage prints nothing
        pass
    assert capsys.readouterr().err == ""
    for _ in progress(range(3), desc="quiet", quiet=True):
        time.sleep(0.01)
    assert capsys.readouterr().err == ""


def test_split_options_take_repeats_and_commas_alike(tmp_path):
    from retr.common.cli import split_list
    from retr.trainers.config import TrainConfig

    assert split_list(["train,restval", "val"]) == ("train", "restval", "val") and split_list(None) == ()
    assert TrainConfig(train_splits=("train,restval",)).train_splits == ("train", "restval")
    from retr.pipeline.commands import cli as pipeline_cli

    for command, flag in (("build-concepts", "--train-split"), ("import-scan", "--split")):
        params = {p.name: p for p in pipeline_cli.commands[command].params}
        option = next(p for p in params.values() if flag in p.opts)
        assert option.multiple and option.process_value(click.Context(pipeline_cli), ("a,b", "c")) == ("a", "b", "c")


def test_library_log_records_print_as_lines_and_v_adds_debug():
    """A command group prints the ``retr`` logger's records as plain lines on stderr (INFO and above; notes and
    warnings as written); ``-v`` adds DEBUG. Printed through click, so ``CliRunner`` sees them."""
    import logging

    from retr.common.cli import log_to_stderr, quiet_option

    @click.group()
    def group():
        log_to_stderr()

    @group.command()
    @quiet_option
    def work(quiet):
        logger = logging.getLogger("retr.trainers.training.loop")
        logger.debug("took 1.0 s")
        logger.info("epoch 1/1: loss 1.0")
        logger.warning("note: something to know")

    plain = CliRunner().invoke(group, ["work"])
    assert plain.exit_code == 0 and plain.output.splitlines() == ["epoch 1/1: loss 1.0", "note: something to know"]
    verbose = CliRunner().invoke(group, ["work", "-v"])
    assert verbose.output.splitlines() == ["took 1.0 s", "epoch 1/1: loss 1.0", "note: something to know"]
    again = CliRunner().invoke(group, ["work", "--quiet"])          # the level is set anew by each invocation
    assert again.output.splitlines() == plain.output.splitlines()
