"""The command line's one way to report a user error: a red ``error:`` line on stderr, then exit status 2.

The libraries check their inputs and raise named errors (``SimulationError``, ``EvaluationError``, ...);
a command turns them into this report with :func:`reported`, or reports its own option-parsing errors
with :func:`fail`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` on stderr; the exit to raise (``raise fail(...)``)."""
    _console.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    return typer.Exit(code)


@contextmanager
def reported(*errors: type[Exception], prefix: str = "") -> Iterator[None]:
    """Inside the block, an error of one of these types exits 2 with its message (after ``prefix``)."""
    try:
        yield
    except errors as err:
        raise fail(f"{prefix}{err}") from None
