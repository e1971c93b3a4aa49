"""``FastRWAForCausalLM``: :class:`fastrwa.models.ByteLM` as a Hugging Face causal LM, whose
``generate()`` carries the fixed-size recurrent state in a :class:`FastRWACache`."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation import GenerationMode
from transformers.utils import ModelOutput

from ..models import ByteLM, InferenceCache, LMState, load_pretrained
from ..models.decoding import Decoder
from ..models import directory as fmt
from ..models.storage import CONFIG, read_config, run_model_dir, weights_file
from ..models.config import BYTE_VOCAB, LMConfig
from ..models.sampling import check_temperature
from .configuration import FastRWAConfig
from .options import check_model_pt_options
from ..models.integrity import recorded_architecture, sign, verify


# What check_architecture calls a configuration passed to from_pretrained (or its keyword
# arguments) that is not the directory's config.json.
_GIVEN = "the configuration given to from_pretrained"

# Per thread, the decoder of each model's running generate() (FastRWAForCausalLM._decoding).
_GENERATING = threading.local()


def _mapped(state: LMState, fn) -> LMState:
    """``state`` with ``fn`` applied to each of its tensors (a token shift's absent last
    input stays ``None``)."""
    return LMState(tuple(
        type(layer)(type(layer.scan)(*(fn(t) for t in layer.scan)),
                    None if layer.last_input is None else fn(layer.last_input))
        for layer in state.layers))


class FastRWACache:
    """The recurrent state between ``generate()`` steps: per block the scan state ``(m, n,
    d)`` and the token shift's last input (:class:`fastrwa.models.LMState`), a fixed size
    whatever the length; ``seen`` counts the positions read (padding included).

    Inside ``generate()`` the state lives in a :class:`fastrwa.models.InferenceCache`
    (``inference``) that ``decoder`` (a :class:`fastrwa.models.decoding.Decoder`,
    ``ByteLM.decoder(weights)``: the fused CPU step, the CUDA-graph step or the eager
    in-place step) allocated and advances one token at a time;
    ``reorder_cache`` permutes it between beams. Otherwise (a ``forward`` called with
    ``use_cache=True``) it holds the forward's ``LMState``."""

    is_compileable = False
    is_croppable = False

    def __init__(self, state: Optional[LMState], seen: int,
                 inference: Optional[InferenceCache] = None, decoder: Optional[Decoder] = None):
        self._state, self.seen = state, seen
        self.inference, self.decoder = inference, decoder

    @property
    def state(self) -> LMState:
        """The state as an :class:`fastrwa.models.LMState` (views of ``inference``'s
        buffers when it has them: read, do not keep across steps)."""
        return self.inference.state if self.inference is not None else self._state

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """``state <- state[beam_idx]`` along the batch (beam search: ``beam_idx`` ``(B,)``,
        the row each row continues)."""
        if self.inference is not None:
            self.inference.reorder_(beam_idx.to(self.inference.device), check=False)
            return
        self._state = _mapped(self._state, lambda t: t.index_select(0, beam_idx.to(t.device)))

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
    # (assisted, contrastive, DoLa, constrained and group beam search are refused in generate)
    _supported_generation_modes = [GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE,
                                   GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE]

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
    generated (``generation_config.suppress_tokens``); beam search (``num_beams``) reorders
    the state between beams. Each new token runs the model's decode step in place
    (:meth:`generate`'s ``weights``: on CPU the fused step).

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
        (:mod:`fastrwa.models.integrity`; a file without one loads with a warning; a file
        cut short or with a damaged header is the same error), or was written by a model
        of another configuration than the one loaded (``config.json`` edited by hand, or a
        ``config`` given: :func:`fastrwa.models.directory.check_architecture`).

        A training run's directory, its ``model/`` or ``best/`` (``model.pt``, no
        safetensors: :mod:`fastrwa.models.directory`) loads through
        :func:`fastrwa.models.load_pretrained` (its CRC-32s checked), then ``dtype``, a
        single-device ``device_map`` and a ``generation_config`` apply; the options that
        change nothing at the values given (lm-eval's ``gguf_file=None``,
        ``max_memory=None``, ``quantization_config=None``...) are taken, the others refused
        (:mod:`fastrwa.hf.options`). A local ``subfolder`` is joined to the path first.

        The generation configuration's ``eos_token_id`` is the configuration's (the
        tokenizer's EOS) where the directory's ``generation_config.json`` has none (one
        written before EOS was set)."""
        wanted = kwargs.pop("output_loading_info", False)
        args, kwargs = list(args), dict(kwargs)
        named = not args
        source = kwargs.get("pretrained_model_name_or_path") if named else args[0]
        recorded = weights = None
        if isinstance(source, (str, os.PathLike)) and \
                (Path(source) / (kwargs.get("subfolder") or "")).is_dir():
            found = Path(source) / (kwargs.pop("subfolder", None) or "")
            if weights_file(found) is None and (found / "model").is_dir():
                found = run_model_dir(found)        # (a training run's directory: model/)
            if named:                               # (transformers reads what is checked)
                kwargs["pretrained_model_name_or_path"] = found
            else:
                args[0] = found
            weights = weights_file(found)
            if weights is not None and weights.suffix == ".pt":
                kwargs.pop("pretrained_model_name_or_path", None)
                model = cls._from_model_pt(found, tuple(args[1:]), kwargs)
                return (model, {"missing_keys": [], "unexpected_keys": [],
                                "mismatched_keys": [], "error_msgs": []}) if wanted else model
            verify(found)
            recorded = recorded_architecture(found)
            if recorded is not None:          # (before transformers loads mismatched shapes)
                config, given = cls._config_of(found, kwargs.get("config"))
                fmt.check_architecture(recorded, config, weights, given)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        fmt.check_architecture(recorded, model.config.to_lm_config(), weights, _GIVEN)
        if info.get("missing_keys"):
            raise ValueError(f"the weights do not hold {sorted(info['missing_keys'])}: a "
                             f"damaged or foreign directory (export it again with "
                             f"python -m fastrwa.hf.export)")
        model._agree_on_eos()
        return (model, info) if wanted else model

    def _agree_on_eos(self) -> None:
        """The generation configuration's ``eos_token_id``: the configuration's where it has
        none (what ``generate()`` and the tokenizer agree on: LMConfig.eos_token)."""
        if self.generation_config is not None and self.generation_config.eos_token_id is None:
            self.generation_config.eos_token_id = self.config.eos_token_id

    @staticmethod
    def _config_of(directory: Path, config: object) -> tuple[LMConfig, str]:
        """The configuration ``from_pretrained`` builds the model of (its ``config``, which
        the Auto classes read from ``config.json``, else ``config.json``) and what it is,
        for :func:`fastrwa.models.directory.check_architecture`'s message."""
        written = read_config(directory)
        if isinstance(config, FastRWAConfig) and config.to_lm_config() != written:
            return config.to_lm_config(), _GIVEN
        return written, str(directory / CONFIG)

    @classmethod
    def _from_model_pt(cls, directory: Path, rest: tuple, kwargs: dict):
        check_model_pt_options(directory, rest, kwargs)
        byte_lm = load_pretrained(directory)
        config = kwargs.get("config")          # (the Auto classes pass the directory's own)
        if config is not None and (not isinstance(config, FastRWAConfig)
                                   or config.to_lm_config() != byte_lm.config):
            raise ValueError(f"config must be the configuration {directory} holds (a "
                             f"model.pt directory loads as it was saved), got another")
        model = cls.from_bytelm(byte_lm)
        given = kwargs.get("generation_config")
        if given is not None and not isinstance(given, GenerationConfig):
            raise TypeError(f"generation_config must be a transformers.GenerationConfig or "
                            f"None, got {type(given).__name__}")
        if given is not None:
            model.generation_config = given
        elif (directory / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(directory)
        model._agree_on_eos()
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if dtype not in (None, "auto"):
            model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        device = kwargs.get("device_map")
        if isinstance(device, dict) and list(device) == [""]:
            device = device[""]                        # ({"": device}: the whole model)
        if isinstance(device, (str, int, torch.device)) and device != "auto":
            model.to(device)
        elif device not in (None, "auto"):
            raise ValueError(f"device_map must be one device for {directory} (model.pt), "
                             f"got {device!r}")
        return model.eval()

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained``, then the weights' checksum written into the
        safetensors files' metadata (:mod:`fastrwa.models.integrity`); with the rest of the
        directory format (:mod:`fastrwa.models.directory`): ``auto_map`` in
        ``config.json`` and the modules it names, and a model card (``README.md``, kept if
        the directory has one)."""
        self.config.auto_map = dict(fmt.AUTO_MAP)
        out = super().save_pretrained(save_directory, *args, **kwargs)
        sign(Path(save_directory), self.model.config)
        path = Path(save_directory)
        for name in fmt.REMOTE_CODE:
            (path / name).write_text(fmt.remote_code(name))
        if not (path / "README.md").exists():
            params = sum(p.numel() for p in dict.fromkeys(self.model.parameters()))
            (path / "README.md").write_text(fmt.model_card(self.model.config, params))
        return out

    # generate() options that select a decoding this model does not run
    _REFUSED = {"assistant_model": "assisted decoding", "prompt_lookup_num_tokens":
                "assisted decoding", "penalty_alpha": "contrastive search", "dola_layers":
                "DoLa decoding", "num_beam_groups": "group beam search", "diversity_penalty":
                "group beam search", "constraints": "constrained beam search",
                "force_words_ids": "constrained beam search"}

    @property
    def _decoding(self) -> Optional[Decoder]:
        """The decoder of the ``generate()`` call this thread is running on this model, or
        ``None`` (per thread: concurrent calls do not see each other's)."""
        return getattr(_GENERATING, "decoders", {}).get(id(self))

    def generate(self, *args, weights: object = "auto", **kwargs):
        """``GenerationMixin.generate`` from a prompt (the whole sequence: the state is built
        from it; a ``past_key_values`` given is refused), never producing the ids past the
        bytes (``suppress_tokens``, set when the generation config has none).

        The prompt runs through the model's parallel forward (padding and holes in the
        attention mask skipped); each new token then goes through ``weights``'s decode step
        in place, as :meth:`fastrwa.models.ByteLM.generate` runs it: ``"auto"`` (the fused
        CPU step for a float32 CPU model, the CUDA-graph step on CUDA, else the eager
        in-place step), ``"eager"``, ``"graph"``, ``"float32"``/``"bfloat16"``/``"int8"``
        (the fused step with its weights stored so) or a ``fastrwa.models.PackedLM`` of
        ``self.model``. Greedy, sampling and beam search (``num_beams``: the state is
        reordered between beams; log-probabilities renormalised over the bytes, as
        ``ByteLM``'s beam search, unless ``renormalize_logits`` is given); assisted,
        contrastive, DoLa, constrained and group beam search are refused. A sampling
        ``temperature`` beyond float32's range is refused, naming it, as
        ``ByteLM.generate`` refuses it.

        A row whose ``attention_mask`` keeps no token (an empty prompt padded in a batch)
        starts from BOS, as ``ByteLM.generate`` starts an empty prompt: its last position
        is BOS (256) with a mask of 1, in the sequences returned too (the tokenizer encodes
        an empty text so)."""
        if kwargs.get("past_key_values") is not None:
            raise ValueError("generate() builds the state from the prompt: pass the whole "
                             "sequence as input_ids and no past_key_values")
        for name, what in self._REFUSED.items():
            value = kwargs.get(name)
            if value is not None and not (name == "num_beam_groups" and value == 1):
                raise ValueError(f"{what} ({name}=...) is not supported by "
                                 f"{type(self).__name__}: it generates greedily, by sampling "
                                 f"or by beam search (num_beams)")
        config = kwargs.get("generation_config") or self.generation_config
        if (kwargs.get("num_beams") or getattr(config, "num_beams", 1) or 1) > 1:
            kwargs.setdefault("renormalize_logits", True)
        if kwargs.get("do_sample", getattr(config, "do_sample", False)):
            temperature = kwargs.get("temperature", getattr(config, "temperature", None))
            if temperature is not None:
                check_temperature(temperature)
        args, kwargs = self._start_empty_rows(args, kwargs)
        if self.generation_config is not None and not self.generation_config.suppress_tokens:
            self.generation_config.suppress_tokens = self._not_bytes
        decoders = _GENERATING.__dict__.setdefault("decoders", {})
        if id(self) in decoders:
            raise RuntimeError("generate() is already running on this model in this thread")
        decoders[id(self)] = self.model.decoder(weights)
        try:
            return super().generate(*args, **kwargs)
        finally:
            del decoders[id(self)]

    def _start_empty_rows(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``generate()``'s ``args`` and ``kwargs`` with each row whose ``attention_mask``
        keeps no token reading BOS at its last position (copies; as they were if none)."""
        mask = kwargs.get("attention_mask")
        if not isinstance(mask, Tensor) or mask.dim() != 2 or not mask.shape[1]:
            return args, kwargs
        empty = ~mask.bool().any(dim=1)
        if not bool(empty.any()):
            return args, kwargs
        name = next((n for n in ("input_ids", "inputs") if n in kwargs), None)
        ids = args[0] if args else kwargs.get(name) if name else None
        if not isinstance(ids, Tensor) or ids.shape != mask.shape:
            return args, kwargs         # (forward refuses a mask of another shape)
        ids, mask = ids.clone(), mask.clone()
        ids[empty, -1] = self.model.config.bos_token
        mask[empty, -1] = 1
        kwargs = {**kwargs, "attention_mask": mask}
        if args:
            return (ids, *args[1:]), kwargs
        return args, {**kwargs, name: ids}

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
        if use_cache is None:
            use_cache = self.config.use_cache
        decoder = self._decoding
        # (in place only inside generate(): a forward from a cache it returned reads a copy)
        fused = past_key_values is not None and past_key_values.inference is not None \
            and decoder is not None and use_cache
        seen = (0 if past_key_values is None else past_key_values.seen) + T
        if fused and T == 1 and mask is None and labels is None:      # (a generate() step)
            logits = past_key_values.decoder.step_(input_ids[:, 0].long(),
                                                   past_key_values.inference)
            past_key_values.seen = seen
            # (a clone: the step's logits are a buffer the next step overwrites)
            return FastRWACausalLMOutput(logits=logits[:, None].clone(),
                                         past_key_values=past_key_values)
        state = None
        if past_key_values is not None:      # (a generate() cache's buffers: copied)
            state = past_key_values.state if past_key_values.inference is None else \
                _mapped(past_key_values.state, torch.clone)
        logits, state = self.model(input_ids, state, mask=mask)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels,
                                      vocab_size=self.config.vocab_size, **kwargs)
        cache = None
        if fused:                                # (the decoder's buffers, updated in place)
            past_key_values.inference.load_(state)
            past_key_values.seen, cache = seen, past_key_values
        elif use_cache and decoder is not None and past_key_values is None:
            inference = decoder.allocate_cache(input_ids.shape[0])      # (a prompt: prefill)
            inference.load_(state)
            cache = FastRWACache(None, seen, inference, decoder)
        elif use_cache:
            cache = FastRWACache(state, seen)
        return FastRWACausalLMOutput(loss=loss, logits=logits, past_key_values=cache)
