"""``from_pretrained``'s options for a directory that holds ``model.pt`` (a training run's
format, read by :func:`fastrwa.models.load_pretrained`, not by transformers): those it takes
at any value, those it takes only at the value that asks nothing of the loading (what
lm-eval's ``HFLM`` and the pipelines pass always: ``gguf_file=None``, ``max_memory=None``,
``quantization_config=None``, ``subfolder=""``, ``revision="main"``...), and the one-line
refusal of the rest. The names are those of transformers 5.23's
``PreTrainedModel.from_pretrained`` and the options it reads from ``**kwargs``
(tests/hf/test_hf.py checks that every parameter its signature names is here)."""

from __future__ import annotations

from pathlib import Path

# Where a model comes from (the hub, a cache, a revision of its code, telemetry), how a
# PEFT adapter the directory holds would load (a model.pt directory holds none; the Auto
# classes pass adapter_kwargs always) or what transformers ignores: nothing to do for a
# local model.pt directory, whatever the value.
ANY_VALUE = frozenset({
    "pretrained_model_name_or_path", "cache_dir", "force_download", "local_files_only", "token",
    "proxies", "trust_remote_code", "code_revision", "_commit_hash", "_from_auto",
    "_from_pipeline", "tqdm_class", "weights_only", "disable_mmap", "adapter_kwargs",
    "adapter_name", "mirror", "_fast_init", "low_cpu_mem_usage", "from_tf", "from_flax",
    "offload_state_dict"})

# Applied to the model loaded (FastRWAForCausalLM._from_model_pt); "subfolder" is joined to
# the path before (from_pretrained).
APPLIED = frozenset({"config", "dtype", "torch_dtype", "device_map", "generation_config",
                     "subfolder"})

# Options that change how weights are read, placed or replaced, with the values that change
# nothing (transformers' defaults; lm-eval passes revision "main").
NEUTRAL: dict[str, tuple] = {
    "revision": (None, "main"), "gguf_file": (None,), "max_memory": (None,),
    "quantization_config": (None,), "offload_folder": (None,), "offload_buffers": (False,),
    "variant": (None,), "state_dict": (None,), "distributed_config": (None,), "device_mesh": (None,),
    "tp_plan": (None,), "tp_size": (None,), "use_kernels": (False,),
    "allow_all_kernels": (False,), "kernel_config": (None,), "key_mapping": (None,),
    "ignore_mismatched_sizes": (False,), "use_safetensors": (None, False),
    "fusion_config": (None,), "attn_implementation": (None,),
    "experts_implementation": (None,)}

KNOWN = ANY_VALUE | APPLIED | set(NEUTRAL)


def _same(value: object, neutral: object) -> bool:
    """``value`` is ``neutral`` (``None``), or of its type and equal to it (``0`` is not
    ``False``; an object that compares oddly, a tensor, is not neutral)."""
    if neutral is None:
        return value is None
    try:
        return type(value) is type(neutral) and bool(value == neutral)
    except Exception:        # (a comparison that does not give one bool)
        return False


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_model_pt_options(directory: Path, positional: tuple, options: dict) -> None:
    """Refuse (``ValueError``, one line naming the option, its value and what a model.pt
    directory takes) a positional argument, an option that is not one of
    ``from_pretrained``'s, or one of :data:`NEUTRAL` at another value."""
    where = f"{directory} holds model.pt (a training run's format, loaded as it was saved)"
    export = "python -m fastrwa.hf.export writes a directory that takes every option"
    if positional:
        raise ValueError(f"{where}: from_pretrained takes no positional model arguments for "
                         f"it, got {len(positional)} ({export})")
    for name, value in options.items():
        if name not in KNOWN:
            raise ValueError(f"{where}: from_pretrained cannot apply {name}={_shown(value)} "
                             f"to it (not an option it takes: dtype and a single-device "
                             f"device_map apply; {export})")
        if name in NEUTRAL and not any(_same(value, n) for n in NEUTRAL[name]):
            takes = " or ".join(repr(n) for n in NEUTRAL[name])
            raise ValueError(f"{where}: from_pretrained cannot apply {name}={_shown(value)} "
                             f"to it (it takes {name}={takes}; {export})")
