"""Tokenizer (`tokenizers`, tokenizer.json of the checkpoint) and incremental detokenization."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(folder: str | Path) -> Tokenizer | None:
    path = Path(folder) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.exists() else None


class IncrementalDetokenizer:
    """Turns a growing token list into text chunks; never emits half a UTF-8 character.

    Joining every chunk (including `flush()`) gives exactly `text`, the decode of all tokens.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        # A trailing U+FFFD is an incomplete multi-byte character: wait for its next bytes.
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        chunk = text[len(self.emitted):]
        self.emitted = text
        return chunk

    def flush(self) -> str:
        text = self.text
        if not text.startswith(self.emitted):  # decoder rewrote earlier text: never seen with byte-level BPE
            raise RuntimeError("detokenizer output is not prefix-stable")
        chunk = text[len(self.emitted):]
        self.emitted = text
        return chunk

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.tokens)
