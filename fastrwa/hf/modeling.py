"""``FastRWAForCausalLM``: :class:`fastrwa.models.ByteLM` as a Hugging Face causal LM, whose
``generate()`` carries the fixed-size recurrent state in a :class:`FastRWACache`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation import GenerationMode
from transformers.utils import ModelOutput

from ..models import ByteLM, LMState
from ..models.config import BYTE_VOCAB
from .configuration import FastRWAConfig
from .integrity import sign, verify


class FastRWACache:
    """The recurrent state between ``generate()`` steps: per block the scan state ``(m, n,
    d)`` and the token shift's last input (:class:`fastrwa.models.LMState`), a fixed size
    whatever the length; ``seen`` counts the positions read (padding included)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, state: LMState, seen: int):
        self.state, self.seen = state, seen

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def nbytes(self) -> int:
        """The bytes of the state's tensors (constant during generation)."""
        return sum(t.numel() * t.element_size() for layer in self.state.layers
                   for t in (*layer.scan, *((layer.last_input,) if layer.last_input is not None
                                            else ())))


@dataclass
class FastRWACausalLMOutput(ModelOutput):
    """``loss`` (with ``labels``), ``logits`` ``(B, T, vocab_size)`` and the cache."""

    loss: Optional[Tensor] = None
    logits: Optional[Tensor] = None
    past_key_values: Optional[FastRWACache] = None


class FastRWAPreTrainedModel(PreTrainedModel):
    """Loading, saving and the generation modes of the fastrwa causal LMs."""

    config_class = FastRWAConfig
    base_model_prefix = "model"
    _is_stateful = True
    # The state cannot be reordered between beams yet: beam search is refused up front.
    _supported_generation_modes = [GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE]

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False                      # (the state is the model's own: no KV cache)

    def _init_weights(self, module) -> None:
        """Nothing: :class:`fastrwa.models.ByteLM` initialises its own parameters, and
        ``from_pretrained`` loads every one of them."""


class FastRWAForCausalLM(FastRWAPreTrainedModel, GenerationMixin):
    """A :class:`fastrwa.models.ByteLM` (``self.model``) behind Hugging Face's causal-LM
    interface.

    ``forward(input_ids, attention_mask=None, past_key_values=None, use_cache=None,
    labels=None)``: ``input_ids`` ``(B, T)`` byte ids (256: BOS); an ``attention_mask`` of
    0 at padding (left, right or holes) keeps those positions out of the state (ByteLM's
    ``mask``), so a padded row generates what it generates alone; ``labels`` (``-100``
    ignored) gives the next-byte cross-entropy of the trainer; at a padded position the
    logits are the last real token's (ByteLM's ``mask``). ``generate()`` runs greedy or
    sampled decoding, one token per step from the cached state; ids 256 and up are never
    generated (``generation_config.suppress_tokens``). Beam search is refused.

    Example:
        >>> import torch
        >>> from fastrwa.hf import FastRWAConfig, FastRWAForCausalLM
        >>> model = FastRWAForCausalLM(FastRWAConfig(d_model=16, n_layers=1))
        >>> model.generate(torch.tensor([[104, 105]]), max_new_tokens=3).shape
        torch.Size([1, 5])
    """

    _tied_weights_keys = {"model.head.weight": "model.embed.weight"}

    def __init__(self, config: FastRWAConfig):
        super().__init__(config)
        self.model = ByteLM(config.to_lm_config())
        self.post_init()

    @property
    def _not_bytes(self) -> list[int]:
        """The ids generation never produces: BOS and any past it (as ByteLM.generate)."""
        return list(range(BYTE_VOCAB, self.config.vocab_size))

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, refusing a weights file that lacks any of the
        model's tensors (rather than leaving them uninitialised with a warning) or, in a
        local directory, does not match the checksum ``save_pretrained`` stored with it
        (:mod:`fastrwa.hf.integrity`; a file without one loads with a warning)."""
        wanted = kwargs.pop("output_loading_info", False)
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
            verify(Path(source))
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        if info.get("missing_keys"):
            raise ValueError(f"the weights do not hold {sorted(info['missing_keys'])}: a "
                             f"damaged or foreign directory (export it again with "
                             f"python -m fastrwa.hf.export)")
        return (model, info) if wanted else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained``, then the weights' checksum written into the
        safetensors files' metadata (:mod:`fastrwa.hf.integrity`)."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        sign(Path(save_directory))
        return out

    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate`` from a prompt (the whole sequence: the state is built
        from it; a ``past_key_values`` given is refused), never producing the ids past the
        bytes (``suppress_tokens``, set when the generation config has none)."""
        if kwargs.get("past_key_values") is not None:
            raise ValueError("generate() builds the state from the prompt: pass the whole "
                             "sequence as input_ids and no past_key_values")
        if self.generation_config is not None and not self.generation_config.suppress_tokens:
            self.generation_config.suppress_tokens = self._not_bytes
        return super().generate(*args, **kwargs)

    @classmethod
    def from_bytelm(cls, model: ByteLM) -> "FastRWAForCausalLM":
        """A copy of a :class:`fastrwa.models.ByteLM` (its configuration and weights)."""
        if not isinstance(model, ByteLM):
            raise TypeError(f"model must be a fastrwa.models.ByteLM, got "
                            f"{type(model).__name__} (the LSTM/GRU baselines have no Hugging "
                            f"Face class)")
        hf = cls(FastRWAConfig.from_lm_config(model.config))
        hf.model.load_state_dict(model.state_dict())
        # (written into generation_config.json by save_pretrained: ids past the bytes)
        hf.generation_config.suppress_tokens = hf._not_bytes
        return hf.to(next(model.parameters()).dtype)

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.head

    def forward(self, input_ids: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None,
                past_key_values: Optional[FastRWACache] = None, use_cache: Optional[bool] = None,
                labels: Optional[Tensor] = None, inputs_embeds: Optional[Tensor] = None,
                **kwargs) -> FastRWACausalLMOutput:
        if inputs_embeds is not None:
            raise ValueError("FastRWAForCausalLM reads input_ids (bytes), not inputs_embeds")
        if input_ids is None:
            raise ValueError("input_ids (B, T) are required")
        if past_key_values is not None and not isinstance(past_key_values, FastRWACache):
            raise TypeError(f"past_key_values must be a FastRWACache (as this model returns), "
                            f"got {type(past_key_values).__name__}")
        T = input_ids.shape[-1]
        mask = None
        if attention_mask is None and isinstance(input_ids, Tensor) and input_ids.numel() \
                and not input_ids.is_floating_point() \
                and bool((input_ids >= self.config.vocab_size).any()):
            raise ValueError(f"input_ids hold ids from {self.config.vocab_size} on (the "
                             f"tokenizer pads with {self.config.vocab_size}, outside the "
                             f"vocabulary): pass the attention_mask the tokenizer returned "
                             f"with them, or ids in [0, {self.config.vocab_size})")
        if attention_mask is not None:
            past = 0 if past_key_values is None else past_key_values.seen
            if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2 \
                    or attention_mask.shape[0] != input_ids.shape[0] \
                    or attention_mask.shape[1] != past + T:
                got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) \
                    else type(attention_mask).__name__
                raise ValueError(f"attention_mask must have shape (B, past + T) = "
                                 f"({input_ids.shape[0]}, {past} + {T}): one entry per "
                                 f"position read so far ({past}, the cache's) and per new "
                                 f"id ({T}), got {got}")
            # (generate() passes the mask of every position so far: these are the last T)
            mask = attention_mask[:, -T:].bool()
            if bool(mask.all()):
                mask = None
            else:       # (a padding id may lie outside the vocabulary: it is never read)
                input_ids = input_ids.masked_fill(~mask, 0)
        state = None if past_key_values is None else past_key_values.state
        logits, state = self.model(input_ids, state, mask=mask)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels,
                                      vocab_size=self.config.vocab_size, **kwargs)
        if use_cache is None:
            use_cache = self.config.use_cache
        seen = (0 if past_key_values is None else past_key_values.seen) + T
        return FastRWACausalLMOutput(loss=loss, logits=logits,
                                     past_key_values=FastRWACache(state, seen) if use_cache
                                     else None)
