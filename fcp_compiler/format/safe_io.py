"""Reading untrusted inputs and writing outputs without surprises.

Inputs must be regular files under MAX_INPUT_BYTES (a FIFO or a device is refused before it can block or stream
forever); JSON numbers are bounded and finite, and nesting is bounded. Outputs go to a temporary name in the target's
folder and are renamed into place only if the target is absent or a regular file (never over a device node, a FIFO
or a folder), several files together or none.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from fcp_compiler.errors import FcpError, InvalidInputError

MAX_INPUT_BYTES = 2**28  # 256 MiB: a batch of a million lengths is a few MB
MAX_NUMBER_CHARS = 40  # digits (and sign, point, exponent) of one JSON number
MAX_JSON_DEPTH = 64


def open_regular_file(path: str, what: str, error: type[FcpError] = InvalidInputError) -> tuple[BinaryIO, int]:
    """Open a regular file for reading, and its size; a FIFO or device is refused before it can block (the open
    does not wait for a writer).

    Raises:
        `error`: missing, unreadable or not a regular file (one line, naming the file).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise error(f"{what} file {path!r} does not exist") from None
    except OSError as failure:
        raise error(f"{what} file {path!r} cannot be read: {failure.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise error(f"{what} file {path!r} is not a regular file")
    return os.fdopen(fd, "rb"), info.st_size


def read_input_bytes(path: str | Path, what: str, max_bytes: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of a regular input file of at most `max_bytes`.

    Raises:
        InvalidInputError: missing, unreadable, not a regular file, or too large (one line, naming the file).
    """
    path = str(path)
    handle, size = open_regular_file(path, what)
    with handle:
        if size > max_bytes:
            raise InvalidInputError(f"{what} file {path!r} has {size} bytes, more than the {max_bytes} allowed")
        return handle.read(max_bytes + 1)


def read_input_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of a regular input file (see :func:`read_input_bytes`)."""
    data = read_input_bytes(path, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidInputError(f"{what} file {str(path)!r} is not UTF-8 text (byte {data[error.start]:#04x} at "
                                f"offset {error.start})") from None


def _number(text: str, kind):
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"number {text[:20]}... has {len(text)} characters, more than {MAX_NUMBER_CHARS}")
    value = kind(text)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"number {text} is not finite")
    return value


def _constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows here")


def _depth(value, limit: int) -> int:
    """Nesting depth of decoded JSON, stopping past `limit`."""
    stack, deepest = [(value, 1)], 0
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """An object's members; a key given twice is refused (json.loads would keep the last one silently)."""
    value: dict = {}
    for key, member in pairs:
        if key in value:
            raise ValueError(f"key {key!r} appears more than once in one object; give it once")
        value[key] = member
    return value


def parse_json(text: str, origin: str) -> object:
    """Decode JSON with bounded numbers (at most MAX_NUMBER_CHARS characters, finite), no NaN or Infinity, and at
    most MAX_JSON_DEPTH levels of nesting.

    Raises:
        InvalidInputError: one line naming `origin` and what is wrong.
    """
    try:
        value = json.loads(text, parse_int=lambda t: _number(t, int), parse_float=lambda t: _number(t, float),
                           parse_constant=_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        raise InvalidInputError(f"{origin} is not valid JSON: {error.msg} at line {error.lineno}") from None
    except ValueError as error:
        raise InvalidInputError(f"{origin}: {error}") from None
    except RecursionError:
        raise InvalidInputError(f"{origin}: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    if _depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise InvalidInputError(f"{origin}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def check_output_target(path: Path) -> None:
    """Refuse an output path that exists and is not a regular file (a device node, FIFO or folder), or whose
    folder cannot be made.

    Raises:
        InvalidInputError: naming the path.
    """
    try:
        info = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError as error:
        raise InvalidInputError(f"cannot write {str(path)!r}: {error.strerror}") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "a folder" if stat.S_ISDIR(info.st_mode) \
            else "not a regular file"
        raise InvalidInputError(f"cannot write {str(path)!r}: it is {kind}; give a new or regular file path")


def _same_file(first: Path, second: Path) -> bool:
    try:
        return os.path.samefile(first, second)
    except OSError:  # one does not exist yet: the same path, once links and '..' are resolved
        return os.path.realpath(first) == os.path.realpath(second)


def check_outputs(outputs: Sequence[tuple[str, Path | None]], inputs: Sequence[tuple[str, Path | None]] = ()) -> None:
    """Refuse, before any work, an output that is not a new or regular file, two outputs that are one file, and an
    output that is one of the inputs (writing it would destroy what was read).

    Args:
        outputs, inputs: (what the user called it: a flag or argument name, its path or None when not given).
    Raises:
        InvalidInputError: naming both paths.
    """
    given = [(name, Path(path)) for name, path in outputs if path is not None]
    for idx, (name, path) in enumerate(given):
        check_output_target(path)
        for other_name, other in given[:idx]:
            if _same_file(path, other):
                raise InvalidInputError(f"{name} {str(path)!r} and {other_name} {str(other)!r} are the same file; "
                                        f"give each output its own path")
        for input_name, source in inputs:
            if source is not None and _same_file(path, Path(source)):
                raise InvalidInputError(f"{name} {str(path)!r} is the input {input_name} {str(source)!r}; writing it "
                                        f"would destroy the input: give another path")


def write_files_atomic(outputs: Sequence[tuple[Path, bytes]]) -> None:
    """Write several files together: each to a temporary name in its folder first, and only when all are written,
    every rename, one after another (a write that fails, a full disk or a bad target, leaves none of them).

    Raises:
        InvalidInputError: a target that is not a regular file, or a folder that cannot be written (nothing is
            left behind).
    """
    for path, _ in outputs:
        check_output_target(path)
    staged: list[tuple[str, Path]] = []
    try:
        for path, data in outputs:
            staged.append((_stage(path, data), path))
        for temporary, path in staged:
            check_output_target(path)  # again, just before replacing it
            os.replace(temporary, path)
    except BaseException:
        for temporary, _ in staged:
            Path(temporary).unlink(missing_ok=True)
        raise


def _stage(path: Path, data: bytes) -> str:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as error:
        raise InvalidInputError(f"cannot write {str(path)!r}: {error.strerror}") from None
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
    except OSError as error:  # a full disk, a quota: name the file the user asked for, not the temporary one
        Path(temporary).unlink(missing_ok=True)
        raise InvalidInputError(f"cannot write {str(path)!r}: {error.strerror or error}") from None
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return temporary


def write_atomic(path: Path, data: bytes) -> None:
    """Write bytes to `path` through a temporary file in the same folder, so no half-written file remains; a path
    that exists and is not a regular file is refused (:func:`write_files_atomic`)."""
    write_files_atomic([(Path(path), data)])
