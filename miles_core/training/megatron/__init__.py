"""Megatron-LM (megatron-core) training backend and HF <-> Megatron torch_dist conversion.

Public API (imports are lazy: megatron-core is an optional extra, `pip install .[megatron]`):

- ``MegatronTrainer`` (trainer.py): the FSDPTrainer interface on a megatron-core GPTModel.
- ``convert_hf_to_torch_dist(hf_dir, out_dir, tp=1) -> manifest`` and
  ``export_torch_dist_to_hf(ckpt_dir, hf_dir_template, out_dir)`` (convert.py).
- ``build_gpt_model``, ``init_parallel``, ``SUPPORTED_ARCHITECTURES`` (model.py).
- ``hf_to_megatron``, ``megatron_to_hf``, ``shard``, ``unshard`` (mapping.py).
- ``enable_cpu_mode()`` (cpu_compat.py): test/CPU-only redirection of megatron's CUDA calls.
"""

from __future__ import annotations

_EXPORTS = {
    "MegatronTrainer": "trainer", "MegatronOptions": "trainer",
    "convert_hf_to_torch_dist": "convert", "export_torch_dist_to_hf": "convert", "CONVERTER_VERSION": "convert",
    "conversion_key": "convert", "model_digest": "convert", "verify_manifest": "convert",
    "build_gpt_model": "model", "init_parallel": "model", "SUPPORTED_ARCHITECTURES": "model",
    "SDPAttention": "model", "model_shape": "model",
    "hf_to_megatron": "mapping", "megatron_to_hf": "mapping", "shard": "mapping", "unshard": "mapping",
    "enable_cpu_mode": "cpu_compat",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = sorted(_EXPORTS)
