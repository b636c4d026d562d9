"""The files a row names beside its job: paths under the job's rules, adapter folders, digests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

__all__ = [
    "local_path",
    "row_path",
    "RefusedPath",
    "file_digest",
    "ADAPTER_FILES",
    "ADAPTER_KINDS",
    "MAX_ADAPTER_RANK",
    "adapter_config",
    "adapter_digest",
]


def local_path(source: str, base: Path) -> Path:
    """The file a local media reference names: `~` expanded, relative to the job's folder."""
    path = Path(source).expanduser()
    return path if path.is_absolute() else base / path


class RefusedPath(ValueError):
    """A local path the run may not open for a row: why, in a few words."""


def row_path(source: str, base: Path | None, root: str | None) -> Path:
    """A local file or folder a row names, as the run allows it: relative to the job's folder
    and inside the media root when one is set (RefusedPath: a remote job, whose rows name no
    path of this machine, or a path outside the root)."""
    if base is None:
        raise RefusedPath("a local path, in a job that may not name this machine's files")
    path = local_path(source, base)
    if root is not None and not path.resolve().is_relative_to(Path(root).resolve()):
        raise RefusedPath(f"outside the media root {Path(root).resolve()}")
    return path


def file_digest(path: Path) -> str:
    """sha256 of a file's whole content, read a MiB at a time (MediaFile.sha256)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# An adapter folder as mlx-lm and mlx-vlm save one: its settings and its weights.
ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")
ADAPTER_KINDS = ("lora", "dora")  # what is applied and taken off between rows (fine_tune_type)
MAX_ADAPTER_RANK = 512  # LoRA layers of a higher rank would hold a model's worth of memory
_ADAPTER_CONFIG_BYTES = 1 << 20


def adapter_config(folder: str | Path) -> dict[str, Any]:
    """An adapter folder's settings, once it is one batchgen can switch in and out of a model:
    its two files regular files, its config a small JSON object, a LoRA or DoRA (a full
    fine-tune replaces the weights: it is a model, for --model) of a rank from 1 to
    MAX_ADAPTER_RANK, which the engines read before any tensor (ValueError: what is wrong)."""
    folder = Path(folder)
    missing = [name for name in ADAPTER_FILES if not (folder / name).is_file()]
    if missing:
        what = "an adapter folder as mlx-lm or mlx-vlm saves one"
        raise ValueError(f"no {' or '.join(missing)} there ({what})")
    path = folder / ADAPTER_FILES[0]
    if path.stat().st_size > _ADAPTER_CONFIG_BYTES:
        raise ValueError(f"{ADAPTER_FILES[0]} is over {_ADAPTER_CONFIG_BYTES >> 20} MiB")
    try:
        config = json.loads(path.read_bytes())
    except ValueError as e:
        raise ValueError(f"{ADAPTER_FILES[0]} is not JSON ({str(e)[:80]})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{ADAPTER_FILES[0]}: expected an object")
    kind = config.get("fine_tune_type", "lora")
    if kind not in ADAPTER_KINDS:
        full = "a full fine-tune replaces the weights: give it as --model"
        raise ValueError(f"fine_tune_type {kind!r:.40}: expected a LoRA or DoRA adapter ({full})")
    lora = config.get("lora_parameters", config)  # mlx-vlm's older adapters keep the rank at the top
    rank = lora.get("rank") if isinstance(lora, dict) else None
    if not (type(rank) is int and 1 <= rank <= MAX_ADAPTER_RANK):
        raise ValueError(f"rank {rank!r:.40}: expected an integer from 1 to {MAX_ADAPTER_RANK}")
    return config


def adapter_digest(folder: str | Path) -> str:
    """An adapter's content (its two files) as one sha256: the row's `adapter_sha256`, by which a
    rerun sees an adapter trained again under the same folder (OSError: a file gone)."""
    digests = " ".join(file_digest(Path(folder) / name) for name in ADAPTER_FILES)
    return hashlib.sha256(digests.encode()).hexdigest()
