"""Orbax's failures in one line, and the noise they leave quiet: a failed restore
or save is reported by eqtrain in one sentence; the tracebacks of its abandoned
reads, its ERROR log records and asyncio's complaints are dropped."""

import inspect
import logging
import os
import re
import sys
import traceback
from typing import Any


# An Orbax read error quotes the array's whole TensorStore spec (as the repr of a
# bound method, in this Orbax); the array's key in it is the relative `path`.
_ARRAY_PATH = re.compile(r"'path': '([^'/][^']*)/'")
# TensorStore's I/O errors carry the OS error code and the file, as text.
_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")
_FAILED_WRITING = re.compile(r'Failed (?:writing|to write)[^"]*"([^"]+)"')
_SPEC_NOISE = (" [tensorstore_spec", " [source locations", " See full", " <bound")


def _innermost(e: BaseException) -> BaseException:
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def _first_line(text: str) -> str:
    """The first line of `text`, without TensorStore's specs and source
    locations, nor the OCDBT database's path."""
    line = (text.strip().splitlines() or [""])[0]
    for cut in _SPEC_NOISE:
        line = line.split(cut)[0]
    return re.sub(r' in OCDBT database at [^"]*"[^"]*"', "", line).rstrip(" .:")


def _shortened(line: str) -> str:
    return line[:300] + ("..." if len(line) > 300 else "")


def read_error(e: BaseException) -> str:
    """A failed read in one readable line: the array (when the error names one)
    and the innermost cause, without TensorStore's specs, source locations or
    database paths."""
    array = _ARRAY_PATH.search(str(e))
    cause = _innermost(e)
    line = _first_line(str(cause))
    if array and line:  # TensorStore's message starts with its status code
        return _shortened(f"array {array.group(1)}: {line}")
    return _shortened(
        f"{type(cause).__name__}: {line}" if line else type(cause).__name__
    )


def _deepest(e: BaseException) -> BaseException:
    """The innermost cause or context of `e`."""
    while (inner := e.__cause__ or e.__context__) is not None:
        e = inner
    return e


def _os_error(text: str) -> str | None:
    """An OS error named in a TensorStore message: its meaning and the file."""
    code = _OS_ERROR_CODE.search(text)
    if not code:
        return None
    path = _FAILED_WRITING.search(text)
    where = f" writing {path.group(1)}" if path else ""
    return f"{os.strerror(int(code.group(1)))}{where}"


def write_error(e: BaseException) -> str:
    """The innermost cause of a failed write, in one line."""
    e = _deepest(e)
    if isinstance(e, OSError) and e.strerror:
        where = f" writing {e.filename}" if e.filename else ""
        return f"{e.strerror}{where}"
    text = str(e)
    if (os_error := _os_error(text)) is not None:
        return os_error
    lines = text.strip().splitlines()
    line = (lines[0] if lines else type(e).__name__).split(" [tensorstore_spec")[0]
    return f"{type(e).__name__}: {line[:300]}"


def _orbax_code(code: Any) -> bool:
    return f"{os.sep}orbax{os.sep}" in getattr(code, "co_filename", "")


def _abandoned(unraisable: Any) -> bool:
    """Noise left by a failed Orbax restore or save, reported when Python drops
    it: the reads still in flight when Orbax gave up and closed its event loop
    (their coroutines, closed unfinished, turn the close into an error naming
    the array), and TensorStore's threads finding that loop closed."""
    value, obj = unraisable.exc_value, unraisable.object
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
        return True
    return inspect.iscoroutine(obj) and _orbax_code(obj.cr_code)


class _QuietAbandonedTasks(logging.Filter):
    """asyncio's "Task was destroyed but it is pending" and "exception was never
    retrieved" for the tasks a failed Orbax restore left behind (the failure
    itself is reported, in one paragraph)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "never retrieved" not in text and "destroyed but it is pending" not in text:
            return True
        if "orbax" in text:
            return False
        tb = record.exc_info[2] if record.exc_info else None
        return not any(_orbax_code(f.f_code) for f, _ in traceback.walk_tb(tb))


class _QuietOrbaxErrors(logging.Filter):
    """Orbax logs a failed background save as several ERROR records with full
    tracebacks; `Checkpointer` reports it itself, in one sentence."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        return f"{os.sep}orbax{os.sep}" not in (record.pathname or "")


def _add_filter(logger_name: str, kind: type[logging.Filter]) -> None:
    """Add a `kind` filter to the logger, once."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, kind) for f in logger.filters):
        logger.addFilter(kind())


def quiet_closed_loop() -> None:
    """Drop what a failed Orbax restore or save leaves behind on standard error
    after eqtrain reported the failure: tracebacks of its abandoned reads (as
    unraisable exceptions, when Python collects them) and asyncio's log records
    about them. Anything else still reaches the previous hook and the log."""
    _add_filter("asyncio", _QuietAbandonedTasks)
    previous = sys.unraisablehook
    if getattr(previous, "_eqtrain_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        if not _abandoned(unraisable):
            previous(unraisable)

    hook._eqtrain_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def quiet_orbax() -> None:
    """`quiet_closed_loop`, and Orbax's own ERROR records of a failed save."""
    _add_filter("absl", _QuietOrbaxErrors)
    quiet_closed_loop()
