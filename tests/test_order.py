"""Images follow their slots: whatever column or turn names them, the processor gets them in
prompt order (checked against mlx-vlm's own generate on a checkpoint that tells them apart)."""

from __future__ import annotations

import numpy as np
from conftest import read, run_cli, write_jsonl
from PIL import Image

QUESTION = "What is in these pictures?"


def _reference(model_dir, images, max_tokens=10):
    import mlx_vlm

    model, processor = mlx_vlm.load(str(model_dir))
    slots = "<|vision_start|><|image_pad|><|vision_end|>" * len(images)
    prompt = f"<|im_start|>user\n{slots}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    ref = mlx_vlm.generate(model, processor, prompt, image=images, max_tokens=max_tokens, temperature=0.0)
    tokens = ref.token_ids[:-1] if ref.finish_reason == "stop" else ref.token_ids
    return processor.tokenizer.decode(tokens), len(ref.token_ids)


def test_a_flat_image_and_an_image_in_messages_reach_their_own_slots(tmp_path, sensitive_vlm):
    rng = np.random.default_rng(5)
    for name, shape in (("a", (56, 56, 3)), ("b", (40, 72, 3))):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(tmp_path / f"{name}.png")

    def user(*images):
        return [{"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                             {"type": "text", "text": QUESTION}]}]  # fmt: skip

    job = write_jsonl(tmp_path / "jobs.jsonl", [
        {"id": "flat-first", "image": "a.png", "messages": user("b.png")},
        {"id": "explicit", "messages": user("a.png", "b.png")},
        {"id": "reversed", "messages": user("b.png", "a.png")},
    ])  # fmt: skip
    pictures = [Image.open(tmp_path / f"{n}.png").convert("RGB") for n in "ab"]
    in_order, swapped = _reference(sensitive_vlm, pictures), _reference(sensitive_vlm, pictures[::-1])
    assert in_order != swapped  # the checkpoint tells the orders apart
    for flags in ((), ("--batch-size", "1", "--no-cache")):
        out = tmp_path / f"out{len(flags)}.parquet"
        code, output = run_cli("run", str(job), "-o", str(out), "--model", str(sensitive_vlm),
                               "--temperature", "0", "--max-tokens", "10", "-q", *flags)  # fmt: skip
        assert code == 0, output
        got = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in read(out)}
        assert got == {"flat-first": in_order, "explicit": in_order, "reversed": swapped}
