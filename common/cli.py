"""Command-line conventions shared by ``retr-pipeline`` and ``retr-train``: ``error: …`` lines (status 1; usage
errors status 2), library errors in the command's own flags, log records on stderr (docs/DESIGN.md, "Conventions").
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any, Callable, Iterable

import click

from retr.common.errors import ParameterError, RetrError, UserError, with_flags
from retr.common.paths import check_input, check_output_file, check_output_folder

_WRAPPED = "_retr_flags_in_errors"


def parameter_flags(ctx: click.Context | None) -> dict[str, str]:
    """How the running command's user writes each parameter: an option's first long flag, an argument's metavar (the
    command's parameters first, then its groups')."""
    flags: dict[str, str] = {}
    while ctx is not None:
        for param in ctx.command.params:
            if not param.name or param.name in flags:
                continue
            if isinstance(param, click.Option):
                flags[param.name] = next((o for o in param.opts if o.startswith("--")), param.opts[0])
            else:
                flags[param.name] = param.human_readable_name
        ctx = ctx.parent
    return flags


def error_message(exc: BaseException, ctx: click.Context | None = None) -> str:
    """The one-line text of a :class:`RetrError` or :class:`ParameterError`, in the running command's flags.

    ``ctx`` defaults to click's current context; outside a command the text is the library's own."""
    text = exc.message if isinstance(exc, ParameterError) else str(exc)
    parameters = getattr(exc, "parameters", ())
    if not parameters:
        return text
    return with_flags(text, parameters, parameter_flags(ctx or click.get_current_context(silent=True)))


def flags_in_errors(command: click.Command) -> click.Command:
    """Make ``command`` (and every command under a group) word library errors in its own flags (idempotent).

    A :class:`~retr.common.errors.ParameterError` becomes a :class:`~retr.common.errors.UserError`, a ``RetrError``
    keeps its class, both with parameter names replaced by flags (:func:`with_flags`); other exceptions pass
    through. Mechanism: docs/DESIGN.md ("Conventions")."""
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            flags_in_errors(sub)
    callback = command.callback
    if callback is None or getattr(callback, _WRAPPED, False):
        return command

    @functools.wraps(callback)
    def report_in_flags(*args, **kwargs):
        try:
            return callback(*args, **kwargs)
        except ParameterError as exc:
            raise UserError(error_message(exc)) from exc
        except RetrError as exc:
            if exc.parameters:
                exc.args, exc.parameters = (error_message(exc),), ()
            raise

    setattr(report_in_flags, _WRAPPED, True)
    command.callback = report_in_flags
    return command


def one_line(text: str) -> str:
    """``text`` on one line: its lines joined by spaces (click lists a choice's values one per line)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def fail(message: str, code: int = 1) -> None:
    """Print one ``error:`` line and exit."""
    click.echo(f"error: {one_line(message)}", err=True)
    sys.exit(code)


def run(group: click.Group, args: list[str] | None = None) -> None:
    """Run a click group with retr's error conventions (entry point of every console script)."""
    flags_in_errors(group)
    try:
        rv = group.main(args=args, standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.UsageError as exc:
        if exc.ctx is not None:
            click.echo(exc.ctx.get_usage(), err=True)
            click.echo(f"Try '{exc.ctx.command_path} --help' for help.", err=True)
        fail(exc.format_message(), exc.exit_code)
    except click.ClickException as exc:
        fail(exc.format_message(), exc.exit_code)
    except click.Abort:
        fail("aborted")
    except (RetrError, ParameterError) as exc:  # a ParameterError here came from outside a command's callback
        fail(error_message(exc))
    except KeyboardInterrupt:
        fail("interrupted (finished work is kept; run the same command again to resume)", 130)
    if isinstance(rv, int) and rv != 0:
        sys.exit(rv)


def _name(param: click.Parameter | None) -> str:
    """How a user writes ``param``: an option's first long flag, an argument's metavar."""
    if param is None:
        return "the path"
    if isinstance(param, click.Option):
        return next((o for o in param.opts if o.startswith("--")), param.opts[0])
    return param.human_readable_name


class InputPath(click.ParamType):
    """A path a command reads, checked when the command line is parsed (:func:`retr.common.paths.check_input`):
    ``--features X does not exist``, ``… is a folder, not a feature set (.h5 file)`` — one ``error:`` line,
    before any work. ``kind``: ``file``, ``folder`` or ``any`` (either); ``what``: what the path should be, in words; ``takes``:
    values taken as they are (``hf-hub:ORG/NAME`` where a run goes); ``holds``: a file a folder must hold (a run's
    ``config.json``); ``resource``: a download the user makes (annotations, models), so an absent path is left to
    the command's own line saying what is missing, where it looked and how to get it; ``path_type``: the value's
    type."""

    def __init__(self, kind: str = "file", what: str | None = None, takes: Callable[[str], bool] | None = None,
                 holds: str | None = None, resource: bool = False, path_type: type = str):
        self.kind, self.what, self.takes, self.holds, self.path_type = kind, what, takes, holds, path_type
        self.resource = resource
        self.name = {"folder": "folder", "any": "path"}.get(kind, "file")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and self.takes is not None and self.takes(value):
            return value
        if self.resource and not os.path.lexists(value):
            return self.path_type(value)
        return self.path_type(check_input(value, _name(param), self.kind, self.what, self.holds))


class OutputPath(click.ParamType):
    """A file or folder a command writes, checked when the command line is parsed
    (:func:`retr.common.paths.check_output_folder` / :func:`~retr.common.paths.check_output_file`): a file where
    the folder goes, a folder where the file goes, or a place that takes no files (read-only, no permission) is
    one ``error:`` line naming the option, before anything is loaded or read."""

    def __init__(self, kind: str = "folder", path_type: type = str):
        if kind not in ("file", "folder"):
            raise ValueError(f"kind must be 'file' or 'folder', not {kind!r}")
        self.kind, self.path_type = kind, path_type
        self.name = kind

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        check = check_output_folder if self.kind == "folder" else check_output_file
        return self.path_type(check(value, _name(param)))


class LazyChoice(click.Choice):
    """A ``click.Choice`` whose names come from ``names()``, called once when click first needs them."""

    def __init__(self, names: Callable[[], Iterable[str]], case_sensitive: bool = True):
        self._names, self._choices = names, None
        super().__init__((), case_sensitive=case_sensitive)

    @property
    def choices(self) -> tuple[str, ...]:
        if self._choices is None:
            self._choices = tuple(self._names())
        return self._choices

    @choices.setter
    def choices(self, value: Iterable[str]) -> None:  # click.Choice.__init__ assigns (); the names win
        pass


def split_list(values: Iterable[str] | str | None) -> tuple[str, ...]:
    """Split names given repeated (``--split a --split b``), comma-separated (``--split a,b``) or both."""
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    return tuple(part.strip() for value in values for part in str(value).split(",") if part.strip())


def splits_option(*names: str, default: tuple[str, ...] | None = None, help: str = ""):
    """A split option spelled the same in every command: repeatable, commas accepted (``--train-split
    train,restval`` = ``--train-split train --train-split restval``); extra ``names`` keep old spellings."""
    return click.option(*names, multiple=True, default=default or (), show_default=bool(default),
                        callback=lambda _ctx, _param, value: split_list(value),
                        help=help + " Repeat the option or give a comma-separated list.")


class _EchoHandler(logging.Handler):
    """A record's message as one line on stderr, written through click so that ``CliRunner`` captures it."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(record.getMessage(), err=True)


def log_to_stderr(level: int = logging.INFO) -> None:
    """Print the ``retr`` logger's records at ``level`` and above (a command group calls it, once per run)."""
    logger = logging.getLogger("retr")
    logger.handlers = [h for h in logger.handlers if not isinstance(h, _EchoHandler)] + [_EchoHandler()]
    logger.setLevel(level)


def _verbose(_ctx, _param, value: bool) -> None:
    if value:
        logging.getLogger("retr").setLevel(logging.DEBUG)


def quiet_option(f):
    """``--quiet`` (no progress bar) and ``-v`` (debug lines too, e.g. timings): the flags every long-running
    command takes."""
    f = click.option("-v", "--verbose", is_flag=True, expose_value=False, callback=_verbose,
                     help="Also print debug lines (timings).")(f)
    return click.option("--quiet", is_flag=True, help="No progress bar (progress lines, notes and warnings stay).")(f)


# ------------------------------------------------------------------------------------------------ options page

def command_help_records(group: click.Group, program: str) -> list[tuple[click.Command, str, str, list]]:
    """``[(command, command line, usage, [(parameter, option, help)])]`` of every command under ``group``,
    subcommands included, in the order ``PROGRAM --help`` lists them: each option as its ``--help`` shows it
    (click's own help records: flags, value, help text with its default), hidden options left out. What
    docs/options.md is made from (``tools/options_page.py``)."""
    out = []

    def walk(command: click.Command, path: list[str], parent: click.Context | None) -> None:
        ctx = click.Context(command, info_name=path[-1], parent=parent, **command.context_settings)
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                walk(command.get_command(ctx, name), [*path, name], ctx)
            return
        records = [(param, *record) for param in command.get_params(ctx)
                   if isinstance(param, click.Option) and (record := param.get_help_record(ctx))]
        out.append((command, " ".join(path), " ".join([*path, *command.collect_usage_pieces(ctx)]), records))

    walk(group, [program], None)
    return out
