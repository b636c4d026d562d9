"""What a bug report needs to say about the machine (`batchgen env`).

MLX's Linux CPU wheel links the reference (netlib) BLAS: on this project's 2-core x86 box it
ran the workload's matmuls at 3.6–8 GFLOP/s against 72–117 for OpenBLAS on one core, and
preloading the OpenBLAS that OpenCV's wheel bundles made captioning and text runs 2.3× faster
with identical greedy tokens (shared/docs/workflow-notes.md). Old OpenBLAS builds miscompute
on some CPUs, so this is said, never done.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .decode.memory import device_memory

__all__ = ["Environment", "environment"]

_PACKAGES = (
    "batchgen",
    "mlx",
    "mlx-lm",
    "mlx-vlm",
    "transformers",
    "tokenizers",
    "llguidance",
    "pyarrow",
    "pillow",
    "opencv-python",
    "ray",
)


@dataclass(slots=True)
class Environment:
    platform: str
    python: str
    backend: str  # metal | cuda | cpu
    device: str
    versions: dict[str, str | None] = field(default_factory=dict)  # None: not installed
    blas: str | None = None  # the BLAS library loaded with MLX (Linux)
    reference_blas: bool = False  # ... the slow reference one MLX's CPU wheel ships
    faster_blas: str | None = None  # an installed OpenBLAS that exports cblas_sgemm
    preloaded: bool = False  # ... already in this process (LD_PRELOAD)
    memory_budget: int = 0  # what --memory-budget auto takes here
    memory_how: str = ""  # ... and where the figure comes from


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _loaded_libraries() -> list[str]:
    try:
        return sorted(
            {
                line.split()[-1]
                for line in Path("/proc/self/maps").read_text().splitlines()
                if line.endswith(".so") or ".so." in line.rsplit("/", 1)[-1]
            }
        )
    except OSError:
        return []


def _openblas_candidates() -> list[Path]:
    """OpenBLAS libraries other wheels bring (OpenCV's bundles one with the plain cblas names;
    numpy's are renamed `scipy_*` and cannot stand in)."""
    found = []
    for folder in map(Path, sys.path):
        if folder.is_dir():
            found += sorted(folder.glob("*.libs/libopenblas*.so*"))
    return found


def _exports_sgemm(path: Path) -> bool:
    try:
        return hasattr(ctypes.CDLL(str(path)), "cblas_sgemm")
    except OSError:
        return False


def environment() -> Environment:
    metal = getattr(mx, "metal", None)
    cuda = getattr(mx, "cuda", None)
    backend = (
        "metal"
        if metal is not None and metal.is_available()
        else "cuda"
        if cuda is not None and cuda.is_available()
        else "cpu"
    )
    env = Environment(
        platform=platform.platform(),
        python=platform.python_version(),
        backend=backend,
        device=str(mx.default_device()),
        versions={name: _version(name) for name in _PACKAGES},
    )
    env.memory_budget, env.memory_how = device_memory()
    if sys.platform.startswith("linux") and backend == "cpu":
        mlx_dir = Path(mx.__file__).resolve().parents[1]  # site-packages: mlx/, mlx_cpu.libs/
        ours = [
            p
            for p in _loaded_libraries()
            if "blas" in Path(p).name.lower() and p.startswith(str(mlx_dir)) and "mlx" in p
        ]
        env.blas = ours[0] if ours else None
        env.reference_blas = env.blas is not None and "openblas" not in Path(env.blas).name
        env.preloaded = "openblas" in os.environ.get("LD_PRELOAD", "")
        env.faster_blas = next((str(p) for p in _openblas_candidates() if _exports_sgemm(p)), None)
    return env
