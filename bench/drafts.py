"""Speculative decoding on the tiny checkpoints: tokens/s with and without a drafter, and the
acceptance rate. On models this small drafting is expected to cost more than it saves; the
point of the feature is exact accounting, and these numbers are for the record.

    python bench/drafts.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blas import fast_blas  # noqa: E402  (bench/blas.py: --fast-blas)

import batchgen  # noqa: E402
from batchgen.tools.tiny.builder import make_tiny_model  # noqa: E402

ROWS, MAX_TOKENS = 32, 64


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
        target, drafter = str(folder / "pair" / "target"), str(folder / "pair" / "drafter")
        measure(vision_job, out, "qwen3_5 image rows, no drafter", model=target)
        for block in (2, 3):
            measure(vision_job, out, f"qwen3_5 image rows, MTP drafter, block={block}", model=target,
                    draft_model=drafter, draft_block_size=block)  # fmt: skip


if __name__ == "__main__":
    fast_blas()
    main()
