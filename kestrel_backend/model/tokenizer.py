"""Tokenizer (`tokenizers`, tokenizer.json of the checkpoint) and incremental detokenization."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def load_tokenizer(folder: str | Path) -> Tokenizer | None:
    path = Path(folder) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.exists() else None


class IncrementalDetokenizer:
    """Turns tokens, one at a time, into text chunks; never emits half a UTF-8 character.

    tokenizers' DecodeStream does the work, at a flat cost per token however long the answer gets. `text` is
    the join of every chunk so far, `flush()` included: the full decode of the tokens.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self._stream = DecodeStream(skip_special_tokens=True)  # (as Tokenizer.decode by default)

    def add(self, token: int) -> str:
        self.tokens.append(token)
        chunk = self._stream.step(self.tokenizer, token) or ""
        self.text += chunk
        return chunk

    def flush(self) -> str:
        """The rest of the full decode: what the stream still holds back (an unfinished character)."""
        full = self.tokenizer.decode(self.tokens)
        if not full.startswith(self.text):  # never seen with byte-level BPE; joining chunks would be wrong
            raise RuntimeError("detokenizer output is not prefix-stable")
        chunk = full[len(self.text):]
        self.text = full
        return chunk
