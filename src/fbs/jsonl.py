"""JSON-lines reading with errors that name the file and the line."""

from __future__ import annotations

import json
from typing import Iterable, Iterator


def iter_records(lines: Iterable[str], origin: str, error: type[Exception] = ValueError,
                 fix: str = "each line must be one JSON object") -> Iterator[tuple[int, dict]]:
    """``(line_number, object)`` for each non-empty line; ``error`` names ``origin:line`` and ``fix``
    for a malformed line or a line that is not a JSON object."""
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{origin}:{n}: malformed JSONL ({exc.msg}); {fix}") from exc
        if not isinstance(rec, dict):
            raise error(f"{origin}:{n}: expected a JSON object; {fix}")
        yield n, rec
