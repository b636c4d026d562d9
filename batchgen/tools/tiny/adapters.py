"""Tiny LoRA adapters built offline, in the format each engine loads.

mlx-lm's format for a text model (`mlx_lm.load(path, adapter_path=...)`), mlx-vlm's for a
vision-language one (`mlx_vlm.load(path, adapter_path=...)`).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

__all__ = ["make_tiny_adapter"]


def make_tiny_adapter(base: Path, out: Path, seed: int = 0, rank: int = 4, dora: bool = False) -> Path:
    """An adapter of `rank` for the checkpoint in `base`, written to `out` (adapter_config.json
    and adapters.safetensors); a different `seed` is a different adapter."""
    out.mkdir(parents=True, exist_ok=True)
    if "vision_config" in json.loads((base / "config.json").read_text()):  # the tiny VLMs all have one
        model, config = _vlm_lora(base, rank, dora)
    else:
        model, config = _lm_lora(base, rank, dora)
    mx.random.seed(seed)
    weights = dict(tree_flatten(model.trainable_parameters()))
    drawn = {k: mx.random.normal(v.shape) * 0.2 if k.endswith("lora_b") else v for k, v in weights.items()}
    model.update(tree_unflatten(list(drawn.items())))
    mx.save_safetensors(str(out / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def _lm_lora(base: Path, rank: int, dora: bool):
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = load(str(base))[0]
    model.freeze()
    layers = len(model.layers)
    parameters = {"rank": rank, "scale": 10.0, "dropout": 0.0}
    linear_to_lora_layers(model, layers, parameters, use_dora=dora)
    return model, {
        "fine_tune_type": "dora" if dora else "lora",
        "num_layers": layers,
        "lora_parameters": parameters,
    }


def _vlm_lora(base: Path, rank: int, dora: bool):
    from mlx_vlm import load
    from mlx_vlm.trainer.peft.utils import get_peft_model

    model, _ = load(str(base))
    model = get_peft_model(model, rank=rank, alpha=2.0 * rank, dropout=0.0, verbose=False, use_dora=dora)
    return model, model._vlm_adapter_config
