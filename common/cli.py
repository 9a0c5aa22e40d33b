"""Command-line conventions shared by ``retr-pipeline`` and ``retr-train``.

* user errors print ``error: …`` on stderr and exit with status 1, without a traceback;
* usage errors (bad option) print click's usage hint, then ``error: …``, and exit with status 2;
* progress bars are tqdm bars that switch themselves off when stderr is not a terminal or with ``--quiet``.
"""
from __future__ import annotations

import sys
from typing import Iterable, Iterator, TypeVar

import click
from tqdm import tqdm

from retr.common.errors import RetrError

T = TypeVar("T")


def fail(message: str, code: int = 1) -> None:
    """Print one ``error:`` line and exit."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def run(group: click.Group, args: list[str] | None = None) -> None:
    """Run a click group with retr's error conventions (entry point of every console script)."""
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
    except RetrError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted (finished work is kept; run the same command again to resume)", 130)
    if isinstance(rv, int) and rv != 0:
        sys.exit(rv)


def progress(iterable: Iterable[T] | None = None, *, total: int | None = None, desc: str = "",
             unit: str = "it", quiet: bool = False, **kwargs) -> Iterator[T] | tqdm:
    """A tqdm bar (rate and ETA), hidden with ``quiet`` or when stderr is not a terminal."""
    disable = quiet or not sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=disable, dynamic_ncols=True,
                smoothing=0.05, **kwargs)


def quiet_option(f):
    """The ``--quiet`` flag every long-running command takes."""
    return click.option("--quiet", is_flag=True, help="No progress bar, only the final summary.")(f)
