"""`--fast-blas` for the benchmarks: run again under an installed OpenBLAS (OpenCV's wheel
bundles one with the standard cblas names), preloaded with one thread, as `batchgen env`
suggests. MLX's Linux CPU wheel multiplies with the reference BLAS, which hides batchgen's own
overhead; under a fast one the ratios show it, as faster hardware would. Never done without
the flag; said when there is no such library."""

from __future__ import annotations

import os
import sys

FLAG = "--fast-blas"


def fast_blas() -> None:
    """Strip the flag from sys.argv; with it, re-exec this script with the OpenBLAS preloaded."""
    if FLAG not in sys.argv:
        return
    sys.argv.remove(FLAG)
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        print(f"--fast-blas: {os.environ['LD_PRELOAD']} preloaded, OPENBLAS_NUM_THREADS="
              f"{os.environ.get('OPENBLAS_NUM_THREADS')}")  # fmt: skip
        return
    from batchgen.generate.environment import environment

    found = environment().faster_blas
    if found is None:
        print("--fast-blas: no OpenBLAS exporting cblas_sgemm is installed here; running on the shipped BLAS")
        return
    print(f"--fast-blas: running again with {found} preloaded (OPENBLAS_NUM_THREADS=1)", flush=True)
    env = {**os.environ, "LD_PRELOAD": found, "OPENBLAS_NUM_THREADS": "1"}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)
