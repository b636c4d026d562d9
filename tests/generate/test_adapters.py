"""A LoRA adapter for the run (--adapter): rows equal the engine's own generate with the model
loaded with that adapter, token for token; an adapter that cannot apply stops the run before
any row; the adapter's content is part of the output's settings."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
from conftest import MEDIA, MODELS, read, run_cli, write_jsonl

from batchgen.tools.tiny.adapters import make_tiny_adapter

PROMPTS = ["Tell me about the sea.", "Name a colour.", "Hi!", "Tell me about the sea.", "Count to five."]


@pytest.fixture(scope="module")
def lm_adapter(tmp_path_factory):
    return make_tiny_adapter(MODELS / "tiny-lm", tmp_path_factory.mktemp("lora") / "lm", seed=1)


def _mlx_vlm(model_dir, adapter, row) -> tuple[str, int]:
    """(text, completion tokens) of mlx-vlm's generate for a row, the model loaded with `adapter`."""
    import mlx_vlm
    from mlx_vlm.prompt_utils import get_chat_template
    from PIL import Image

    model, processor = mlx_vlm.load(str(model_dir), adapter_path=str(adapter) if adapter else None)
    text = {"type": "text", "text": row["prompt"], "content": row["prompt"]}
    parts = [{"type": "image"}, text] if "image" in row else [text]
    prompt = get_chat_template(processor, [{"role": "user", "content": parts}], True)
    images = [Image.open(row["image"]).convert("RGB")] if "image" in row else None
    ref = mlx_vlm.generate(
        model, processor, prompt, image=images, max_tokens=row["max_tokens"], temperature=0.0
    )
    tokens = ref.token_ids[:-1] if ref.finish_reason == "stop" else ref.token_ids
    return processor.tokenizer.decode(tokens), len(ref.token_ids)


def _run(tmp_path, name, rows, *flags):
    job = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    out = tmp_path / f"{name}.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--temperature", "0", *flags)
    return code, output, out


def test_text_rows_with_an_adapter_equal_mlx_lm_with_it(tmp_path, lm_adapter):
    import mlx_lm

    rows = [{"id": i, "prompt": p, "max_tokens": 6 + 2 * i} for i, p in enumerate(PROMPTS)]
    lm = str(MODELS / "tiny-lm")
    code, output, out = _run(tmp_path, "adapted", rows, "--model", lm, "--adapter", str(lm_adapter),
                             "--batch-size", "3")  # fmt: skip
    assert code == 0, output
    assert "one at a time" not in output
    got = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in read(out)}
    code, output, base = _run(tmp_path, "base", rows, "--model", lm)
    plain = {r["id"]: r["generated_text"] for r in read(base)}

    model, tokenizer = mlx_lm.load(lm, adapter_path=str(lm_adapter))
    eos = set(tokenizer.eos_token_ids)
    for row in rows:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True
        )
        tokens = [
            r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=row["max_tokens"])
        ]
        text = tokenizer.decode([t for t in tokens if t not in eos])
        assert got[row["id"]] == (text, len(tokens)), row["id"]
    assert sum(got[i][0] != plain[i] for i in got) >= 4  # the adapter reaches the answers


def test_media_and_text_rows_with_a_vision_adapter_equal_mlx_vlm_with_it(tmp_path, sensitive_qwen3_vl):
    """An mlx-vlm adapter on a vision-language model: its image rows batch, and its text rows run
    on mlx-vlm too (the adapter is in mlx-vlm's layout), each as mlx-vlm's generate with it."""
    adapter = make_tiny_adapter(sensitive_qwen3_vl, tmp_path / "lora", seed=2)
    pictures = ["red_circle.png", "blue_square.webp"]
    rows = [
        {"id": f"i{k}", "image": str(MEDIA / p), "prompt": q, "max_tokens": 8}
        for k, (p, q) in enumerate((p, q) for p in pictures for q in ("What is it?", "Colour?"))
    ]
    rows.append({"id": "text", "prompt": "Say something.", "max_tokens": 8})
    flags = ("--model", str(sensitive_qwen3_vl), "--adapter", str(adapter))
    code, output, out = _run(tmp_path, "adapted", rows, *flags)
    assert code == 0, output
    assert "one at a time" not in output
    got = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in read(out)}
    code, output, base = _run(tmp_path, "base", rows, "--model", str(sensitive_qwen3_vl))
    plain = {r["id"]: r["generated_text"] for r in read(base)}

    for row in rows:
        assert got[row["id"]] == _mlx_vlm(sensitive_qwen3_vl, adapter, row), row["id"]
    assert sum(got[i][0] != plain[i] for i in got) >= 4


def test_an_adapter_that_cannot_apply_stops_the_run_before_any_row(tmp_path, lm_adapter, sensitive_qwen3_vl):
    job = write_jsonl(tmp_path / "jobs.jsonl", [{"id": 1, "prompt": "Hi"}])
    out = tmp_path / "out.parquet"
    lm, vlm = str(MODELS / "tiny-lm"), str(sensitive_qwen3_vl)
    broken = tmp_path / "broken"
    shutil.copytree(lm_adapter, broken)
    (broken / "adapter_config.json").write_text("{not json")
    full, wide = (shutil.copytree(lm_adapter, tmp_path / name) for name in ("full", "wide"))
    for folder, key, value in (
        (full, "fine_tune_type", "full"),
        (wide, "lora_parameters", {"rank": 100_000}),
    ):
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps(config | {key: value}))
    other = make_tiny_adapter(MODELS / "tiny-lm", tmp_path / "wider", seed=3, rank=8)
    config = json.loads((other / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = 4  # its tensors are rank 8: shapes the layers do not take
    (other / "adapter_config.json").write_text(json.dumps(config))
    cases = [
        (
            ("--model", lm, "--adapter", str(tmp_path / "missing")),
            "no adapter_config.json or adapters.safetensors",
        ),
        (("--model", lm, "--adapter", str(broken)), "adapter_config.json is not JSON"),
        (
            ("--model", lm, "--adapter", str(full)),
            "a full fine-tune replaces the weights: give it as --model",
        ),
        (("--model", lm, "--adapters", f"huge={wide}"), "rank 100000: expected an integer from 1 to 512"),
        (("--model", lm, "--adapter", str(other)), "mlx-lm cannot load it"),
        (("--model", vlm, "--adapter", str(lm_adapter)), "tensors have no place in the model"),
        (("--model", vlm, "--text-model", lm, "--adapter", str(lm_adapter)), "an adapter fits the one model"),
    ]
    for flags, message in cases:
        code, output = run_cli("run", str(job), "-o", str(out), "-q", *flags)
        assert code == 2 and message in output, (flags, output)
        assert not out.exists()


def test_a_changed_adapter_changes_only_its_rows_on_the_rerun(tmp_path, lm_adapter):
    """An adapter trained again under the same folder is a change to the rows that ran with it
    (as a replaced picture is): the rerun refuses them by name, `--changed redo` generates just
    those again (with the new adapter, as mlx-lm's generate with it), the other rows resume."""
    import mlx_lm

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(lm_adapter, a)
    make_tiny_adapter(MODELS / "tiny-lm", b, seed=2)
    rows = [{"id": f"{n}{i}", "prompt": p, "adapter": n} for n in "ab" for i, p in enumerate(PROMPTS[:2])]
    rows.append({"id": "base", "prompt": PROMPTS[2], "adapter": "base"})
    flags = ("--model", str(MODELS / "tiny-lm"), "--adapters", f"a={a},b={b}", "--max-tokens", "6")
    code, output, out = _run(tmp_path, "job", rows, *flags)
    assert code == 0, output
    first = {r["id"]: r for r in read(out)}
    assert first["a0"]["adapter"] == str(a) and first["base"]["adapter"] is None
    assert first["a0"]["adapter_sha256"] != first["b0"]["adapter_sha256"]
    code, output, out = _run(tmp_path, "job", rows, *flags)  # the same adapters: nothing to do
    assert code == 0 and "5 resumed" in output, output
    (b / "adapters.safetensors").touch()  # touched, not changed: still done
    code, output, out = _run(tmp_path, "job", rows, *flags)
    assert code == 0 and "5 resumed" in output, output

    make_tiny_adapter(MODELS / "tiny-lm", b, seed=9)  # trained again under the same folder
    code, output, out = _run(tmp_path, "job", rows, *flags)
    assert code == 2 and "2 row(s) changed" in output and f"adapter {b} replaced" in output, output
    code, output, out = _run(tmp_path, "job", rows, *flags, "--changed", "redo")
    assert code == 0 and "3 resumed" in output, output
    got = {r["id"]: r for r in read(out)}
    assert {k: got[k] for k in ("a0", "a1", "base")} == {k: first[k] for k in ("a0", "a1", "base")}
    model, tokenizer = mlx_lm.load(str(MODELS / "tiny-lm"), adapter_path=str(b))
    for row in rows[2:4]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True
        )
        tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=6)]
        eos = set(tokenizer.eos_token_ids)
        assert got[row["id"]]["generated_text"] == tokenizer.decode([t for t in tokens if t not in eos])
        assert got[row["id"]]["adapter_sha256"] != first[row["id"]]["adapter_sha256"]
    assert any(got[k]["generated_text"] != first[k]["generated_text"] for k in ("b0", "b1"))


@pytest.mark.slow  # several adapters against the engine (3 s)
def test_rows_naming_adapters_each_equal_the_engine_with_theirs(tmp_path, lm_adapter):
    """One job, rows naming adapter a, b, the base model, or none (the run's --adapter, here a),
    under a long shared system prompt whose prefix snapshots a row of another adapter must not
    reuse: each row equals mlx-lm's generate with its own adapter; one stretch of rows per
    adapter (two switches after the first load), a name not in the set is that row's error."""
    import mlx_lm

    other = make_tiny_adapter(MODELS / "tiny-lm", tmp_path / "b", seed=2)
    system = " ".join(["Answer briefly and plainly, in the manner of a ship's log."] * 8)
    rows = []
    for i, p in enumerate(PROMPTS[:4]):
        for name in ("a", "b", "base", None):
            row = {"id": f"{i}-{name}", "system": system, "prompt": p, "max_tokens": 8}
            rows.append(row | ({"adapter": name} if name else {}))
    rows.append({"id": "unknown", "prompt": "Hi", "adapter": "c"})
    flags = ("--model", str(MODELS / "tiny-lm"), "--adapter", "a", "--adapters", f"a={lm_adapter},b={other}",
             "--batch-size", "4")  # fmt: skip
    code, output, out = _run(tmp_path, "named", rows, *flags)
    assert code == 1, output
    assert "2 adapter switches" in output
    got = {r["id"]: r for r in read(out)}
    assert got["unknown"]["error_stage"] == "read"
    assert (
        "adapter 'c': not one of --adapters (a, b) nor 'base', nor an adapter folder"
        in got["unknown"]["error"]
    )
    assert sum(r["cached_tokens"] for r in got.values() if r["error"] is None) > 0  # prefixes were reused

    lm = str(MODELS / "tiny-lm")
    for name, adapter in (("a", lm_adapter), ("b", other), ("base", None)):
        model, tokenizer = mlx_lm.load(lm, adapter_path=str(adapter) if adapter else None)
        eos = set(tokenizer.eos_token_ids)
        for i, p in enumerate(PROMPTS[:4]):
            turns = [{"role": "system", "content": system}, {"role": "user", "content": p}]
            ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True)
            tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=8)]
            want = (tokenizer.decode([t for t in tokens if t not in eos]), len(tokens))
            for row in [f"{i}-{name}", *([f"{i}-None"] if name == "a" else [])]:
                assert (got[row]["generated_text"], got[row]["completion_tokens"]) == want, row
    texts = {got[f"0-{name}"]["generated_text"] for name in ("a", "b", "base")}
    assert len(texts) == 3


def test_fused_adapters_equal_the_fused_checkpoints_rows(tmp_path):
    """--fuse-adapters: each adapter fused into the weights as `mlx_lm fuse` fuses it (each
    LoRA layer's own fuse()), the base put back between them: every row equals mlx-lm's
    generate on that fused model. In bf16 the fused weights round otherwise than the LoRA
    layers' sum, so the rows tell the two apart; the run with the layers equals mlx-lm's
    generate with them (bf16 logprobs tie where the logits do not, and the engines' greedy
    pick breaks the tie as batchgen's must). An output made with the layers is not resumed
    with them fused."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_unflatten

    lm = shutil.copytree(MODELS / "tiny-lm", tmp_path / "tiny-lm-bf16")
    for f in lm.glob("*.safetensors"):
        mx.save_safetensors(str(f), {k: v.astype(mx.bfloat16) for k, v in mx.load(str(f)).items()})
    adapters = {name: make_tiny_adapter(lm, tmp_path / name, seed=k) for k, name in enumerate("ab")}
    pairs = itertools.product(enumerate(PROMPTS[:3]), ("a", "base", "b"))
    rows = [{"id": f"{i}-{name}", "prompt": p, "max_tokens": 12, "adapter": name} for (i, p), name in pairs]
    flags = ("--model", str(lm), "--adapters", ",".join(f"{n}={p}" for n, p in adapters.items()))
    code, output, out = _run(tmp_path, "fused", rows, *flags, "--fuse-adapters")
    assert code == 0, output
    got = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in read(out)}
    code, output, layers = _run(tmp_path, "layers", rows, *flags)
    assert code == 0, output
    unfused = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in read(layers)}
    for name, fuse in itertools.product(("a", "b", "base"), (True, False)):
        model, tokenizer = mlx_lm.load(str(lm), adapter_path=str(adapters[name]) if name != "base" else None)
        if fuse:
            fused = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
            model.update_modules(tree_unflatten(fused))
        eos = set(tokenizer.eos_token_ids)
        for i, p in enumerate(PROMPTS[:3]):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=12)]
            want = (tokenizer.decode([t for t in tokens if t not in eos]), len(tokens))
            assert (got if fuse else unfused)[f"{i}-{name}"] == want, (f"{i}-{name}", fuse)
    assert sum(got[k] != unfused[k] for k in got if not k.endswith("base")) >= 3  # fusing changed them
    assert all(got[k] == unfused[k] for k in got if k.endswith("base"))  # and the base was put back
    code, output, _ = _run(tmp_path, "layers", rows, *flags, "--fuse-adapters")
    assert code == 2 and "adapters_fused" in output, output


def test_rows_naming_adapter_folders_next_to_the_job_equal_mlx_lm_with_them(tmp_path, lm_adapter):
    """A row's `adapter` that names no adapter of the set is a folder relative to the job's,
    under the same rules as a media path (inside --media-root); each folder is checked before
    its rows run, and one that is missing, outside the root or a full fine-tune is those rows'
    `read` error naming it. The others equal mlx-lm's generate with that folder."""
    import mlx_lm

    jobs = tmp_path / "jobs"
    shutil.copytree(lm_adapter, jobs / "adapters" / "a")
    make_tiny_adapter(MODELS / "tiny-lm", jobs / "adapters" / "b", seed=2)
    full = shutil.copytree(lm_adapter, jobs / "adapters" / "full")
    (full / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full"}))
    shutil.copytree(lm_adapter, tmp_path / "outside")
    pairs = itertools.product(enumerate(PROMPTS[:3]), ("a", "b"))
    rows = [
        {"id": f"{i}-{n}", "prompt": p, "max_tokens": 8, "adapter": f"adapters/{n}"} for (i, p), n in pairs
    ]
    rows += [{"id": "plain", "prompt": PROMPTS[0], "max_tokens": 8}]
    bad = {"missing": "adapters/c", "outside": "../outside", "full": "adapters/full", "control": "a\x00b"}
    rows += [{"id": k, "prompt": "Hi", "adapter": v} for k, v in bad.items()]
    job = write_jsonl(jobs / "jobs.jsonl", rows)
    out = tmp_path / "out.parquet"
    lm = str(MODELS / "tiny-lm")
    flags = ("--temperature", "0", "--model", lm, "--media-root", str(jobs))
    code, output = run_cli("run", str(job), "-o", str(out), *flags)
    assert code == 1, output
    got = {r["id"]: r for r in read(out)}
    assert {k for k, r in got.items() if r["status"] != "ok"} == set(bad)
    assert all(got[k]["error_stage"] == "read" for k in bad)
    missing = "'adapters/c': not one of --adapters (none given) nor 'base', nor an adapter folder (no "
    assert missing + "adapter_config.json" in got["missing"]["error"]
    assert "outside the media root" in got["outside"]["error"]
    assert "a full fine-tune replaces the weights" in got["full"]["error"]
    assert "expected an adapter's name or folder" in got["control"]["error"]
    assert (
        got["0-a"]["adapter"] == str((jobs / "adapters" / "a").resolve()) and got["plain"]["adapter"] is None
    )
    for name in ("a", "b"):
        model, tokenizer = mlx_lm.load(lm, adapter_path=str(jobs / "adapters" / name))
        for i, p in enumerate(PROMPTS[:3]):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=8)]
            assert got[f"{i}-{name}"]["completion_tokens"] == len(tokens), name
            text = tokenizer.decode([t for t in tokens if t not in set(tokenizer.eos_token_ids)])
            assert got[f"{i}-{name}"]["generated_text"] == text, f"{i}-{name}"


def test_rows_naming_vision_adapters_equal_mlx_vlm_with_theirs(tmp_path, sensitive_qwen3_vl):
    adapters = {
        n: make_tiny_adapter(sensitive_qwen3_vl, tmp_path / n, seed=s) for n, s in (("x", 4), ("y", 5))
    }
    rows = []
    for name in ("x", "y", "base"):
        for k, picture in enumerate(("red_circle.png", "blue_square.webp")):
            rows.append({"id": f"{name}{k}", "image": str(MEDIA / picture), "prompt": "What is it?",
                         "max_tokens": 8, "adapter": name})  # fmt: skip
        rows.append({"id": f"{name}-text", "prompt": "Say something.", "max_tokens": 8, "adapter": name})
    # An adapter trained on a 4-bit base: mlx-vlm would quantize this float model's layers for good.
    quantized = shutil.copytree(adapters["x"], tmp_path / "q")
    config = json.loads((quantized / "adapter_config.json").read_text())
    layer = {"language_model.model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 4, "mode": "affine"}}
    (quantized / "adapter_config.json").write_text(json.dumps(config | {"base_quantization": layer}))
    rows.insert(1, {"id": "q", "image": str(MEDIA / "red_circle.png"), "prompt": "What?", "adapter": "q"})
    named = ",".join(f"{n}={path}" for n, path in [*adapters.items(), ("q", quantized)])
    code, output, out = _run(tmp_path, "named", rows, "--model", str(sensitive_qwen3_vl), "--adapters", named)
    assert code == 1, output
    (failed,) = (r for r in read(out) if r["status"] != "ok")
    assert failed["id"] == "q" and "trained on a quantized base" in failed["error"], failed["error"]
    got = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in read(out)}
    for name in ("x", "y", "base"):  # the base is as it was: rows after q's equal the engine's
        for row in (r for r in rows if r["adapter"] == name):
            assert got[row["id"]] == _mlx_vlm(sensitive_qwen3_vl, adapters.get(name), row), row["id"]
    assert len({got[f"{n}0"] for n in ("x", "y", "base")}) == 3


def test_taking_an_adapter_off_gives_back_the_layers_each_engine_wrapped():
    """Both engines' LoRA and DoRA layers and mlx-vlm's older LoRA layer: each replaced by the
    very layer it wrapped, and nothing else touched."""
    import mlx.nn as nn
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear
    from mlx_vlm.trainer.peft.lora import LoRaLayer
    from mlx_vlm.trainer.peft.lora_layers import LoRALinear as VLMLoRALinear

    from batchgen.generate.load.loading import _take_off

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(8, 8) for _ in range(5)]

    block = Block()
    bases = list(block.layers)
    block.layers[0] = LoRALinear.from_base(bases[0], r=2)
    block.layers[1] = DoRALinear.from_base(bases[1], r=2)
    block.layers[2] = LoRaLayer(bases[2], rank=2)
    block.layers[3] = VLMLoRALinear.from_base(bases[3], r=2)
    _take_off(block)
    assert all(layer is base for layer, base in zip(block.layers, bases, strict=True))
