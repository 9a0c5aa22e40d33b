"""Command-line conventions shared by ``retr-pipeline`` and ``retr-train``.

* user errors print ``error: …`` on stderr and exit with status 1, without a traceback;
* a bad argument value that a library call refuses (:class:`~retr.common.errors.ParameterError`, which names
  the parameter) is such a user error, printed with the command's flag in place of the parameter name
  (:func:`flags_in_errors`);
* usage errors (bad option) print click's usage hint, then ``error: …``, and exit with status 2;
* progress bars: :mod:`retr.common.progress` (library code uses them without this module).
"""
from __future__ import annotations

import functools
import sys
from typing import Callable, Iterable

import click

from retr.common.errors import ParameterError, RetrError, UserError, with_flags

_WRAPPED = "_retr_flags_in_errors"


def parameter_flags(ctx: click.Context | None) -> dict[str, str]:
    """How the user of the running command writes each of its parameters, from click's own parameter lists.

    An option becomes its first long flag (``image_size`` → ``--image-size``, ``name`` of ``--extractor`` →
    ``--extractor``), an argument its metavar (``dataset`` → ``DATASET``). The command's parameters come first,
    then those of the groups above it.
    """
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

    ``ctx`` defaults to click's current context; outside a command the text is the library's own.
    """
    text = exc.message if isinstance(exc, ParameterError) else str(exc)
    parameters = getattr(exc, "parameters", ())
    if not parameters:
        return text
    return with_flags(text, parameters, parameter_flags(ctx or click.get_current_context(silent=True)))


def flags_in_errors(command: click.Command) -> click.Command:
    """Make ``command`` (and, for a group, every command under it) report library errors in its own flags.

    The mechanism, in three parts:

    1. Library code names parameters, never flags. It validates an argument by raising
       :class:`~retr.common.errors.ParameterError` — a ``ValueError`` that carries the names its message
       mentions, ``ParameterError("image_size must be a multiple of 32, not 100", "image_size")``. A
       :class:`~retr.common.errors.RetrError` about a file may name parameters too (its ``parameters``), e.g.
       "… if you trust the file, set trust_checkpoint".
    2. This wrapper runs the command's callback. When such an error leaves it, the click context is still live,
       so each named parameter is mapped through the command's own parameter list (:func:`parameter_flags`;
       nothing is hand-written) and replaced in the message (:func:`with_flags`). A ``ParameterError`` is
       re-raised as a :class:`~retr.common.errors.UserError` with that text (chained to the original); a
       ``RetrError`` keeps its class with the text rewritten.
    3. :func:`run` prints a ``RetrError`` as one ``error: --image-size must be …`` line and exits with status 1.

    Every other exception passes through unchanged: a plain ``ValueError`` is a bug and keeps its traceback.
    A command that catches errors itself to go on (``extract-preset``) formats them with :func:`error_message`.
    Wrapping is idempotent: a console script's group applies it once its commands are registered (so
    ``CliRunner`` sees the same), and :func:`run` applies it again to the whole command tree.
    """
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


def fail(message: str, code: int = 1) -> None:
    """Print one ``error:`` line and exit."""
    click.echo(f"error: {message}", err=True)
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


class LazyChoice(click.Choice):
    """A ``click.Choice`` whose names come from ``names()``, called when click first needs them.

    For registries that are filled by importing heavy modules (the extractors import torchvision): ``--help``
    and a wrong value still list every choice, but importing the command, or running another one, imports
    nothing. The names are looked up once.
    """

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


def quiet_option(f):
    """The ``--quiet`` flag every long-running command takes."""
    return click.option("--quiet", is_flag=True, help="No progress bar, only the final summary.")(f)
