"""Several adapters in one job: 4 LoRA adapters × 64 rows as one batchgen run (`--adapters`,
each row naming its adapter, the base weights loaded once) against 4 runs, one per adapter
fused into a model copy (`mlx_lm fuse`), as a user without adapter support runs them. The one
run twice: with `--fuse-adapters` (each adapter fused in place as mlx_lm fuse fuses it, so its
rows equal the fused copies' token for token) and with the LoRA layers (mlx-lm's generate with
`adapter_path=`, a little slower per step). All timed in one process, model loads included;
then each one-run's rows compared by id with the fused copies'.

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
        separate, copies = 0.0, {}
        for name in names:
            mine = [{k: v for k, v in r.items() if k != "adapter"} for r in rows if r["adapter"] == name]
            took, out = timed_run(mine, generation, model=str(fused[name]))
            separate += took
            copies |= {r["id"]: r["generated_text"] for r in out}
        timings = {}
        for how, fuse in (("fused in place", True), ("LoRA layers", False)):
            took, out = timed_run(rows, generation, model=str(base), adapters=named, fuse_adapters=fuse)
            same = sum(copies[r["id"]] == r["generated_text"] for r in out)
            timings[how] = took
            equal = f"rows equal to the fused copies': {same} of {len(rows)}"
            print(f"one run, adapters {how + ':':<16} {took:6.2f} s, {equal}", flush=True)
        print(f"{ADAPTERS} runs of fused copies:             {separate:6.2f} s")
        for how, took in timings.items():
            print(f"one run ({how}) against the separate runs: {separate / took:.2f}x")


if __name__ == "__main__":
    fast_blas()
    main()
