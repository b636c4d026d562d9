"""One row at a time through the engines' own generate, where the batched decoder cannot follow.

mlx-vlm for video, audio and the families the batched decoder does not know; both engines'
speculative loops; quantized KV caches where batchgen's batch cache cannot follow the engine's
quantization (mlx-vlm's layer policy; a row quantized in the middle of its decoding).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx

from ...core.params import GenParams
from ...core.records import Generation, Job, Media
from ..base.arrays import Model, Processor
from ..base.watch import Watch
from ..chat.prompts import render, template_parts, text_only
from ..chat.reasoning import Part, thinking_of
from ..chat.traits import Traits
from ..decode.batch_cache import KVQuant
from ..decode.sampling import (
    HISTORY,
    Loops,
    final_text,
    hit_stop,
    logits_processors_for,
    logprob_records,
    sampler_for,
    token_logprobs,
)
from ..load.drafts import Drafter, drafted_from_flags

__all__ = ["KVQuant", "collect", "generate_vlm", "generate_lm", "vlm_prompt_ids"]


def collect(
    stream: Iterator[Any], p: GenParams, traits: Traits, eos: set[int], watch: Watch | None = None,
    part: Part = "answer", processors: Sequence[Callable] = (),
) -> Generation:  # fmt: skip
    """Drain an engine's stream of responses into a Generation: text decoded from the tokens
    it produced (as the batched decoder does), stop strings checked on a bounded tail, the
    prompt count from the engine, a thinking model's reasoning apart (the model's `traits`, and
    `part`: where the row started); `length` when the token budget or the model's context ran out, or a
    budgeted answer has its max_tokens (its Thinking in `processors`), `timeout` past the deadline."""
    watch, thinking, tokenizer = watch or Watch(), thinking_of(processors), traits.tokenizer
    deadline = watch.deadline(time.monotonic())
    tokens: list[int] = []
    logprobs: list[tuple[float, list[tuple[int, float]]]] = []
    last = None
    stopped = capped = timed_out = full = False
    loops, keep = (Loops(p.stop_repetition) if p.stop_repetition else None), None
    for last in stream:
        watch.check_stop()
        final_ids = getattr(last, "token_ids", None)
        if final_ids is not None:  # mlx-vlm's closing response lists them all (and repeats the last)
            tokens = [int(t) for t in final_ids]
            continue
        if last.token is None:
            continue
        tokens.append(int(last.token.item() if hasattr(last.token, "item") else last.token))
        if p.wants_logprobs and getattr(last, "logprobs", None) is not None:  # the engine's, as the decoder's
            row = mx.array(last.logprobs).reshape(1, -1)
            logprobs += token_logprobs(row, [tokens[-1]], [p.top_logprobs])
        if p.stop and hit_stop(tokens, p.stop, tokenizer.decode):
            stopped = True
            break
        if loops is not None and (keep := loops.cut(tokens)) is not None:
            break
        if thinking is not None and thinking.answer_full(len(tokens), tokens[-1]):
            full = True  # the answer's max_tokens, short of the budgeted total: `length`
            break
        if watch.context and int(last.prompt_tokens) + len(tokens) >= watch.context:
            capped = tokens[-1] not in eos
            break
        if time.monotonic() > deadline:
            timed_out = True
            break
    if last is None:
        return Generation(text="", finish_reason="length", prompt_tokens=0, completion_tokens=0)
    completion = len(tokens)
    ended = stopped or (tokens and tokens[-1] in eos) or (completion < p.max_tokens and not (capped or full))
    reason = "timeout" if timed_out and not ended else "stop" if ended else "length"
    gen = Generation(
        text=final_text(tokens if keep is None else tokens[:keep], eos, p.stop, tokenizer.decode),
        finish_reason="repetition" if keep is not None else reason,
        prompt_tokens=int(last.prompt_tokens),
        completion_tokens=completion,
        cached_tokens=int(getattr(last, "cached_tokens", 0) or 0),
        capped=capped,
        logprobs=logprob_records(tokens[: len(logprobs)], logprobs[: len(tokens)], tokenizer.decode)
        if p.wants_logprobs
        else None,
    )
    return traits.closing(gen, tokens, part, p)


def generate_lm(
    model: Model, traits: Traits, ids: list[int], p: GenParams, watch: Watch | None = None,
    part: Part = "answer", drafter: Drafter | None = None, kv: KVQuant | None = None,
) -> Generation:  # fmt: skip
    """mlx-lm's own generate for one tokenized row (`p` already budgeted for its part) on the
    model whose traits (and tokenizer) `traits` holds: its speculative loop with a text draft
    model (draft counts replayed from its flags), its quantized KV cache with `kv`."""
    from mlx_lm import stream_generate

    if p.seed is not None:
        mx.random.seed(p.seed)
    tokenizer = traits.tokenizer
    eos = set(tokenizer.eos_token_ids)
    flags: list[bool] = []
    draft = {"draft_model": drafter.model, "num_draft_tokens": drafter.num_draft_tokens} if drafter else {}

    processors = logits_processors_for(p, traits, eos, part)

    def stream():
        for response in stream_generate(
            model, tokenizer, ids, max_tokens=p.max_tokens, sampler=sampler_for(p),
            logits_processors=processors, **draft, **(kv.engine_kwargs() if kv else {}),
        ):  # fmt: skip
            flags.append(bool(response.from_draft))
            yield response

    gen = collect(stream(), p, traits, eos, watch, part, processors)
    gen.prompt_tokens = len(ids)
    if drafter is not None:
        gen.mtp_accepted = sum(flags)
        gen.mtp_drafts = drafted_from_flags(flags, p.max_tokens, drafter.num_draft_tokens)
    return gen


def _vlm_inputs(processor: Processor, job: Job, media: Media, traits: Traits) -> tuple[str, list, list]:
    """(prompt, images, videos) as mlx-vlm's generate takes them for this row (a model without
    a video token has its frames as images already: prompts.frames_as_images)."""
    messages = template_parts(job.messages) if media else text_only(job.messages)
    prompt = render(processor, messages, job.params, traits.markers)
    return prompt, list(media.images), list(media.videos)


def vlm_prompt_ids(model: Model, processor: Processor, job: Job, media: Media, traits: Traits) -> list[int]:
    """The row's prompt token ids as mlx-vlm's generate makes them (batchgen plan counts them)."""
    return _prompt_ids(model, processor, *_vlm_inputs(processor, job, media, traits))


def _prompt_ids(model: Model, processor: Processor, prompt: str, images: list, videos: list) -> list[int]:
    """The prompt's token ids as the model sees them (media slots expanded)."""
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    inputs = prepare_inputs(
        processor, images=images or None, videos=videos or None, prompts=prompt,
        image_token_index=getattr(model.config, "image_token_index", None),
        add_special_tokens=should_add_special_tokens(model.config.model_type, processor),
    )  # fmt: skip
    return inputs["input_ids"][0].tolist()


def _seeing_the_prompt(processors: list[Callable], prompt: list[int]) -> list[Callable]:
    """Logits processors for mlx-vlm's generate under batchgen's one rule: they see the prompt
    and then the generated tokens, as in mlx-lm and the batched lanes. mlx-vlm hands them its
    own history (the last prompt token, or the whole prompt unchunked, then each generated
    token): only its generated tail, as many tokens as calls so far, is taken from it."""
    head = mx.array(prompt[-HISTORY:])
    calls = [0]

    def wrap(proc: Callable) -> Callable:
        def seeing(tokens: mx.array, logits: mx.array) -> mx.array:
            n = calls[0]
            history = mx.concatenate([head, tokens[tokens.size - n :].astype(head.dtype)]) if n else head
            return proc(history, logits)

        return seeing

    wrapped = [wrap(proc) for proc in processors]

    def count(tokens: mx.array, logits: mx.array) -> mx.array:
        calls[0] += 1
        return logits

    return [*wrapped, count]


def generate_vlm(
    model: Model, processor: Processor, job: Job, media: Media, drafter: Drafter | None = None,
    watch: Watch | None = None, kv: KVQuant | None = None, traits: Traits | None = None,
) -> Generation:  # fmt: skip
    """mlx-vlm's own generate for one row (`traits`: the model's, as it loaded; read off the
    processor when not given); with an mlx-vlm drafter, its counts come from the drafter's
    lifetime counters, read before and after; its quantized KV cache with `kv`."""
    from mlx_vlm import stream_generate

    traits = traits if traits is not None else Traits.of(processor)
    prompt, images, videos = _vlm_inputs(processor, job, media, traits)
    tokenizer = traits.tokenizer
    # Only a thinking model's first steps read the prompt's tokens (and the processors, below).
    ids = _prompt_ids(model, processor, prompt, images, videos) if traits.markers is not None else []
    part, p = traits.opening(job.params, ids)
    tokenizer.stopping_criteria.reset(model.config.eos_token_id)
    if p.seed is not None:
        mx.random.seed(p.seed)
    eos = set(tokenizer.stopping_criteria.eos_token_ids)
    own = logits_processors_for(p, traits, eos, part)
    processors = []
    if own:
        processors = _seeing_the_prompt(own, ids or _prompt_ids(model, processor, prompt, images, videos))
    draft: dict[str, Any] = {}
    if drafter is not None:
        from mlx_vlm.speculative.common import speculative_stats_since, speculative_stats_snapshot

        draft = {"draft_model": drafter.model, "draft_kind": drafter.kind}
        if drafter.block_size is not None:
            draft["draft_block_size"] = drafter.block_size
        snapshot = speculative_stats_snapshot(drafter.model)
    stream = stream_generate(
        model,
        processor,
        prompt,
        image=images or None,
        video=videos or None,
        audio=list(media.audio) or None,
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        logits_processors=processors or None,
        sampler=sampler_for(p) if p.seed is not None else None,  # a seeded row's keyed draws; else mlx-vlm's
        seed=p.seed,
        **draft,
        **(kv.engine_kwargs() if kv else {}),
    )
    gen = collect(stream, p, traits, eos, watch, part, own)
    if drafter is not None:
        stream.close()  # a stop string ends the stream early: let it settle its counters
        _, accepted, drafted = speculative_stats_since(drafter.model, snapshot)
        gen.mtp_accepted, gen.mtp_drafts = accepted or 0, drafted or 0
    return gen
