"""Chunking: a job's input file checked as the cloud checks it (JSON Lines: one JSON object a line, no blank line,
UTF-8; the file and line limits) and split into its lines, each a row of the job store (where it is in the file).
A file that fails fails its job (validation_error, limit_exceeded, empty_batch); a line's own fields are checked
when it runs (its error is that line's alone)."""

from __future__ import annotations

import json

from .limits import BatchLimits

ROWS_AT_ONCE = 5000  # lines written to the store a transaction


class BatchFileError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def split_lines(path: str, limits: BatchLimits, add_lines) -> int:
    """Reads the file once; add_lines(spans, first_index) is given ROWS_AT_ONCE lines at a time. Returns the count."""
    spans, count, offset = [], 0, 0
    with open(path, "rb") as f:
        while True:
            raw = f.readline(limits.max_line_bytes + 2)
            if not raw:
                break
            number = count + 1
            text = raw.rstrip(b"\r\n")  # (a longer line is cut at max + 2 bytes: still too long without them)
            if len(text) > limits.max_line_bytes:
                raise BatchFileError("limit_exceeded", f"line {number} is over the {limits.max_line_bytes} byte "
                                                       "line limit")
            if not text.strip():
                raise BatchFileError("validation_error", f"line {number} is blank; JSON Lines has none")
            try:
                value = json.loads(text.decode("utf-8"))
            except UnicodeDecodeError:
                raise BatchFileError("validation_error", f"line {number} is not UTF-8 text") from None
            except (json.JSONDecodeError, RecursionError) as e:
                raise BatchFileError("validation_error", f"line {number} is not JSON: "
                                                         f"{getattr(e, 'msg', 'nested too deeply')}") from None
            if not isinstance(value, dict):
                raise BatchFileError("validation_error", f"line {number} is not a JSON object")
            if count >= limits.max_lines:
                raise BatchFileError("limit_exceeded", f"the file has more than {limits.max_lines} lines")
            line_id = json.dumps(value["id"]) if "id" in value else None
            spans.append((offset, len(text), line_id))
            offset += len(raw)
            count += 1
            if len(spans) == ROWS_AT_ONCE:
                add_lines(spans, count - len(spans))
                spans = []
    if spans:
        add_lines(spans, count - len(spans))
    if count == 0:
        raise BatchFileError("empty_batch", "the file has no lines")
    return count
