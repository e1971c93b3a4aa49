"""The Hugging Face configuration of a fastrwa byte language model."""

from __future__ import annotations

from transformers import PreTrainedConfig

from ..models.config import BYTE_VOCAB, FIELDS_BEFORE_THEY_EXISTED, LMConfig

# The context length the configuration states for the harnesses (lm-eval's max_length): the
# model reads any length; documents up to 1 MiB are read in one forward (docs/hf.md).
N_CTX = 1 << 20


class FastRWAConfig(PreTrainedConfig):
    """:class:`fastrwa.models.LMConfig`'s fields (``tie_embeddings`` is Hugging Face's
    ``tie_word_embeddings``), with the special ids of the byte vocabulary: ids 0-255 are the
    bytes, 256 the beginning-of-sequence id an empty prompt starts from and the
    end-of-sequence id (:attr:`fastrwa.models.LMConfig.eos_token`: the model never
    generates it, so generation runs to its length or a stop string); the tokenizer pads
    with 257, outside the model's vocabulary (``attention_mask`` skips it: a padded batch
    without its mask is refused, not read), so the model has no ``pad_token_id``.

    ``n_ctx`` (:data:`N_CTX`, not a field: the same for every model) is the context length
    the harnesses read (lm-eval reads ``n_positions``, ``max_position_embeddings`` or
    ``n_ctx``, else cuts documents at 2,048 tokens). The model itself has no limit: its
    state is a fixed size whatever it has read. ``n_ctx`` bounds what one forward holds
    (the logits, 257 floats a byte): documents up to ``N_CTX`` bytes are read whole.

    Example:
        >>> from fastrwa.hf import FastRWAConfig
        >>> FastRWAConfig(d_model=32, n_layers=2).to_lm_config().d_model
        32
    """

    model_type = "fastrwa"
    n_ctx = N_CTX                           # (a class attribute: not written, not a field)

    # LMConfig's fields, with its defaults (tests/hf/test_hf.py checks that none is missing)
    vocab_size: int = LMConfig.vocab_size
    d_model: int = LMConfig.d_model
    n_layers: int = LMConfig.n_layers
    layer: str = LMConfig.layer
    attention: str = LMConfig.attention
    f_h: str = LMConfig.f_h
    f_o: str = LMConfig.f_o
    preset: str | None = LMConfig.preset
    token_shift: bool = LMConfig.token_shift
    discount_init: str = LMConfig.discount_init
    discount_groups: int | None = LMConfig.discount_groups
    output_gate: bool = LMConfig.output_gate
    learn_initial_state: bool = LMConfig.learn_initial_state
    mlp_ratio: int = LMConfig.mlp_ratio
    tie_word_embeddings: bool = LMConfig.tie_embeddings
    n_heads: int = LMConfig.n_heads              # (the baselines' fields: unused here)
    context: int = LMConfig.context
    bos_token_id: int | None = BYTE_VOCAB
    eos_token_id: int | None = BYTE_VOCAB        # (LMConfig.eos_token: BOS's id)
    pad_token_id: int | None = None
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        config = self.to_lm_config()          # (refuses what LMConfig refuses, naming it)
        if config.layer not in ("rda", "rwa"):
            raise ValueError(f"FastRWAConfig.layer must be 'rda' or 'rwa' (the scan models; "
                             f"the baselines have no Hugging Face class), got "
                             f"{config.layer!r}")

    def to_lm_config(self) -> LMConfig:
        """The :class:`fastrwa.models.LMConfig` of the model this describes."""
        return LMConfig(vocab_size=self.vocab_size, d_model=self.d_model,
                        n_layers=self.n_layers, layer=self.layer, attention=self.attention,
                        f_h=self.f_h, f_o=self.f_o, preset=self.preset,
                        token_shift=self.token_shift, discount_init=self.discount_init,
                        discount_groups=self.discount_groups,
                        output_gate=self.output_gate,
                        learn_initial_state=self.learn_initial_state, mlp_ratio=self.mlp_ratio,
                        tie_embeddings=self.tie_word_embeddings, n_heads=self.n_heads,
                        context=self.context)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "FastRWAConfig":
        """``PreTrainedConfig.from_dict`` (what ``from_pretrained`` and the Auto classes build
        a configuration with from ``config.json``), a field ``config_dict`` lacks taking its
        value before the field existed (:data:`fastrwa.models.config.FIELDS_BEFORE_THEY_EXISTED`,
        as every other loader reads it), not today's default: a directory an older fastrwa
        wrote loads as the model it holds. Its ``eos_token_id`` of ``null`` (written before
        the vocabulary had an EOS) is the EOS the tokenizer has."""
        fields = {**FIELDS_BEFORE_THEY_EXISTED, **config_dict}
        if fields.get("eos_token_id") is None:
            fields["eos_token_id"] = cls.eos_token_id
        return super().from_dict(fields, **kwargs)

    @classmethod
    def from_lm_config(cls, config: LMConfig) -> "FastRWAConfig":
        """The Hugging Face configuration of a :class:`fastrwa.models.LMConfig`."""
        fields = config.to_dict()
        fields["tie_word_embeddings"] = fields.pop("tie_embeddings")
        return cls(**fields)
