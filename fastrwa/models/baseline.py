"""The recurrent baselines of the language-model comparison: LSTM or GRU between the same
embedding, final norm and (tied) head as :class:`fastrwa.models.ByteLM`."""

from __future__ import annotations

from torch import Tensor, nn

from .checks import check_tokens
from .config import LMConfig
from .sampling import Sampler


class RecurrentLM(Sampler, nn.Module):
    """Byte-level LM: embedding -> ``n_layers`` of ``torch.nn.LSTM``/``GRU`` (width
    ``d_model``, cuDNN on a GPU) -> RMSNorm -> head; ``config.layer`` is "lstm" or "gru".

    ``logits, state = model(tokens, state=None)`` as for :class:`ByteLM`; ``state`` is the
    PyTorch RNN's (``(h, c)`` for an LSTM, ``h`` for a GRU, batch in dimension 1).

    Example:
        >>> import torch
        >>> from fastrwa.models import LMConfig, RecurrentLM
        >>> model = RecurrentLM(LMConfig(layer="gru", d_model=32, n_layers=2))
        >>> logits, state = model(torch.randint(0, 256, (2, 16)))
        >>> logits.shape
        torch.Size([2, 16, 257])
    """

    def __init__(self, config: LMConfig):
        super().__init__()
        if config.layer not in ("lstm", "gru"):
            raise ValueError(f"RecurrentLM needs LMConfig.layer 'lstm' or 'gru', "
                             f"got {config.layer!r} (ByteLM runs 'rda' and 'rwa')")
        self.config = config
        d = config.d_model
        self.embed = nn.Embedding(config.vocab_size, d)
        rnn = nn.LSTM if config.layer == "lstm" else nn.GRU
        self.rnn = rnn(d, d, config.n_layers, batch_first=True)
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, config.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=d ** -0.5)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor, state=None) -> tuple[Tensor, object]:
        """Logits ``(B, T, vocab_size)`` and the RNN state after the last position."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        h, state = self.rnn(self.embed(tokens), state)
        return self.head(self.norm(h)), state
