"""An engine's starting checkpoint in SGLang's block-FP8 layout (rollout.precision=fp8).

SGLang registers FP8 parameters (`weight` float8_e4m3fn, `weight_scale_inv` float32) only when the
model's config.json carries a `quantization_config` with an fp8 quant_method and a
weight_block_size (Fp8Config.from_config -> is_checkpoint_fp8_serialized, weight_block_size; see
python/sglang/srt/layers/quantization/fp8.py). Started from a bf16 directory, even with
`--quantization fp8`, it quantizes per channel after loading and has no `weight_scale_inv` for the
block-FP8 weight syncs to land in. So the engines start from this converted copy instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from miles_core.weight_sync.quantization import fp8_quantization_config, quantize_named_tensors

_INDEX = "model.safetensors.index.json"


def _convert_shard(src: Path, dst: Path) -> list[str]:
    """One safetensors shard quantized into dst; returns the names it holds now."""
    from safetensors.torch import load_file, save_file

    tensors = dict(quantize_named_tensors(load_file(str(src)).items(), dtype=None))
    save_file(tensors, str(dst), metadata={"format": "pt"})
    return list(tensors)


def block_shape_problems(hf_config: dict, tp: int, block: int = 128) -> list[str]:
    """What SGLang's Fp8LinearMethod.validate_block_quant_shapes would refuse at start-up for this
    model at tensor parallel size tp: each shard of a fused projection (q, k, v of qkv_proj; gate,
    up of gate_up_proj) and of a column-parallel one must hold whole 128-row blocks, and a
    row-parallel projection (o_proj, down_proj) split over tp > 1 whole 128-column blocks."""
    h = hf_config["hidden_size"]
    heads, kv_heads = hf_config["num_attention_heads"], hf_config.get("num_key_value_heads", hf_config["num_attention_heads"])
    head_dim = hf_config.get("head_dim") or h // heads
    mlp = hf_config.get("moe_intermediate_size") if hf_config.get("num_experts") else hf_config["intermediate_size"]
    outputs = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim,
               "gate_proj": mlp, "up_proj": mlp}
    problems = [f"{name} rows per tp rank {size // tp} (of {size}) are not a multiple of {block}"
                for name, size in outputs.items() if (size // tp) % block or size % tp]
    if tp > 1:
        inputs = {"o_proj": heads * head_dim, "down_proj": mlp}
        problems += [f"{name} columns per tp rank {size // tp} (of {size}) are not a multiple of {block}"
                     for name, size in inputs.items() if (size // tp) % block or size % tp]
    return problems


def write_fp8_checkpoint(src_dir: str | Path, dst_dir: str | Path) -> Path:
    """Copies the HF directory src_dir to dst_dir with its decoder layers' linear weights in
    block FP8 (miles_core.weight_sync.quantization) and `quantization_config` added to config.json.
    Rewritten whole each time (deterministic), into a temporary directory renamed at the end so
    that an interrupted conversion never leaves a half-written checkpoint behind."""
    src, dst = Path(src_dir), Path(dst_dir)
    if not list(src.glob("*.safetensors")):
        raise ValueError(f"{src} has no *.safetensors weights: an FP8 engine checkpoint is converted from "
                         "safetensors only (save the model with safe_serialization=True)")
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    for path in sorted(src.iterdir()):
        if path.suffix == ".safetensors":
            weight_map.update(dict.fromkeys(_convert_shard(path, tmp / path.name), path.name))
        elif path.name not in ("config.json", _INDEX) and path.is_file():
            shutil.copy2(path, tmp / path.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = fp8_quantization_config()
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if (src / _INDEX).exists():  # the scales join their weights' shards
        index = json.loads((src / _INDEX).read_text())
        index["weight_map"] = weight_map
        (tmp / _INDEX).write_text(json.dumps(index, indent=2))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst
