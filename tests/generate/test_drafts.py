"""Speculative decoding: greedy output unchanged, draft counts exact where acceptance is known."""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest
from conftest import MEDIA, MODELS, read, run_cli, write_jsonl

from batchgen.generate.load.drafts import drafted_from_flags
from batchgen.tools.tiny.builder import make_tiny_model


def _variant(src, dst, zero: tuple[str, ...]):
    """A copy of a checkpoint with some tensors zeroed: a final norm of 0 makes every logit 0
    (greedy picks token 0); zeroed output projections make a model echo its last token."""
    shutil.copytree(src, dst)
    weights = mx.load(str(dst / "model.safetensors"))
    for key in weights:
        if any(key.endswith(z) for z in zero):
            weights[key] = mx.zeros_like(weights[key])
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dst


ECHO = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


@pytest.fixture(scope="module")
def text_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    make_tiny_model(root / "draft", "text-draft")
    return {
        "draft": root / "draft",
        "zero": _variant(MODELS / "tiny-lm", root / "zero", ("model.norm.weight",)),
        "echo": _variant(MODELS / "tiny-lm", root / "echo", ECHO),
    }


@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    make_tiny_model(root / "pair", "mtp-pair")
    return {
        "target": root / "pair" / "target",
        "drafter": root / "pair" / "drafter",
        "zero_target": _variant(
            root / "pair" / "target", root / "zero_target", ("language_model.model.norm.weight",)
        ),
        "echo_target": _variant(root / "pair" / "target", root / "echo_target", ECHO),
        "zero_drafter": _variant(root / "pair" / "drafter", root / "zero_drafter", ("norm.weight",)),
    }


def _run(tmp_path, name, rows, *flags):
    job = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    out = tmp_path / f"{name}.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--temperature", "0", "-q", *flags)
    assert code == 0, output
    return read(out), output


TEXT_ROWS = [
    {"id": i, "prompt": p} for i, p in enumerate(["Tell me about the sea.", "Name a colour.", "Hi!"])
]


def test_text_draft_keeps_greedy_output(tmp_path, text_pair):
    plain, _ = _run(tmp_path, "plain", TEXT_ROWS, "--model", str(MODELS / "tiny-lm"), "--max-tokens", "16")
    drafted, output = _run(
        tmp_path, "drafted", TEXT_ROWS, "--model", str(MODELS / "tiny-lm"), "--max-tokens", "16",
        "--draft-model", str(text_pair["draft"]), "--num-draft-tokens", "2",
    )  # fmt: skip
    assert [r["generated_text"] for r in drafted] == [r["generated_text"] for r in plain]
    assert [r["completion_tokens"] for r in drafted] == [r["completion_tokens"] for r in plain]
    assert all(0 <= r["mtp_accepted"] <= r["mtp_drafts"] and r["mtp_drafts"] > 0 for r in drafted)
    assert all(r["mtp_drafts"] == r["mtp_accepted"] == 0 for r in plain)
    assert "drafts" in output and "accepted" in output


@pytest.mark.parametrize("m, k", [(8, 2), (11, 3)])
def test_text_draft_counts_are_exact(tmp_path, text_pair, m, k):
    flags = ("--max-tokens", str(m), "--num-draft-tokens", str(k))
    # Full acceptance: a target drafting for itself, both always choosing token 0.
    rows, _ = _run(tmp_path, "full", TEXT_ROWS, "--model", str(text_pair["zero"]),
                   "--draft-model", str(text_pair["zero"]), *flags)  # fmt: skip
    for r in rows:
        assert r["completion_tokens"] == m
        assert r["mtp_drafts"] == r["mtp_accepted"] == m - m // (k + 1)
    # Zero acceptance: the draft proposes token 0, the target echoes its last token.
    rows, _ = _run(tmp_path, "none", TEXT_ROWS, "--model", str(text_pair["echo"]),
                   "--draft-model", str(text_pair["zero"]), *flags)  # fmt: skip
    for r in rows:
        assert r["mtp_accepted"] == 0
        assert r["mtp_drafts"] == sum(min(k, m - e) for e in range(m))


def test_drafted_from_flags_replays_rounds():
    assert drafted_from_flags([True, True, False, True, False], 5, 2) == 2 + 2
    assert drafted_from_flags([False] * 4, 4, 3) == 3 + 3 + 2 + 1
    assert drafted_from_flags([True, True, True, False, True, True], 6, 3) == 3 + 2
    assert drafted_from_flags([], 5, 3) == 0


def _vision_rows():
    return [
        {"id": "img", "image": str(MEDIA / "red_circle.png"), "prompt": "What is it?"},
        {"id": "txt", "prompt": "Say something."},
    ]


def test_mtp_keeps_greedy_output_with_and_without_an_image(tmp_path, mtp_pair):
    base = ("--model", str(mtp_pair["target"]), "--max-tokens", "10")
    plain, _ = _run(tmp_path, "plain", _vision_rows(), *base)
    drafted, _ = _run(tmp_path, "mtp", _vision_rows(), *base, "--draft-model", str(mtp_pair["drafter"]))
    embedded, _ = _run(tmp_path, "embedded", _vision_rows(), *base, "--draft-model", str(mtp_pair["target"]),
                       "--draft-kind", "mtp")  # fmt: skip
    texts = [r["generated_text"] for r in plain]
    assert [r["generated_text"] for r in drafted] == texts == [r["generated_text"] for r in embedded]
    assert [r["mtp_drafts"] for r in drafted] == [r["mtp_drafts"] for r in embedded]
    assert all(0 <= r["mtp_accepted"] <= r["mtp_drafts"] and r["mtp_drafts"] > 0 for r in drafted)


@pytest.mark.parametrize("m, block", [(9, 2), (12, 3)])
def test_mtp_counts_are_exact(tmp_path, mtp_pair, m, block):
    flags = (
        "--max-tokens",
        str(m),
        "--draft-model",
        str(mtp_pair["zero_drafter"]),
        "--draft-block-size",
        str(block),
    )
    rows, output = _run(tmp_path, "full", _vision_rows(), "--model", str(mtp_pair["zero_target"]), *flags)
    for r in rows:
        assert r["completion_tokens"] == m
        assert r["mtp_drafts"] == r["mtp_accepted"] == (m - 1) - (m - 1) // block
    assert "(100%)" in output
    rows, _ = _run(tmp_path, "none", _vision_rows(), "--model", str(mtp_pair["echo_target"]), *flags)
    for r in rows:
        assert r["mtp_accepted"] == 0
        assert r["mtp_drafts"] == sum(min(block - 1, r_) for r_ in range(1, m))


def test_mtp_rows_batch_in_waves_with_the_targets_own_tokens(tmp_path, sensitive_qwen3_5):
    """Rows with Qwen3.5's MTP head batch in mlx-vlm's rounds, four at a time (waves by
    layout and draws): text and image rows, budgets from 1 to 16 tokens, a stop string that
    batchgen ends inside a round, seeded sampled rows (two seeds, two temperatures, one seed
    on two rows): each row as without the drafter, nothing one at a time, an unseeded sampled
    row too; the drafter's proposals counted per row (the checkpoint's head is random: few
    accepted)."""
    import json

    drafter = sensitive_qwen3_5.parent / "drafter"
    pictures = [str(MEDIA / f) for f in ("red_circle.png", "blue_square.webp", "green_triangle_rotated.jpg")]
    rows = [
        {"id": f"t{k}", "prompt": f"Tell me story {k} about the sea.", "max_tokens": 4 + 3 * k}
        for k in range(4)
    ]
    rows += [
        {
            "id": f"i{k}",
            "image": pictures[k % 3],
            "prompt": ("What is it?", "Colours?")[k // 3],
            "max_tokens": 16,
        }
        for k in range(6)
    ]
    rows += [
        {"id": "one", "image": pictures[0], "prompt": "One word.", "max_tokens": 1},
        {"id": "stop", "image": pictures[1], "prompt": "Go on.", "max_tokens": 16, "stop": ["e", "4"]},
    ]
    rows += [
        {"id": f"s{k}", "prompt": "Pick one.", "max_tokens": 12, "temperature": t, "seed": seed}
        for k, (t, seed) in enumerate([(0.7, 3), (0.7, 3), (0.7, 5), (1.5, 3)])
    ]
    rows.append({"id": "g", "prompt": "Pick one.", "max_tokens": 12})
    rows.append(
        {
            "id": "s-pic",
            "image": pictures[2],
            "prompt": "Say.",
            "max_tokens": 12,
            "temperature": 0.7,
            "seed": 3,
        }
    )
    sampled = {"id": "sampled", "prompt": "Pick.", "max_tokens": 6, "temperature": 0.7}
    flags = ("--model", str(sensitive_qwen3_5), "--batch-size", "4")
    plain, _ = _run(tmp_path, "plain", rows, *flags)
    drafted, _ = _run(tmp_path, "drafted", [*rows, sampled], *flags, "--draft-model", str(drafter))
    by_id = {r["id"]: r for r in drafted}
    for r in plain:
        d = by_id[r["id"]]
        assert (d["generated_text"], d["completion_tokens"], d["finish_reason"]) == (
            r["generated_text"], r["completion_tokens"], r["finish_reason"]
        ), r["id"]  # fmt: skip
        assert 0 <= d["mtp_accepted"] <= d["mtp_drafts"] <= 2 * max(d["completion_tokens"] - 1, 0), r["id"]
    assert len({r["generated_text"] for r in plain}) >= len(plain) - 2  # outputs differ row to row
    assert by_id["stop"]["finish_reason"] == "stop" and by_id["one"]["completion_tokens"] == 1
    assert by_id["one"]["mtp_drafts"] == 0 and by_id["t3"]["mtp_drafts"] > 0 < by_id["s0"]["mtp_drafts"]
    text = {k: by_id[k]["generated_text"] for k in ("s0", "s1", "s2", "s3", "g")}
    assert text["s0"] == text["s1"] and len({text[k] for k in ("s0", "s2", "s3", "g")}) >= 3  # they sample
    stats = json.loads((tmp_path / "drafted.parquet.stats.json").read_text())
    assert stats["one_at_a_time"] == {}
    assert by_id["sampled"]["mtp_drafts"] > 0 and by_id["sampled"]["error"] is None
    assert by_id["sampled"]["completion_tokens"] == 6


def test_invalid_drafter_settings_stop_the_run_before_any_row(tmp_path, mtp_pair, text_pair):
    job = write_jsonl(tmp_path / "jobs.jsonl", TEXT_ROWS)
    out = tmp_path / "out.parquet"
    target, drafter = str(mtp_pair["target"]), str(mtp_pair["drafter"])
    lm, draft = str(MODELS / "tiny-lm"), str(text_pair["draft"])
    cases = [
        (("--model", target, "--draft-model", drafter, "--draft-block-size", "1"), "must be >= 2"),
        (("--model", target, "--draft-model", drafter, "--draft-kind", "dflash"), "draft model"),
        (("--model", lm, "--draft-model", draft, "--num-draft-tokens", "0"), "must be >= 1"),
        (("--model", lm, "--draft-model", str(tmp_path / "missing")), "cannot read"),
    ]
    for flags, message in cases:
        code, output = run_cli("run", str(job), "-o", str(out), "-q", *flags)
        assert code == 2 and message in output, output
        assert not out.exists()


@pytest.mark.slow  # row by row against mlx-lm's speculative loop (3 s)
def test_text_drafter_rows_speculate_batched_as_mlx_lms_own_loop(tmp_path, text_pair):
    """Greedy rows of mixed lengths and seeded sampled rows, eight at a time: each row's text,
    its drafted and accepted counts are those of mlx-lm's one-row speculative generate with the
    same drafter (and the seeded row's own keyed sampler); a row with a repetition penalty goes
    through that loop itself, named in the closing line."""
    import mlx_lm

    from batchgen.core.params import GenParams
    from batchgen.generate.decode.sampling import Seeded

    k = 3
    prompts = ["Tell me about the sea.", "Name a colour.", "Hi!", "Count: one two three four",
               "Describe a red circle on a white background.", "Why?", "List some fruit.",
               "Write a line about winter.", "What is a map?", "Say yes."]  # fmt: skip
    rows = [{"id": f"r{i}", "prompt": p, "max_tokens": 6 + 5 * (i % 4)} for i, p in enumerate(prompts)]
    rows += [
        {"id": f"s{s}", "prompt": prompts[s], "temperature": 0.9, "seed": s, "max_tokens": 10 + s}
        for s in range(3)
    ]
    rows.append({"id": "penalty", "prompt": "Hi!", "repetition_penalty": 1.3, "max_tokens": 8})
    model = ("--model", str(MODELS / "tiny-lm"))
    got, output = _run(
        tmp_path,
        "batched",
        rows,
        *model,
        "--draft-model",
        str(text_pair["draft"]),
        "--num-draft-tokens",
        str(k),
        "--batch-size",
        "8",
    )
    got = {r["id"]: r for r in got}
    why = "text drafter rows with penalties or biases: mlx-lm's speculative loop"
    assert f"1 row one at a time ({why})" in output
    target, tokenizer = mlx_lm.load(str(MODELS / "tiny-lm"))
    draft, _ = mlx_lm.load(str(text_pair["draft"]))
    accepted = sampled = 0
    for row in rows[:-1]:
        messages = [{"role": "user", "content": row["prompt"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        seeded = {}
        if "seed" in row:
            seeded = {"sampler": Seeded(GenParams(temperature=row["temperature"], seed=row["seed"]))}
        stream = list(
            mlx_lm.stream_generate(
                target,
                tokenizer,
                ids,
                max_tokens=row["max_tokens"],
                draft_model=draft,
                num_draft_tokens=k,
                **seeded,
            )
        )
        flags = [bool(r.from_draft) for r in stream]
        tokens = [r.token for r in stream]
        said = tokens[:-1] if tokens[-1] in tokenizer.eos_token_ids else tokens
        r = got[row["id"]]
        want = (tokenizer.decode(said), len(tokens))
        assert (r["generated_text"], r["completion_tokens"]) == want, row["id"]
        assert r["mtp_accepted"] == sum(flags), row["id"]
        assert r["mtp_drafts"] == drafted_from_flags(flags, row["max_tokens"], k), row["id"]
        accepted += r["mtp_accepted"]
        if seeded:
            greedy = [
                t.token for t in mlx_lm.stream_generate(target, tokenizer, ids, max_tokens=row["max_tokens"])
            ]
            sampled += tokens != greedy
    assert accepted > 0  # the drafter is right at times: acceptance is exercised, not just rejection
    assert sampled  # the seeded rows sample: their draws are checked, not a greedy row's
