"""The one directory format of a byte language model, written by a training run (its
``model/`` and ``best/``) and by ``python -m fastrwa.hf.export``, read by
:func:`fastrwa.models.load_pretrained`, ``python -m fastrwa.generate`` and Hugging Face's
``AutoModelForCausalLM`` / ``AutoTokenizer`` (docs/hf.md):

* ``config.json``: :class:`LMConfig`'s fields; for the scan models (:class:`ByteLM`) as
  Hugging Face's ``FastRWAConfig`` writes them (``model_type`` "fastrwa",
  ``tie_word_embeddings`` for ``tie_embeddings``, the special ids, ``auto_map``);
* the weights: ``model.pt`` (``torch.save``, CRC-32 per record; what a run writes) or
  ``model.safetensors`` (what the export writes, with a SHA-256 in its metadata:
  :mod:`fastrwa.models.integrity`);
* for :class:`ByteLM` also ``generation_config.json`` (ids past the bytes suppressed),
  ``tokenizer_config.json``, the three one-line modules ``auto_map`` names (they import the
  classes from ``fastrwa.hf``: ``trust_remote_code=True`` loads the directory without
  ``import fastrwa``), and ``README.md``, the model card.

Nothing here imports transformers: a run writes the format without the ``hf`` extra.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .config import BYTE_VOCAB, LMConfig

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

# Keys of a Hugging Face config.json that are not LMConfig fields (read and ignored).
HF_KEYS = {"model_type", "architectures", "auto_map", "bos_token_id", "eos_token_id",
           "pad_token_id", "use_cache", "dtype", "torch_dtype", "transformers_version",
           "_name_or_path", "output_attentions", "output_hidden_states", "return_dict",
           "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
           "problem_type", "tie_word_embeddings"}


def remote_code(module: str) -> str:
    """The text of one of the modules ``auto_map`` names (:data:`REMOTE_CODE`)."""
    name, source = REMOTE_CODE[module]
    return (f'"""{name} for trust_remote_code=True: the class of the installed fastrwa '
            f'(pip install \'fastrwa[hf]\')."""\n\nfrom {source} import {name}  # noqa: F401\n')


def config_json(config: LMConfig) -> dict[str, Any]:
    """``config.json`` of a :class:`ByteLM` of ``config``: the keys Hugging Face's
    ``FastRWAConfig.save_pretrained`` writes (``tests/test_hf.py`` compares them)."""
    fields = config.to_dict()
    fields["tie_word_embeddings"] = fields.pop("tie_embeddings")
    return {"architectures": ["FastRWAForCausalLM"], "auto_map": dict(AUTO_MAP),
            "model_type": MODEL_TYPE, **fields, "bos_token_id": config.bos_token,
            "eos_token_id": None, "pad_token_id": None, "use_cache": True}


def lm_config_fields(data: dict[str, Any]) -> dict[str, Any]:
    """:class:`LMConfig`'s fields of a ``config.json``: a plain ``LMConfig.to_dict()`` as it
    is; a Hugging Face one (with ``model_type`` "fastrwa") without its own keys, its
    ``tie_word_embeddings`` as ``tie_embeddings``."""
    if data.get("model_type") != MODEL_TYPE:
        return data
    fields = {k: v for k, v in data.items() if k not in HF_KEYS}
    if "tie_word_embeddings" in data:
        fields["tie_embeddings"] = data["tie_word_embeddings"]
    return fields


def generation_config_json(config: LMConfig) -> dict[str, Any]:
    """``generation_config.json``: BOS, and the ids past the bytes never generated (as
    ``ByteLM.generate``): ``suppress_tokens``."""
    return {"bos_token_id": config.bos_token,
            "suppress_tokens": list(range(BYTE_VOCAB, config.vocab_size)), "use_cache": True}


def tokenizer_config_json() -> dict[str, Any]:
    """``tokenizer_config.json`` of the byte tokenizer (``FastRWAByteTokenizer``)."""
    return {"tokenizer_class": TOKENIZER_CLASS, "auto_map": dict(TOKENIZER_AUTO_MAP),
            "bos_token": BOS, "pad_token": PAD, "padding_side": "left",
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
