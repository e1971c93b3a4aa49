"""The one directory format of a byte language model, written by a training run (its
``model/`` and ``best/``) and by ``python -m fastrwa.hf.export``, read by
:func:`fastrwa.models.load_pretrained`, ``python -m fastrwa.generate`` and Hugging Face's
``AutoModelForCausalLM`` / ``AutoTokenizer`` (docs/hf.md):

* ``config.json``: :class:`LMConfig`'s fields; for the scan models (:class:`ByteLM`) as
  Hugging Face's ``FastRWAConfig`` writes them (``model_type`` "fastrwa",
  ``tie_word_embeddings`` for ``tie_embeddings``, the special ids, ``auto_map``);
* the weights: ``model.pt`` (``torch.save``, CRC-32 per record; what a run writes) or
  ``model.safetensors`` (what the export writes, with a SHA-256 in its metadata:
  :mod:`fastrwa.models.integrity`); each records the configuration the weights were
  written with (:data:`ARCHITECTURE_KEY`), which every loader compares with
  ``config.json`` (:func:`check_architecture`);
* for :class:`ByteLM` also ``generation_config.json`` (ids past the bytes suppressed),
  ``tokenizer_config.json``, the three one-line modules ``auto_map`` names (they import the
  classes from ``fastrwa.hf``: ``trust_remote_code=True`` loads the directory without
  ``import fastrwa``), and ``README.md``, the model card.

Nothing here imports transformers: a run writes the format without the ``hf`` extra.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from ..nn.functional import rda_functions
from .config import BYTE_VOCAB, FIELDS_BEFORE_THEY_EXISTED, LAYER_FIELDS, LMConfig

MODEL_TYPE = "fastrwa"
TOKENIZER_CLASS = "FastRWAByteTokenizer"
BOS, PAD = "<bos>", "<pad>"

# The modules auto_map names, each importing its class from fastrwa.hf.
REMOTE_CODE = {
    "configuration_fastrwa.py": ("FastRWAConfig", "fastrwa.hf.configuration"),
    "modeling_fastrwa.py": ("FastRWAForCausalLM", "fastrwa.hf.modeling"),
    "tokenization_fastrwa.py": (TOKENIZER_CLASS, "fastrwa.hf.tokenization"),
}
AUTO_MAP = {"AutoConfig": "configuration_fastrwa.FastRWAConfig",
            "AutoModelForCausalLM": "modeling_fastrwa.FastRWAForCausalLM"}
TOKENIZER_AUTO_MAP = {"AutoTokenizer": [f"tokenization_fastrwa.{TOKENIZER_CLASS}", None]}

# The files save_pretrained writes beside config.json and model.pt for a ByteLM.
BYTE_LM_FILES = ("generation_config.json", "tokenizer_config.json", *REMOTE_CODE, "README.md")

LM_FIELDS = tuple(f.name for f in dataclasses.fields(LMConfig))   # (in their order)


def remote_code(module: str) -> str:
    """The text of one of the modules ``auto_map`` names (:data:`REMOTE_CODE`)."""
    name, source = REMOTE_CODE[module]
    return (f'"""{name} for trust_remote_code=True: the class of the installed fastrwa '
            f'(with its [hf] extra: pip install -e \'.[hf]\' in a fastrwa clone)."""\n\n'
            f'from {source} import {name}  # noqa: F401\n')


def config_json(config: LMConfig) -> dict[str, Any]:
    """``config.json`` of a :class:`ByteLM` of ``config``: the keys Hugging Face's
    ``FastRWAConfig.save_pretrained`` writes (``tests/hf/test_hf.py`` compares them)."""
    fields = config.to_dict()
    fields["tie_word_embeddings"] = fields.pop("tie_embeddings")
    return {"architectures": ["FastRWAForCausalLM"], "auto_map": dict(AUTO_MAP),
            "model_type": MODEL_TYPE, **fields, "bos_token_id": config.bos_token,
            "eos_token_id": config.eos_token, "pad_token_id": None, "use_cache": True}


def lm_config_fields(data: dict[str, Any]) -> dict[str, Any]:
    """:class:`LMConfig`'s fields of a ``config.json``: a plain ``LMConfig.to_dict()`` as it
    is (an unknown key is refused by ``LMConfig.from_dict``); of a Hugging Face one (with
    ``model_type`` "fastrwa") only ``LMConfig``'s fields, its ``tie_word_embeddings`` as
    ``tie_embeddings``: the keys transformers adds (``transformers_version``, ``dtype``,
    token ids, generation defaults...) are ignored, as ``FastRWAConfig`` ignores them."""
    if data.get("model_type") != MODEL_TYPE:
        return data
    fields = {k: v for k, v in data.items() if k in LM_FIELDS}
    if "tie_word_embeddings" in data:
        fields["tie_embeddings"] = data["tie_word_embeddings"]
    return fields


# Where the configuration the weights were written with is recorded (LMConfig.to_dict() as
# JSON): in model.safetensors' metadata, beside the checksum (fastrwa.models.integrity), and
# in model.pt's state dict's ``_metadata`` (where torch keeps each module's version; read
# back by torch.load(weights_only=True), covered by the records' CRC-32s).
ARCHITECTURE_KEY = "fastrwa_architecture"

# LMConfig fields that only initialise the weights: loaded weights compute the same whatever
# they say.
INIT_ONLY_FIELDS = ("discount_init",)


def architecture_json(config: LMConfig) -> str:
    """What :data:`ARCHITECTURE_KEY` records for weights of a model of ``config``."""
    return json.dumps(config.to_dict(), sort_keys=True)


def computed_fields(config: LMConfig) -> dict[str, Any]:
    """The fields of ``config`` that decide what given weights compute: those every model
    reads but ``context`` (the transformer's window: only its), the layer's own
    (:data:`LAYER_FIELDS`) but :data:`INIT_ONLY_FIELDS`; an RDA's ``attention``, ``f_h``
    and ``f_o`` as its ``preset`` sets them (the preset itself is no field of them)."""
    names = ("vocab_size", "d_model", "n_layers", "layer", "tie_embeddings",
             *LAYER_FIELDS[config.layer], *(("context",) if config.layer == "transformer"
                                             else ()))
    fields = {name: getattr(config, name) for name in names if name not in INIT_ONLY_FIELDS}
    if config.layer == "rda":
        fields["attention"], fields["f_h"], fields["f_o"], *_ = rda_functions(
            config.attention, config.f_h, config.f_o, config.preset)
        del fields["preset"]
    return fields


def check_architecture(recorded: object, config: LMConfig, weights: Path, given: str) -> None:
    """Refuse (``ValueError``, one line naming the field, the value the weights were written
    with and ``given``'s) a ``config`` that computes otherwise than the configuration
    ``recorded`` with ``weights`` (:data:`ARCHITECTURE_KEY`): a ``config.json`` edited by
    hand, or another model's, loaded silently with other logits. ``given`` names where
    ``config`` comes from (its ``config.json``). Fields that do not change what the weights
    compute (:func:`computed_fields`) may differ. Weights written before the record existed
    (``recorded`` ``None``) are not checked: their ``config.json`` is taken as it is."""
    if recorded is None:
        return
    try:
        saved = json.loads(recorded)
        unknown = sorted(set(saved) - set(LM_FIELDS))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{weights}: the configuration recorded with the weights cannot be "
                         f"read ({exc}): the file is damaged") from exc
    if unknown:
        raise ValueError(f"{weights} were written by a model with {unknown[0]} "
                         f"{saved[unknown[0]]!r}, a field this fastrwa does not know (a newer "
                         f"version wrote them): upgrade fastrwa to load them")
    try:
        saved = LMConfig(**{**FIELDS_BEFORE_THEY_EXISTED, **saved})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{weights}: the configuration recorded with the weights is not a "
                         f"language-model configuration ({exc}): the file is damaged") from exc
    want, got = computed_fields(saved), computed_fields(config)
    for name in LM_FIELDS:
        if name in want and name in got and want[name] != got[name]:
            if name in ("attention", "f_h", "f_o") and saved.preset != config.preset:
                name = "preset"                        # (what sets the three)
            raise ValueError(f"{given} does not match the weights {weights}: {name} is "
                             f"{getattr(config, name)!r} there, the weights were written with "
                             f"{name} {getattr(saved, name)!r} (edited by hand, or another "
                             f"model's configuration?); set {name} back to "
                             f"{getattr(saved, name)!r}")


def generation_config_json(config: LMConfig) -> dict[str, Any]:
    """``generation_config.json``: BOS, EOS (:attr:`LMConfig.eos_token`: the tokenizer's),
    and the ids past the bytes never generated (as ``ByteLM.generate``):
    ``suppress_tokens``."""
    return {"bos_token_id": config.bos_token, "eos_token_id": config.eos_token,
            "suppress_tokens": list(range(BYTE_VOCAB, config.vocab_size)), "use_cache": True}


def tokenizer_config_json() -> dict[str, Any]:
    """``tokenizer_config.json`` of the byte tokenizer (``FastRWAByteTokenizer``)."""
    return {"tokenizer_class": TOKENIZER_CLASS, "auto_map": dict(TOKENIZER_AUTO_MAP),
            "bos_token": BOS, "eos_token": BOS, "pad_token": PAD, "padding_side": "left",
            "clean_up_tokenization_spaces": False, "split_special_tokens": True}


CARD_TITLE = "# A fastrwa byte language model"


def is_model_card(text: str) -> bool:
    """Whether a ``README.md`` is a card :func:`model_card` wrote (an export may replace
    it; another README, say a repository's, is never deleted)."""
    return f"\n{CARD_TITLE}\n" in text


def model_card(config: LMConfig, parameters: int, training: Optional[dict] = None,
               results: Optional[dict] = None) -> str:
    """``README.md``: what the model is, how it was trained (``training``: the run's
    settings, if known), its results (``results``: e.g. ``{"valid bpc": 1.51}``) and how to
    load it."""
    layer = {"rda": "Recurrent Discounted Attention", "rwa": "Recurrent Weighted Average"}
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation",
             "tags: [fastrwa, byte-level]", "---", "",
             CARD_TITLE, "",
             f"A byte-level language model (fastrwa's `ByteLM`): {config.n_layers} "
             f"block{'s' if config.n_layers != 1 else ''} of "
             f"{layer.get(config.layer, config.layer)} (`{config.layer}`) scan layers, "
             f"d_model {config.d_model}, {parameters:,} parameters. It reads UTF-8 bytes "
             f"(ids 0-255; 256 starts an empty prompt) and keeps a fixed-size state per "
             f"block, whatever the length.", "", "## Configuration", "",
             "| field | value |", "|---|---|"]
    lines += [f"| {f.name} | {getattr(config, f.name)!r} |" for f in dataclasses.fields(config)]
    lines += ["", "## Training", ""]
    if training:
        lines += ["| setting | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in training.items()]
    else:
        lines.append("Not recorded with these weights.")
    lines += ["", "## Results", ""]
    if results:
        lines += [f"- {k}: {v:.4f}" if isinstance(v, float) else f"- {k}: {v}"
                  for k, v in results.items()]
    else:
        lines.append("Not recorded with these weights.")
    lines += ["", "## Load it", "", "```python",
              "import fastrwa.hf  # registers the classes (or pass trust_remote_code=True)",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "model = AutoModelForCausalLM.from_pretrained(DIRECTORY)",
              "tokenizer = AutoTokenizer.from_pretrained(DIRECTORY)",
              'ids = model.generate(**tokenizer("The ", return_tensors="pt"), max_new_tokens=50)',
              "print(tokenizer.decode(ids[0]))", "```", "",
              "or `fastrwa.models.load_pretrained(DIRECTORY)` (a `ByteLM`), or",
              "`python -m fastrwa.generate DIRECTORY --prompt \"The \"`.", ""]
    return "\n".join(lines)
