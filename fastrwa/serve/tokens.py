"""The server's tokenizer, the byte tokenizer of ``fastrwa.hf`` (``FastRWAByteTokenizer``)
written for the routes: ids 0-255 are the UTF-8 bytes of a text and 256 is BOS (the
model's ``bos_token`` and ``eos_token``), whose text is ``"<bos>"``.

* :func:`encode` (``POST /tokenize``): a text's bytes as they are, with two exceptions
  that let a client find the special id by its text, as lm-eval's remote tokenizer does
  (``encode(bos_token)[0]``): the text ``"<bos>"`` alone is ``[256]`` (anywhere else in a
  text it is its five bytes: a document is never read differently), and with
  ``add_special_tokens`` the empty text is ``[256]`` (the context ``ByteLM.generate``
  gives an empty prompt).
* :func:`decode` (``POST /detokenize``): ids back to text, UTF-8 with U+FFFD for bytes
  that are not, ``"<bos>"`` for BOS.
* :func:`token_text`: one id as ``logprobs.tokens`` and the keys of ``top_logprobs`` show
  it: an ASCII byte is its character, another byte ``"bytes:\\xNN"`` (its hex, as OpenAI
  shows a token that is not UTF-8 on its own: every byte has a key of its own), BOS
  ``"<bos>"``.
* :class:`Transcript`: a completion's ids as its text, incrementally, with each id's
  ``text_offset`` (the index in the text of the character the id's byte is part of).

Example::

    >>> encode("hé"), encode(""), encode("", add_special_tokens=False), encode("<bos>")
    ([104, 195, 169], [256], [], [256])
    >>> decode([256, 104, 195, 169]), [token_text(i) for i in (104, 195, 256)]
    ('<bos>hé', ['h', 'bytes:\\\\xc3', '<bos>'])
    >>> t = Transcript()
    >>> t.add([104, 195]), t.add([169, 33], final=True)
    (('h', [0, 1]), ('é!', [1, 2]))
"""

from __future__ import annotations

import codecs
from typing import Iterable

from ..models.config import BYTE_VOCAB
from ..models.directory import BOS

BOS_ID = BYTE_VOCAB             # 256, the id past the bytes (LMConfig.bos_token)
BOS_TEXT = BOS                  # its text ("<bos>", the Hugging Face tokenizer's)


def encode(text: str, add_special_tokens: bool = True) -> list[int]:
    """``text``'s ids (module doc)."""
    if text == BOS_TEXT or (add_special_tokens and not text):
        return [BOS_ID]
    return list(text.encode("utf-8"))


def decode(ids: Iterable[int]) -> str:
    """The text of ``ids`` (bytes 0-255 and BOS 256; module doc)."""
    t = Transcript()
    text, _ = t.add(ids, final=True)
    return text


def token_text(token: int) -> str:
    """One id's text in ``logprobs`` (module doc)."""
    if token == BOS_ID:
        return BOS_TEXT
    return chr(token) if token < 0x80 else f"bytes:\\x{token:02x}"


class Transcript:
    """A completion's text as its ids arrive (bytes as UTF-8, incrementally: a character
    split across calls comes out whole; BOS as ``"<bos>"``), and each id's offset in it."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0              # characters given out so far

    def add(self, ids: Iterable[int], final: bool = False,
            offsets: bool = True) -> tuple[str, list[int]]:
        """The text completed by ``ids`` (``final``: the last ones, nothing held back) and,
        per id, the offset of its character in the whole text (``offsets`` false: none, and
        bytes without BOS are decoded in one call)."""
        if not offsets:
            ids = list(ids)
            if BOS_ID not in ids:
                text = self._decoder.decode(bytes(ids), final=final)
                self.chars += len(text)
                return text, []
        parts, where = [], []
        for token in ids:
            if token == BOS_ID:     # (a character cut short before it: U+FFFD, then BOS)
                piece = self._decoder.decode(b"", final=True)
                where.append(self.chars + len(piece))
                piece += BOS_TEXT
            else:                   # (a byte held for its character: the next character's)
                piece = self._decoder.decode(bytes((token,)))
                held = bool(self._decoder.getstate()[0])
                where.append(self.chars + len(piece) - (0 if held else 1))
            parts.append(piece)
            self.chars += len(piece)
        if final:
            piece = self._decoder.decode(b"", final=True)
            parts.append(piece)
            self.chars += len(piece)
        return "".join(parts), where if offsets else []
