"""Errors that cross from a Spark task to the driver: dbidx errors keep their type, and an exception raised by the
`on_task_written` hook comes back as its own type (or a HookError naming it), never as a bare Spark error.

Spark hands a task's failure to the driver as text (a Python traceback inside a Java exception), so both travel as
text: a dbidx error by its class name in the traceback, a hook's exception as a marker line that names the class's
import path and carries the message as a JSON string (unpickling bytes from a task on the driver would run whatever
they say).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import re
from typing import Any, Callable, Iterator

from dbidx import errors
from dbidx.errors import DbidxError, HookError

TaskHook = Callable[[int, int], None]
_TASK_ERROR = re.compile(r"dbidx\.errors\.(\w+): (.+)")
HOOK_ERROR_MARKER = "dbidx-hook-error"
_HOOK_ERROR = re.compile(
    re.escape(HOOK_ERROR_MARKER) + r"\[([^\s:\]]+):([^\s\]]+)\] shard=(-?\d+) attempt=(\d+) (\"(?:[^\"\\]|\\.)*\")"
)


def retyped(exc: BaseException) -> BaseException:
    """A dbidx error raised inside a Spark task comes back as a Py4J/Python exception: raise it as its own type."""
    if isinstance(exc, DbidxError):
        return exc
    match = _TASK_ERROR.search(str(exc))
    if match:
        kind = getattr(errors, match.group(1), None)
        if isinstance(kind, type) and issubclass(kind, DbidxError):
            return kind(f"{match.group(2).strip()} (raised in a Spark task)")
    return exc


@contextlib.contextmanager
def typed_errors() -> Iterator[None]:
    """Around Spark actions on a DataFrame dbidx made (`read_table`, `tag`): a dbidx error raised in a task comes out
    as its own type (e.g. HistoryCompactedError when a clean removed files of a read planned before it), the Spark
    error as its __cause__.

    Why a context manager: those DataFrames are lazy, so their tasks run inside the caller's action (`collect`,
    `write`), where dbidx cannot catch what Spark raises; `upsert` needs none, it runs its own job.
    """
    try:
        yield
    except Exception as exc:
        typed = retyped(exc)
        if typed is exc:
            raise
        raise typed from exc


def run_hook(hook: TaskHook, shard: int, attempt: int) -> None:
    """Run on_task_written in a task; an exception it raises leaves the task as a RuntimeError whose message carries
    a marker (`dbidx-hook-error[module:qualname] shard=N attempt=M "message"`) that `hook_error` turns back into
    the hook's own type on the driver.

    Why text and not pickle: Spark hands a task's failure to the driver as text (a Python traceback inside a Java
    exception), and unpickling bytes from a task on the driver would run whatever they say; the marker names only
    the class's import path and carries the message as a JSON string.
    """
    try:
        hook(shard, attempt)
    except Exception as exc:
        kind = type(exc)
        message = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
        raise RuntimeError(
            f"{HOOK_ERROR_MARKER}[{kind.__module__}:{kind.__qualname__}] shard={shard} "
            f"attempt={attempt} {json.dumps(message)}"
        ) from exc


def hook_error(exc: BaseException) -> Exception | None:
    """The exception on_task_written raised in a task, rebuilt from the marker `run_hook` put in the Spark error that
    carried it (None if there is none): the hook's own type with its message when the driver can import the type and
    build it from a message, else a HookError naming the type. A note says which task attempt raised it."""
    match = _HOOK_ERROR.search(str(exc))
    if match is None:
        return None
    module, qualname, shard, attempt, encoded = match.groups()
    try:
        message = json.loads(encoded)
    except ValueError:  # cut short on the way: keep the text as it came
        message = encoded
    error = _rebuilt(module, qualname, message) or HookError(
        f"on_task_written raised {module}.{qualname}: {message} (that type cannot be imported or built from a "
        "message on the driver, so it is reported as HookError)"
    )
    error.add_note(
        f"raised by on_task_written in the task of shard {shard}, attempt {attempt}, and re-raised on the "
        "driver; the Spark error that carried it is its __cause__"
    )
    return error


def _rebuilt(module: str, qualname: str, message: str) -> Exception | None:
    """An instance of the exception class `module:qualname` made from its message, or None if there is no such
    importable Exception subclass or it cannot be built from one string."""
    try:
        kind: Any = importlib.import_module(module)
        for name in qualname.split("."):
            kind = getattr(kind, name)
        if isinstance(kind, type) and issubclass(kind, Exception):
            return kind(message)
    except Exception:  # noqa: BLE001 - not importable, a local class, or another constructor: HookError instead
        return None
    return None
