"""Reading a user's UTF-8 text file, with one-line errors that name the file and what it was given as."""
from __future__ import annotations

from pathlib import Path

from trtinfer.errors import InputError


def read_text_file(path: str | Path, what: str, hint: str, error: type[InputError] = InputError) -> str:
    """The text of ``path``; ``error`` (one line, starting with ``what`` and the path) when it is missing, not a
    file, unreadable or not UTF-8. ``hint`` says what to give instead of a missing file."""
    file = Path(path)
    if not file.is_file():
        raise error(f"{what} {path} does not exist or is not a file; {hint}")
    try:
        data = file.read_bytes()
    except OSError as e:
        raise error(f"{what} {path} could not be read ({e.strerror or e}); check its permissions") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                    "convert it to UTF-8") from None
