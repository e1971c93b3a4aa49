"""The parts around the blocks that the block-stacked byte LMs share (:class:`MinGRULM`,
:class:`TransformerLM`): the embedding, the final norm and the head."""

from __future__ import annotations

from typing import Callable

from torch import nn

from .config import LMConfig


def stacked_parts(config: LMConfig, block: Callable[[LMConfig], nn.Module]
                  ) -> tuple[nn.Embedding, nn.ModuleList, nn.RMSNorm, nn.Linear]:
    """``(embed, blocks, norm, head)`` of a byte LM of ``config``: the embedding
    (``vocab_size x d_model``, drawn from ``N(0, 1 / d_model)``), ``config.n_layers``
    blocks ``block(config)``, the final RMSNorm and the bias-free head (``d_model ->
    vocab_size``; its weight the embedding's with ``tie_embeddings``). Created in this
    order, so that a seed draws the same parameters wherever it is called.

    Example:
        >>> from fastrwa.models import LMConfig
        >>> from fastrwa.models.mingru import MinGRUBlock
        >>> config = LMConfig(layer="mingru", d_model=8, n_layers=2)
        >>> embed, blocks, norm, head = stacked_parts(config, MinGRUBlock)
        >>> len(blocks), head.weight is embed.weight
        (2, True)
    """
    d = config.d_model
    embed = nn.Embedding(config.vocab_size, d)
    blocks = nn.ModuleList(block(config) for _ in range(config.n_layers))
    norm = nn.RMSNorm(d)
    head = nn.Linear(d, config.vocab_size, bias=False)
    nn.init.normal_(embed.weight, std=d ** -0.5)
    if config.tie_embeddings:
        head.weight = embed.weight
    return embed, blocks, norm, head
