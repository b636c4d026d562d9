"""Speculative decoding: drafter settings, loading and validation, and exact draft counts.

Two kinds of drafter, told apart by the checkpoint's config:
- a text draft model (an mlx-lm model sharing the target's tokenizer) for rows on mlx-lm,
  proposing `num_draft_tokens` per round;
- an mlx-vlm drafter (`mtp`, `dflash`, `eagle3`) attached to the vision target, proposing
  blocks of `block_size`.
Rows with a text draft model speculate batched (speculative.py); other rows that can use a
drafter run one at a time with it; the counts are the engines' own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import ConfigError
from ..base.arrays import Model, load_lm, parameters

__all__ = ["Drafter", "inspect_drafter", "drafted_from_flags"]


@dataclass(slots=True)
class Drafter:
    path: Path
    lane: str  # "lm": a text draft model for mlx-lm rows; "vlm": an mlx-vlm drafter
    num_draft_tokens: int = 3  # text: tokens proposed per round
    kind: str | None = None  # vision: the drafter kind, as mlx-vlm resolves it from the config
    block_size: int | None = None  # vision: None = the drafter's own
    model: Model = None


def inspect_drafter(path: str, kind: str | None, block_size: int | None, num_draft_tokens: int) -> Drafter:
    """Settings that cannot work are refused here, before any row runs."""
    from mlx_vlm.speculative.drafters import (
        DRAFTER_KIND_BY_MODEL_TYPE,
        KNOWN_DRAFTER_KINDS,
        resolve_drafter_kind,
    )

    folder = Path(path).expanduser()
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"draft model {path!r}: cannot read its config.json ({e})") from e
    if kind is not None and kind not in KNOWN_DRAFTER_KINDS:
        raise ConfigError(f"--draft-kind {kind!r}: expected one of {', '.join(sorted(KNOWN_DRAFTER_KINDS))}")
    if block_size is not None and block_size < 2:
        raise ConfigError(f"--draft-block-size {block_size}: must be >= 2 (1 stops after one token)")
    if num_draft_tokens < 1:
        raise ConfigError(f"--num-draft-tokens {num_draft_tokens}: must be >= 1")
    model_type = str(config.get("model_type", ""))
    vision = kind is not None or model_type in DRAFTER_KIND_BY_MODEL_TYPE or model_type.endswith("_mtp")
    if not vision:
        return Drafter(folder, "lm", num_draft_tokens)
    try:  # the config's own kind, known before loading: the lane a row takes depends on it
        resolved = resolve_drafter_kind(folder, kind)
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(f"draft model {path!r}: {e}") from e
    if kind is not None and resolved != kind:
        raise ConfigError(f"draft model {path!r} is a {resolved!r} drafter, not {kind!r}")
    return Drafter(folder, "vlm", num_draft_tokens, resolved, block_size)


def load_vision_drafter(drafter: Drafter, target: Model) -> None:
    from mlx_vlm.speculative.drafters import load_drafter, validate_drafter_compatibility

    try:
        model, resolved = load_drafter(str(drafter.path), drafter.kind)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ConfigError(f"draft model {str(drafter.path)!r}: {e}") from e
    try:
        validate_drafter_compatibility(target, model, resolved)
    except ValueError as e:
        raise ConfigError(f"draft model {str(drafter.path)!r} does not fit the target: {e}") from e
    drafter.model, drafter.kind = model, resolved


def load_text_drafter(drafter: Drafter, target: Model) -> None:
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    if not can_trim_prompt_cache(make_prompt_cache(target)):
        raise ConfigError(
            f"draft model {str(drafter.path)!r}: the target's cache cannot be rewound (linear attention or "
            "a sliding window), which mlx-lm's speculative decoding needs"
        )
    try:
        model, _ = load_lm(str(drafter.path))
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"draft model {str(drafter.path)!r}: mlx-lm cannot load it ({e})") from e
    ours, theirs = _vocab(model), _vocab(target)
    if ours != theirs:
        raise ConfigError(
            f"draft model {str(drafter.path)!r} has a vocabulary of {ours}, the target {theirs}"
        )
    drafter.model = model


def _vocab(model: Model) -> int | None:
    """Vocabulary size from the model's args, else from its token embedding's rows."""

    size = getattr(getattr(model, "args", None), "vocab_size", None)
    if size is None:
        embeddings = [w for k, w in parameters(model) if k.endswith("embed_tokens.weight")]
        size = embeddings[0].shape[0] if embeddings else None
    return size


def drafted_from_flags(flags: list[bool], max_tokens: int, k: int) -> int:
    """Tokens mlx-lm's speculative loop drafted, from each emitted token's `from_draft`.

    Each round drafts min(k, tokens left) tokens, emits the accepted ones (from_draft) and
    then one token of the target's own, unless the budget ran out first. mlx-lm reports
    only the flags, so the rounds are replayed from them.
    """
    drafted = emitted = i = 0
    while i < len(flags) and emitted < max_tokens:
        proposed = min(k, max_tokens - emitted)
        drafted += proposed
        accepted = 0
        while accepted < proposed and i < len(flags) and flags[i] and emitted < max_tokens:
            accepted += 1
            emitted += 1
            i += 1
        if emitted < max_tokens and i < len(flags):
            emitted += 1  # the target's token that closes the round
            i += 1
    return drafted
