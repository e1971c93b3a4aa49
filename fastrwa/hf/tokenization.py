"""A byte tokenizer for ``AutoTokenizer``: ids 0-255 are the UTF-8 bytes of the text, 256
the beginning-of-sequence id that :class:`fastrwa.models.ByteLM` reads for an empty prompt."""

from __future__ import annotations

from transformers import PreTrainedTokenizer
from transformers.tokenization_python import AddedToken

from ..models.config import BYTE_VOCAB
from ..models.directory import BOS, PAD, TOKENIZER_AUTO_MAP



class FastRWAByteTokenizer(PreTrainedTokenizer):
    """Text to UTF-8 byte ids and back (invalid UTF-8 decodes with U+FFFD). With special
    tokens (the default), a text is its bytes as they are and an empty text is ``[256]``:
    the context :meth:`fastrwa.models.ByteLM.generate` gives a prompt; the text ``"<bos>"``
    is its five bytes (special tokens are never read from text). The EOS is the same id,
    256 (:attr:`fastrwa.models.LMConfig.eos_token`, the model's ``eos_token_id``), which the
    model never generates. Padding (left, id 257, masked out by ``attention_mask``) lets
    rows of different lengths share a batch.

    Example:
        >>> from fastrwa.hf import FastRWAByteTokenizer
        >>> tokenizer = FastRWAByteTokenizer()
        >>> tokenizer("hé").input_ids, tokenizer("").input_ids
        ([104, 195, 169], [256])
        >>> tokenizer.decode([104, 195, 169])
        'hé'
    """

    model_input_names = ["input_ids", "attention_mask"]
    padding_side = "left"
    # (written into tokenizer_config.json: trust_remote_code=True finds the class)
    _auto_map = TOKENIZER_AUTO_MAP

    def __init__(self, bos_token: str | AddedToken = BOS, pad_token: str | AddedToken = PAD,
                 eos_token: str | AddedToken | None = None, **kwargs):
        special = [AddedToken(t, special=True, normalized=False) if isinstance(t, str) else t
                   for t in (bos_token, pad_token)]
        self._added_tokens_decoder = dict(enumerate(special, start=BYTE_VOCAB))
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        kwargs.setdefault("split_special_tokens", True)
        super().__init__(bos_token=special[0], pad_token=special[1],
                         eos_token=special[0] if eos_token is None else eos_token, **kwargs)

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB

    def get_vocab(self) -> dict[str, int]:
        vocab = {chr(i): i for i in range(BYTE_VOCAB)}
        vocab.update(self._added_tokens_encoder)
        return vocab

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [chr(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> int | None:
        return ord(token) if len(token) == 1 and ord(token) < BYTE_VOCAB else None

    def _convert_id_to_token(self, index: int) -> str:
        if 0 <= index < BYTE_VOCAB:
            return chr(index)
        return str(self._added_tokens_decoder[index])

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = b"".join(t.encode("utf-8") if t in self._added_tokens_encoder
                        else bytes([ord(t)]) for t in tokens)
        return data.decode("utf-8", errors="replace")

    def build_inputs_with_special_tokens(self, token_ids_0: list[int],
                                         token_ids_1: list[int] | None = None) -> list[int]:
        ids = token_ids_0 + (token_ids_1 or [])
        return ids if ids else [self.bos_token_id]

    def get_special_tokens_mask(self, token_ids_0: list[int],
                                token_ids_1: list[int] | None = None,
                                already_has_special_tokens: bool = False) -> list[int]:
        if already_has_special_tokens:
            return [int(i == self.bos_token_id) for i in token_ids_0 + (token_ids_1 or [])]
        ids = token_ids_0 + (token_ids_1 or [])
        return [0] * len(ids) if ids else [1]

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple:
        return ()                         # (the vocabulary is the 256 bytes: nothing to save)
