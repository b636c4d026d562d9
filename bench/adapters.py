"""Several adapters in one job: 4 LoRA adapters × 64 rows as one batchgen run (`--adapters`,
each row naming its adapter, the base weights loaded once and the adapters switched in place)
against 4 runs, one per adapter fused into a model copy (`mlx_lm fuse`), as a user without
adapter support would run them. Both timed in one process, model loads included; then the
rows' outputs compared by id (a fused model's weights round differently from the LoRA layers',
so a row may part after some tokens).

    python bench/adapters.py [--real] [--fast-blas]   # --real: SmolLM2-135M-Instruct, else tiny-lm
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blas import fast_blas  # noqa: E402  (bench/blas.py: --fast-blas)
from timed import timed_run  # noqa: E402

from batchgen.tools.tiny.adapters import make_tiny_adapter  # noqa: E402

ADAPTERS, ROWS, MAX_TOKENS = 4, 64, 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--real", action="store_true", help="SmolLM2-135M-Instruct (fetched once) as the base"
    )
    args, _ = parser.parse_known_args()
    if args.real:
        from batchgen.tools.tiny.gguf import smollm2

        base = smollm2(Path.home() / ".cache" / "batchgen")
    else:
        base = ROOT / "sample_data" / "models" / "tiny-lm"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        names = [f"style{k}" for k in range(ADAPTERS)]
        adapters = {n: make_tiny_adapter(base, folder / n, seed=k) for k, n in enumerate(names)}
        fused = {}
        for name, adapter in adapters.items():
            fused[name] = folder / f"fused-{name}"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "mlx_lm",
                    "fuse",
                    "--model",
                    str(base),
                    "--adapter-path",
                    str(adapter),
                    "--save-path",
                    str(fused[name]),
                ],
                check=True,
                capture_output=True,
            )
        prompts = [f"Describe picture number {i} of the sea in one sentence." for i in range(ROWS)]
        rows = [{"id": f"{n}-{i}", "prompt": p, "adapter": n} for n in names for i, p in enumerate(prompts)]
        generation = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
        named = ",".join(f"{n}={path}" for n, path in adapters.items())
        print(f"{ADAPTERS} adapters x {ROWS} rows x {MAX_TOKENS} tokens on {base.name}, greedy")
        timed_run(rows[:4], generation, model=str(base))  # first compiles
        one, out = timed_run(rows, generation, model=str(base), adapters=named)
        got = {r["id"]: r["generated_text"] for r in out}
        separate, same = 0.0, 0
        for name in names:
            mine = [{k: v for k, v in r.items() if k != "adapter"} for r in rows if r["adapter"] == name]
            took, out = timed_run(mine, generation, model=str(fused[name]))
            separate += took
            same += sum(got[r["id"]] == r["generated_text"] for r in out)
        print(f"one run, {ADAPTERS} adapters switched in place: {one:6.2f} s")
        print(f"{ADAPTERS} runs of fused models:               {separate:6.2f} s")
        print(f"rows equal between the two: {same} of {len(rows)}")
        print(f"one run against separate fused runs: {separate / one:.2f}x")


if __name__ == "__main__":
    fast_blas()
    main()
