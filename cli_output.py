"""What every `dbidx` command shares: its output (text or one JSON object), progress on stderr, and how it names a
table (its URI, the first argument).

Imported by cli.py and cli_cache.py; it imports neither, so there is no cycle.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, is_dataclass
from typing import Any, Callable

import click

from dbidx.progress import Progress, null_progress

json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")


class Output:
    """Prints a command's result as human text or as one JSON object (`--json`)."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def emit(self, payload: dict[str, Any], text: Callable[[dict[str, Any]], str]) -> None:
        """Print the payload: JSON verbatim, or through the command's text formatter."""
        if self.as_json:
            click.echo(json.dumps(payload, indent=2, sort_keys=True, default=_jsonable))
        else:
            click.echo(text(payload))

    def fail(self, kind: str, message: str, code: int, usage: click.ClickException | None = None) -> None:
        """Report a failure caught at the top level and exit with its code."""
        if self.as_json:
            click.echo(json.dumps({"error": kind, "message": message}))
        if usage is not None and not self.as_json:
            usage.show()
        else:
            click.echo(f"Error: {message}", err=True)
        sys.exit(code)


def _jsonable(value: Any) -> Any:
    if is_dataclass(value):
        return asdict(value)  # type: ignore[arg-type]
    return str(value)


def wants_json(as_json: bool = False) -> bool:
    """Whether this invocation prints JSON (`--json` on the command or on the group)."""
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    return as_json or bool(root is not None and (root.obj or {}).get("json"))


def output(as_json: bool) -> Output:
    """The command's Output: JSON when the command or the group (`dbidx --json ...`) asked for it."""
    return Output(wants_json(as_json))


def storage_options() -> dict[str, str]:
    """The --storage-option values given to the top-level command."""
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    return dict((root.obj or {}).get("storage_options", {})) if root is not None else {}


def open_table(uri: str) -> Any:
    """The table at URI, with the group's --storage-option values."""
    from dbidx.table.facade import Table

    return Table.open(uri, storage_options=storage_options())


class ProgressBar:
    """Shows a dbidx.progress.Progress on stderr: a click bar on a terminal, else a log line per step at most every
    `every_s` seconds (the first and last always); nothing with --json, whose stdout stays one JSON object."""

    def __init__(self, label: str, quiet: bool, every_s: float = 1.0) -> None:
        self.label, self.quiet, self.every_s = label, quiet, every_s
        self.tty = sys.stderr.isatty()
        self.bar: Any = None
        self.started = self.logged = 0.0

    def __enter__(self) -> Progress:
        self.started = time.monotonic()
        return null_progress if self.quiet else self

    def __call__(self, done: int, total: int, step: str = "", rows: int = 0) -> None:
        """Show one step: done of total, what finished, rows and rows/s so far."""
        now = time.monotonic()
        rate = f", {rows:,} rows, {rows / max(now - self.started, 1e-6):,.0f} rows/s" if rows else ""
        if self.tty:
            if self.bar is None:
                self.bar = click.progressbar(
                    length=max(total, 1), label=self.label, file=sys.stderr, item_show_func=lambda item: item
                ).__enter__()
            self.bar.length = max(total, 1)
            self.bar.update(done - self.bar.pos, current_item=f"{step}{rate}")
        elif done >= total or not self.logged or now - self.logged >= self.every_s:
            self.logged = now
            click.echo(f"{self.label}: {done:,}/{total:,} {step}{rate}", err=True)

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def table_argument() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """URI, the table, as the command's first argument (the one way every command names its table)."""
    return click.argument("uri")
