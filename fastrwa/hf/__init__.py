"""fastrwa's byte language models in the Hugging Face ecosystem (the ``hf`` extra:
``pip install -e '.[hf]'`` in a fastrwa clone).

Importing this module registers :class:`FastRWAConfig` (``model_type`` "fastrwa"),
:class:`FastRWAForCausalLM` and :class:`FastRWAByteTokenizer` with ``AutoConfig``,
``AutoModelForCausalLM`` and ``AutoTokenizer``, so that a directory written by
``python -m fastrwa.hf.export`` loads with ``from_pretrained`` (no ``trust_remote_code``, no
network) and runs in ``pipeline("text-generation", ...)``. docs/hf.md.
"""

from __future__ import annotations

from ..extras import install_hint

try:
    import transformers  # noqa: F401
except ImportError as exc:             # pragma: no cover (CI installs the extra)
    raise ImportError(f"fastrwa.hf needs transformers and safetensors: "
                      f"{install_hint('hf')}") from exc

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .configuration import FastRWAConfig
from .modeling import FastRWACache, FastRWACausalLMOutput, FastRWAForCausalLM
from .tokenization import FastRWAByteTokenizer

AutoConfig.register(FastRWAConfig.model_type, FastRWAConfig, exist_ok=True)
AutoModelForCausalLM.register(FastRWAConfig, FastRWAForCausalLM, exist_ok=True)
AutoTokenizer.register(FastRWAConfig, tokenizer_class=FastRWAByteTokenizer, exist_ok=True)

__all__ = ["FastRWAConfig", "FastRWAForCausalLM", "FastRWACache", "FastRWACausalLMOutput",
           "FastRWAByteTokenizer"]
