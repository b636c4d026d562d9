"""Speculative decoding on the tiny checkpoints: tokens/s with and without a drafter, and the
acceptance rate. On models this small drafting is expected to cost more than it saves; the
point of the feature is exact accounting, and these numbers are for the record. Then the text
drafter's rows batched against the one-row path they took before (mlx-lm's own speculative
generate, row by row) in one process: the same texts and counts, and the speed-up; and the same
for Qwen3.5's MTP head (mlx-vlm's speculative generate row by row, against the batched rounds),
checked token for token against the target alone, greedy and with seeded sampling.

    python bench/drafts.py     # drafter rows (text; MTP; seeded MTP) at width 8: X× one at a time; at 32: Y×
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blas import fast_blas  # noqa: E402  (bench/blas.py: --fast-blas)
from timed import timed_run  # noqa: E402

import batchgen  # noqa: E402
from batchgen.core.params import GenParams  # noqa: E402
from batchgen.generate.decode.sampling import Seeded  # noqa: E402
from batchgen.tools.tiny.builder import make_tiny_model  # noqa: E402

ROWS, MAX_TOKENS = 64, 64
TEMPERATURE, SEED = 0.7, 7


def measure(job: Path, out: Path, label: str, **overrides) -> None:
    config = batchgen.build_config(
        job,
        out,
        None,
        {"temperature": 0.0, "max_tokens": MAX_TOKENS},
        quiet=True,
        overwrite=True,
        **overrides,
    )
    s = batchgen.run(config)
    rate = f", acceptance {s.mtp_accepted}/{s.mtp_drafts} = {s.acceptance_rate:.0%}" if s.mtp_drafts else ""
    print(f"{label:<44} {s.completion_tokens / s.wall_s:7.1f} tok/s{rate}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_tiny_model(folder / "draft", "text-draft")
        make_tiny_model(folder / "pair", "mtp-pair")
        prompts = [f"Tell me story number {i} about the sea and the sky." for i in range(ROWS)]
        text_job = folder / "text.jsonl"
        text_job.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
        image = ROOT / "sample_data" / "media" / "red_circle.png"
        vision_job = folder / "vision.jsonl"
        rows = [{"id": i, "image": str(image), "prompt": p} for i, p in enumerate(prompts)]
        vision_job.write_text("".join(json.dumps(r) + "\n" for r in rows))
        lm = str(ROOT / "sample_data" / "models" / "tiny-lm")
        out = folder / "out.parquet"
        print(f"{ROWS} rows x {MAX_TOKENS} tokens, greedy")
        measure(text_job, out, "text, batched, no drafter", model=lm)
        measure(text_job, out, "text, one row at a time, no drafter", model=lm, batch_size=1)
        for k in (2, 4):
            measure(text_job, out, f"text, draft model, k={k}", model=lm, draft_model=str(folder / "draft"),
                    num_draft_tokens=k)  # fmt: skip
        _batched_against_one_row(prompts, folder, lm)
        target, drafter = str(folder / "pair" / "target"), str(folder / "pair" / "drafter")
        measure(vision_job, out, "qwen3_5 image rows, no drafter", model=target)
        for block in (2, 3):
            measure(vision_job, out, f"qwen3_5 image rows, MTP drafter, block={block}", model=target,
                    draft_model=drafter, draft_block_size=block)  # fmt: skip
        make_tiny_model(folder / "sensitive", "mtp-pair", sensitive=True)
        _mtp_batched_against_one_row(prompts, folder / "sensitive")


def _batched_against_one_row(prompts: list[str], folder: Path, lm: str, k: int = 3) -> None:
    import mlx_lm

    from batchgen.generate.load.drafts import drafted_from_flags

    target, tokenizer = mlx_lm.load(lm)
    draft, _ = mlx_lm.load(str(folder / "draft"))
    t0 = time.perf_counter()
    want = {}
    for i, p in enumerate(prompts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        stream = list(
            mlx_lm.stream_generate(
                target, tokenizer, ids, max_tokens=MAX_TOKENS, draft_model=draft, num_draft_tokens=k
            )
        )
        flags = [bool(r.from_draft) for r in stream]
        want[i] = (len(stream), sum(flags), drafted_from_flags(flags, MAX_TOKENS, k))
    times = {1: time.perf_counter() - t0}
    made = sum(n for n, _, _ in want.values())
    print(
        f"text drafter k={k}, one row at a time (mlx-lm's speculative generate): {made / times[1]:7.1f} tok/s"
    )
    same = True
    rows = [{"id": i, "prompt": p} for i, p in enumerate(prompts)]
    for width in (8, 32):
        generation = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
        draft_model = str(folder / "draft")
        times[width], out = timed_run(
            rows, generation, model=lm, draft_model=draft_model, num_draft_tokens=k, batch_size=width
        )
        got = {r["id"]: (r["completion_tokens"], r["mtp_accepted"], r["mtp_drafts"]) for r in out}
        same = same and got == want
        print(f"text drafter k={k}, batched at width {width:>2}: {made / times[width]:7.1f} tok/s")
    print(f"the same tokens and counts batched as one at a time: {same}")
    ratios = f"{times[1] / times[8]:.2f}× one at a time; at 32: {times[1] / times[32]:.2f}×"
    print(f"drafter rows at width 8: {ratios}")


def _mtp_batched_against_one_row(prompts: list[str], pair: Path) -> None:
    """Half text rows, half image rows (three pictures of different sizes) on a Qwen3.5 whose
    output follows its input: the target alone and mlx-vlm's one-row speculative generate with
    the MTP head (the path these rows took before), then batchgen batched with the head."""
    import mlx_vlm
    from mlx_vlm.prompt_utils import get_chat_template
    from mlx_vlm.speculative.drafters import load_drafter
    from PIL import Image, ImageOps

    from batchgen.generate.load.loading import mend_processor

    media = ROOT / "sample_data" / "media"
    pictures = [media / f for f in ("red_circle.png", "blue_square.webp", "green_triangle_rotated.jpg")]
    rows = [
        {"id": i, "prompt": p, **({"image": str(pictures[i % 3])} if i % 2 else {})}
        for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()  # the batched runs load both models: the one-row side's time counts them too
    model, processor = mlx_vlm.load(str(pair / "target"))
    mend_processor(processor)
    head, _ = load_drafter(str(pair / "drafter"), "mtp")
    loading = time.perf_counter() - t0
    tokenizer = processor.tokenizer
    eos = set(tokenizer.stopping_criteria.eos_token_ids)

    def one_row(seed: int | None = None, **draft) -> tuple[float, dict]:
        t0, found = time.perf_counter(), {}
        for r in rows:
            drawn = {}
            if seed is not None:  # the one-row path seeded rows took: a keyed sampler, fresh per row
                drawn = {"sampler": Seeded(GenParams(temperature=TEMPERATURE, seed=seed))}
            parts = [{"type": "image"}] if "image" in r else []
            text = {"type": "text", "text": r["prompt"], "content": r["prompt"]}
            turns = [{"role": "user", "content": [*parts, text]}]
            image = [ImageOps.exif_transpose(Image.open(r["image"])).convert("RGB")] if "image" in r else None
            stream = mlx_vlm.stream_generate(
                model,
                processor,
                get_chat_template(processor, turns, True),
                image=image,
                max_tokens=MAX_TOKENS,
                temperature=0.0 if seed is None else TEMPERATURE,
                **drawn,
                **draft,
            )
            tokens: list[int] = []
            for x in stream:  # the closing response lists every token (the end token too)
                final = getattr(x, "token_ids", None)
                tokens = [int(t) for t in final] if final is not None else [*tokens, int(x.token)]
            found[r["id"]] = (tokenizer.decode([t for t in tokens if t not in eos]), len(tokens))
        return time.perf_counter() - t0, found

    _, alone = one_row()
    times = {}
    times[1], drafted = one_row(draft_model=head, draft_kind="mtp")
    times[1] += loading
    made = sum(n for _, n in alone.values())
    what = "MTP rows, one at a time (mlx-vlm's speculative generate, loading included)"
    print(f"{what}: {made / times[1]:7.1f} tok/s")
    differ = {i for i in alone if drafted[i] != alone[i]}
    for width in (8, 32):
        generation = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
        times[width], out = timed_run(
            rows, generation, model=str(pair / "target"), draft_model=str(pair / "drafter"), batch_size=width
        )
        differ |= {r["id"] for r in out if (r["generated_text"], r["completion_tokens"]) != alone[r["id"]]}
        print(f"MTP rows, batched at width {width:>2}: {made / times[width]:7.1f} tok/s")
    print(
        f"the target alone's tokens, one at a time and batched with the head: {not differ} {sorted(differ)}"
    )
    ratios = f"{times[1] / times[8]:.2f}× one at a time; at 32: {times[1] / times[32]:.2f}×"
    print(f"MTP drafter rows at width 8: {ratios}")

    # Seeded sampled rows (the run's seed, as --seed gives every row): before, one at a time in
    # mlx-vlm's speculative generate; now in the batched rounds, each row the target alone's
    # seeded tokens (batchgen without the drafter, whose seeded draws are batch-invariant).
    seeded = {"temperature": TEMPERATURE, "seed": SEED, "max_tokens": MAX_TOKENS}
    _, plain = timed_run(rows, seeded, model=str(pair / "target"))
    alone = {r["id"]: (r["generated_text"], r["completion_tokens"]) for r in plain}
    times[1], _ = one_row(seed=SEED, draft_model=head, draft_kind="mtp")
    times[1] += loading
    made = sum(n for _, n in alone.values())
    print(f"seeded MTP rows, one at a time (mlx-vlm's speculative generate): {made / times[1]:7.1f} tok/s")
    differ = set()
    for width in (8, 32):
        times[width], out = timed_run(
            rows, seeded, model=str(pair / "target"), draft_model=str(pair / "drafter"), batch_size=width
        )
        differ |= {r["id"] for r in out if (r["generated_text"], r["completion_tokens"]) != alone[r["id"]]}
        print(f"seeded MTP rows, batched at width {width:>2}: {made / times[width]:7.1f} tok/s")
    print(f"the target alone's seeded tokens, batched with the head: {not differ} {sorted(differ)}")
    ratios = f"{times[1] / times[8]:.2f}× one at a time; at 32: {times[1] / times[32]:.2f}×"
    print(f"seeded MTP drafter rows at width 8: {ratios}")


if __name__ == "__main__":
    fast_blas()
    main()
