"""Memory sizes as people write them ("4GiB", "512MB", "1073741824"), via pydantic's ByteSize."""

from __future__ import annotations

from pydantic import ByteSize, TypeAdapter, ValidationError

_SIZE = TypeAdapter(ByteSize)


def parse_size(text: str | int) -> int:
    """Bytes in ``text``; KB/MB/GB are powers of 1000, KiB/MiB/GiB powers of 1024."""
    try:
        return int(_SIZE.validate_python(text))
    except ValidationError:
        raise ValueError(
            f"{text!r} is not a memory size (e.g. 4GiB, 512MiB, 2GB or a byte count)"
        ) from None


def format_size(n: int) -> str:
    """``n`` bytes in binary units, for messages and tables."""
    return ByteSize(n).human_readable()
