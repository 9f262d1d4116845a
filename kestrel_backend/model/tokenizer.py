"""Tokenizer (`tokenizers`, tokenizer.json of the checkpoint) and incremental detokenization."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(folder: str | Path) -> Tokenizer | None:
    path = Path(folder) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.exists() else None


class IncrementalDetokenizer:
    """Turns a growing token list into text chunks; never emits half a UTF-8 character.

    Each call decodes only a short window (the tokens since the last emitted chunk plus the ones just
    before it, so decoders that treat a leading token specially see the same context), not the whole
    answer: the cost per token stays flat however long the answer gets. `text` is the join of every
    chunk so far, `flush()` included.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # tokens already turned into emitted text

    def add(self, token: int) -> str:
        self.tokens.append(token)
        before = self.tokenizer.decode(self.tokens[self._prefix:self._read])
        after = self.tokenizer.decode(self.tokens[self._prefix:])
        # A trailing U+FFFD is an incomplete multi-byte character: wait for its next bytes.
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return ""
        chunk = after[len(before):]
        self._prefix, self._read = self._read, len(self.tokens)
        self.text += chunk
        return chunk

    def flush(self) -> str:
        before = self.tokenizer.decode(self.tokens[self._prefix:self._read])
        after = self.tokenizer.decode(self.tokens[self._prefix:])
        if not after.startswith(before):  # never seen with byte-level BPE; joining chunks would be wrong
            raise RuntimeError("detokenizer output is not prefix-stable")
        chunk = after[len(before):]
        self._prefix = self._read = len(self.tokens)
        self.text += chunk
        return chunk
