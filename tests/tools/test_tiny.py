"""The bundled checkpoints are exactly what the builder makes, and load with the real loaders."""

from __future__ import annotations

import hashlib

import pytest
from conftest import MODELS, run_cli


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("kind", ["lm", "vlm"])
def test_rebuilt_checkpoint_matches_the_bundled_one_and_loads(tmp_path, kind):
    code, output = run_cli("make-tiny-model", str(tmp_path / kind), "--kind", kind)
    assert code == 0, output
    bundled = MODELS / f"tiny-{kind}"
    names = sorted(p.name for p in bundled.iterdir())
    assert sorted(p.name for p in (tmp_path / kind).iterdir()) == names
    for name in names:
        assert _digest(tmp_path / kind / name) == _digest(bundled / name), name

    if kind == "lm":
        import mlx_lm

        model, tokenizer = mlx_lm.load(str(tmp_path / kind))
        assert tokenizer.convert_tokens_to_ids("<|im_end|>") in tokenizer.eos_token_ids
        text = mlx_lm.generate(model, tokenizer, "hello", max_tokens=3)
    else:
        import mlx_vlm
        from mlx_vlm.utils import prepare_inputs
        from PIL import Image

        model, processor = mlx_vlm.load(str(tmp_path / kind))
        assert model.config.model_type == "qwen2_vl"
        assert processor.image_processor.max_pixels == 56 * 56
        prompt = (
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        image = Image.new("RGB", (56, 56))
        inputs = prepare_inputs(processor, images=[image], prompts=prompt)
        image_id = model.config.image_token_id
        assert inputs["input_ids"].flatten().tolist().count(image_id) == 4  # 56² px → 4 tokens
        text = mlx_vlm.generate(model, processor, prompt, image=[image], max_tokens=3).text
    assert isinstance(text, str)


def test_another_seed_gives_other_weights(tmp_path):
    assert run_cli("make-tiny-model", str(tmp_path / "s1"), "--kind", "lm", "--seed", "1")[0] == 0
    assert _digest(tmp_path / "s1" / "model.safetensors") != _digest(MODELS / "tiny-lm" / "model.safetensors")


def test_the_thinking_checkpoint_has_qwen3s_markers_and_template(tmp_path):
    import mlx_lm

    code, output = run_cli("make-tiny-model", str(tmp_path / "t"), "--kind", "thinking-lm", "--sensitive")
    assert code == 0, output
    model, tokenizer = mlx_lm.load(str(tmp_path / "t"))
    assert tokenizer.has_thinking and (tokenizer.think_start, tokenizer.think_end) == ("<think>", "</think>")
    messages = [{"role": "user", "content": "hello"}]
    off = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    on = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # mlx-lm: on
    assert on.endswith("<|im_start|>assistant\n<think>\n")  # the block opened: the row reasons at once
    assert off == on.removesuffix("<think>\n") + "<think>\n\n</think>\n\n"
    assert mlx_lm.generate(model, tokenizer, on, max_tokens=3)  # it loads and generates
