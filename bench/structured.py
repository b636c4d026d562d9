"""Constrained decoding's cost: 128 prompts on the tiny text model, each asked for JSON under
one of four schemas (caption, tags and a colour; a count; a list of animals; a short text and
a score), against the same rows unconstrained, each then generating as many tokens as it did
under its schema (the same batches and work, but for the masks). Prints tokens/s of each and
the ratio (the issue asks >= 0.7), and checks every constrained output parses and validates.

    python bench/structured.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "generate"))

from blas import fast_blas  # noqa: E402  (bench/blas.py: --fast-blas)
from test_structured import SCHEMAS  # noqa: E402

import batchgen  # noqa: E402

ROWS, MAX_TOKENS = 128, 96
MODEL = ROOT / "sample_data" / "models" / "tiny-lm"


def run(job: Path, out: Path) -> tuple[float, list[dict]]:
    import pyarrow.parquet as pq

    config = batchgen.build_config(job, out, None, {"temperature": 0.0, "max_tokens": MAX_TOKENS},
                                   model=str(MODEL), quiet=True)  # fmt: skip
    t0 = time.perf_counter()
    summary = batchgen.run(config)
    return summary.completion_tokens / (time.perf_counter() - t0), pq.read_table(out).to_pylist()


def main() -> None:
    import jsonschema

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prompts = [f"Describe thing number {k} as JSON." for k in range(ROWS)]
        constrained = folder / "constrained.jsonl"
        lines = [
            json.dumps({"id": k, "prompt": p, "json_schema": SCHEMAS[k % 4]}) for k, p in enumerate(prompts)
        ]
        constrained.write_text("".join(line + "\n" for line in lines))
        run(constrained, folder / "warm.parquet")  # imports, first kernels, the tokenizer's trie
        rate, rows = run(constrained, folder / "constrained.parquet")
        # The same rows unconstrained, each generating as many tokens as it did constrained:
        # the same batches, the same work, but for the masks.
        plain = folder / "plain.jsonl"
        budgets = [{"id": k, "prompt": p, "max_tokens": r["completion_tokens"]} for k, (p, r) in
                   enumerate(zip(prompts, rows, strict=True))]  # fmt: skip
        plain.write_text("".join(json.dumps(b) + "\n" for b in budgets))
        base, plain_rows = run(plain, folder / "plain.parquet")
        tokens = sum(r["completion_tokens"] for r in rows)
        print(
            f"unconstrained  {base:7.1f} tok/s over {sum(r['completion_tokens'] for r in plain_rows)} tokens"
        )
        print(f"constrained    {rate:7.1f} tok/s over {tokens} tokens")
        valid = 0
        for k, row in enumerate(rows):
            try:
                jsonschema.validate(json.loads(row["generated_text"]), SCHEMAS[k % 4])
                valid += 1
            except (json.JSONDecodeError, jsonschema.ValidationError):
                pass
        print(f"constrained outputs that parse and validate: {valid}/{ROWS}")
        print(f"tokens/s with constraints vs without: {rate / base:.2f}")


if __name__ == "__main__":
    fast_blas()
    main()
