"""Seeded sampling on the batched lanes: a seeded row's draws are keyed by its seed and each
token's position (sampling.Seeded), so its tokens are the same at any batch width, beside any
batch mates and in any row order, and equal the engines' own one-row generate drawing with the
same sampler; an output drawn by another recipe is never silently resumed."""

from __future__ import annotations

import random

import pytest
from conftest import MEDIA, read, run_cli, write_jsonl

import batchgen.input.rows
import batchgen.output.resume
from batchgen.core.params import GenParams
from batchgen.generate.decode.sampling import Seeded
from batchgen.tools.tiny.builder import make_tiny_model

PROMPTS = ["Tell me about red circles.", "Count to ten: one two", "Describe a blue square.", "Write a poem."]
TEMPERATURE, MAX_TOKENS = 0.8, 16


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("seeded") / "lm", "lm", sensitive=True)


def _seeded_rows() -> list[dict]:
    text = [{"id": f"t{k}-s{s}", "prompt": p, "seed": s} for k, p in enumerate(PROMPTS) for s in range(6)]
    image = [{"id": f"i-s{s}", "image": str(MEDIA / "red_circle.png"), "prompt": "Describe.", "seed": s}
             for s in range(3)]  # fmt: skip
    return [
        {**r, "temperature": TEMPERATURE, "max_tokens": MAX_TOKENS, "logprobs": True} for r in text + image
    ]


def _tokens(tmp_path, name, rows, lm, vlm, *flags) -> dict[str, list[int]]:
    job = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    out = tmp_path / f"{name}.parquet"
    code, said = run_cli("run", str(job), "-o", str(out), "--model", str(vlm), "--text-model", str(lm),
                         "-q", *flags)  # fmt: skip
    assert code == 0, said
    return {r["id"]: [t["id"] for t in r["logprobs"]] for r in read(out)}


@pytest.mark.slow  # many widths and orders (5 s)
def test_seeded_rows_draw_the_same_tokens_at_any_width_order_and_beside_any_rows(tmp_path, lm, sensitive_vlm):
    rows = _seeded_rows()
    alone = _tokens(tmp_path, "w1", rows, lm, sensitive_vlm, "--batch-size", "1")
    shuffled = rows[:]
    random.Random(4).shuffle(shuffled)
    mates = [{"id": f"m{k}", "prompt": f"Something else {k}.", "temperature": t, "max_tokens": 24 + k,
              "logprobs": True} for k, t in enumerate([0.0, 1.3, 0.5, 0.0, 2.0])]  # fmt: skip
    wide = _tokens(tmp_path, "w8", shuffled + mates, lm, sensitive_vlm, "--batch-size", "8")
    widest = _tokens(tmp_path, "w32", rows[::-1], lm, sensitive_vlm, "--batch-size", "32")
    for row in rows:
        assert alone[row["id"]] == wide[row["id"]] == widest[row["id"]], row["id"]
    draws = {tuple(alone[f"t0-s{s}"]) for s in range(6)}
    assert len(draws) >= 4  # the seeds draw differently


def test_a_seeded_row_is_the_engines_own_generate_drawing_with_its_sampler(tmp_path, lm, sensitive_vlm):
    import mlx_lm
    import mlx_vlm

    rows = _seeded_rows()
    got = _tokens(tmp_path, "ref", rows, lm, sensitive_vlm, "--batch-size", "8")
    model, tokenizer = mlx_lm.load(str(lm))
    for row in rows[:6]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True
        )
        sampler = Seeded(GenParams(temperature=TEMPERATURE, seed=row["seed"]))  # top_p 0.9, the run's default
        tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS,
                                                          sampler=sampler)]  # fmt: skip
        assert got[row["id"]] == tokens, row["id"]
    model, processor = mlx_vlm.load(str(sensitive_vlm))
    slot = "<|vision_start|><|image_pad|><|vision_end|>"
    prompt = f"<|im_start|>user\n{slot}Describe.<|im_end|>\n<|im_start|>assistant\n"
    for row in rows[-3:]:
        sampler = Seeded(GenParams(temperature=TEMPERATURE, seed=row["seed"]))
        ref = mlx_vlm.generate(model, processor, prompt, image=[row["image"]], max_tokens=MAX_TOKENS,
                               sampler=sampler)  # fmt: skip
        assert got[row["id"]] == list(ref.token_ids)[: len(got[row["id"]])], row["id"]
        assert len(got[row["id"]]) == len(ref.token_ids) or ref.finish_reason != "stop"


def test_the_seeded_sampler_filters_as_mlx_lm_and_keys_each_position():
    import mlx.core as mx

    logprobs = mx.log(mx.array([[0.05, 0.6, 0.3, 0.05]]))
    top1 = Seeded(GenParams(temperature=1.0, seed=3, top_k=1, top_p=1.0))
    assert [top1(logprobs).item() for _ in range(20)] == [1] * 20  # top_k 1: the likeliest, always
    draws = Seeded(GenParams(temperature=1.0, seed=3, top_p=1.0))
    seq = [draws(logprobs).item() for _ in range(40)]
    again = Seeded(GenParams(temperature=1.0, seed=3, top_p=1.0))
    assert [again(logprobs).item() for _ in range(40)] == seq and len(set(seq)) >= 3  # keyed per position
    other = Seeded(GenParams(temperature=1.0, seed=4, top_p=1.0))
    assert [other(logprobs).item() for _ in range(40)] != seq
    mx.random.seed(0)
    before = mx.random.uniform().item()
    mx.random.seed(0)
    Seeded(GenParams(temperature=1.0, seed=3))(logprobs)
    assert mx.random.uniform().item() == before  # the global random state is never touched


def test_results_drawn_by_another_recipe_are_never_resumed_silently(tmp_path, lm, monkeypatch):
    rows = [{"id": "s", "prompt": "Hi.", "seed": 1, "temperature": TEMPERATURE}, {"id": "g", "prompt": "Hi."}]
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    out, run_seeded = tmp_path / "out.parquet", tmp_path / "run.parquet"
    flags = ("--model", str(lm), "--max-tokens", "4", "-q")
    assert run_cli("run", str(job), "-o", str(out), *flags)[0] == 0
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"id": "a", "prompt": "Hi."}])
    assert (
        run_cli("run", str(plain), "-o", str(run_seeded), *flags, "--seed", "5", "--temperature", "0.9")[0]
        == 0
    )
    monkeypatch.setattr(batchgen.input.rows, "SEEDED_SAMPLER", 99)  # a later recipe
    monkeypatch.setattr(batchgen.output.resume, "SEEDED_SAMPLER", 99)
    code, said = run_cli("run", str(job), "-o", str(out), *flags)
    assert code == 2 and "1 row(s) changed since their results were written" in said, said
    assert "(id 's')" in said and "(id 'g')" not in said  # the seeded row only
    code, said = run_cli("run", str(job), "-o", str(out), *flags, "--changed", "redo")
    assert code == 0 and [r["id"] for r in read(out)] == ["s", "g"], said  # drawn again, by the new recipe
    code, said = run_cli(
        "run", str(plain), "-o", str(run_seeded), *flags, "--seed", "5", "--temperature", "0.9"
    )
    assert code == 2 and "sampler: 2 then, 99 now" in said, said


def test_a_seeded_row_with_a_drafter_draws_as_mlx_lms_speculative_loop_with_its_sampler(tmp_path, lm):
    """mlx-lm's speculative loop hands the sampler a draft block's rows at once: each is a
    position of its own, so the row is mlx-lm's own speculative generate with the same sampler."""
    import mlx_lm

    draft = make_tiny_model(tmp_path / "draft", "text-draft")
    rows = [
        {
            "id": f"s{s}",
            "prompt": "Tell me a story.",
            "seed": s,
            "temperature": TEMPERATURE,
            "max_tokens": MAX_TOKENS,
        }
        for s in range(3)
    ]  # fmt: skip (no logprobs: drafters report none)
    job = write_jsonl(tmp_path / "jobs.jsonl", rows)
    flags = ("--model", str(lm), "--draft-model", str(draft), "--num-draft-tokens", "3", "-q")
    assert run_cli("run", str(job), "-o", str(tmp_path / "out.parquet"), *flags)[0] == 0
    got = {r["id"]: r for r in read(tmp_path / "out.parquet")}
    assert all(r["mtp_drafts"] > 0 for r in got.values())  # the speculative loop ran
    model, tokenizer = mlx_lm.load(str(lm))
    drafter, _ = mlx_lm.load(str(draft))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True
    )
    for row in rows:
        sampler = Seeded(GenParams(temperature=TEMPERATURE, seed=row["seed"]))
        tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS,
                                                          sampler=sampler, draft_model=drafter,
                                                          num_draft_tokens=3)]  # fmt: skip
        said = tokens[:-1] if tokens[-1] in tokenizer.eos_token_ids else tokens
        assert got[row["id"]]["generated_text"] == tokenizer.decode(said), row["id"]
        assert got[row["id"]]["completion_tokens"] == len(tokens), row["id"]
