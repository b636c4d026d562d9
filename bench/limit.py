"""The unique-work limit of two jobs, against batchgen's time on the same job in one process:

- captioning (bench/captioning.py's job: 16 images x 4 questions, a shared ~800-token system
  prompt, max_tokens 32): the system prompt prefilled once; per image, the processor and the
  vision tower once and the image's tokens prefilled once from the system prompt's cache;
  each question's tail prefilled from a copy of its image's cache; mRoPE positions computed
  once per prompt layout;
- mixed text (bench/text.py mixed's job: 256 prompts of 10-130 tokens, max_tokens 8-256):
  each prompt prefilled once.

Then every row decodes at full batch width (batchgen's width, 32): the rows ordered by their
output length, longest first (known in advance: the limit is an oracle), a finished row's
slot refilled at once, in place, with no other row's cache copied. Everything runs on the
models' own calls (vision tower, embeddings, language model, mlx-lm/mlx-vlm KV caches), greedy,
and the limit's tokens are checked against batchgen's output.

With --no-plan-aside, batchgen plans every window's rows between windows (as before the
planning thread).

    python bench/limit.py [--fast-blas] [--no-plan-aside] [captioning] [mixed-text]  # last: batchgen / limit
"""

from __future__ import annotations

import copy
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blas import fast_blas  # noqa: E402  (bench/blas.py: --fast-blas)
from captioning import MAX_TOKENS, QUESTION_TEXT, SYSTEM, prompt_for, workload  # noqa: E402  (bench/ is first on the path)

import batchgen  # noqa: E402
from batchgen.tools.tiny.parts import WORDS  # noqa: E402

WIDTH = 32  # batchgen's default batch_size
REPEATS = 3
TEXT_MODEL = ROOT / "sample_data" / "models" / "tiny-lm"


@dataclass
class Row:
    """One row inside the limit: its cache after the prompt, and the tokens it must produce."""

    cache: list[Any]
    first: int  # the token the prompt's last logits give
    length: int  # tokens to generate (batchgen's completion_tokens)
    start: int = 0  # position of the first generated token (mRoPE rows)
    tokens: list[int] = field(default_factory=list)


@dataclass
class Parts:
    """The limit's time by part, in seconds."""

    parts: dict[str, float] = field(default_factory=dict)
    steps: int = 0

    def add(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - since
        return now

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def line(self) -> str:
        inner = ", ".join(f"{k} {v:.2f} s" for k, v in self.parts.items())
        return f"limit {self.total:.2f} s ({inner}; {self.steps} decode steps)"


def decode(rows: list[Row], step: Any, parts: Parts) -> None:
    """Every row's tokens at full batch width: `WIDTH` slots, the longest rows first; when a
    row ends, the next row's prompt cache is written into its slot in place (right-aligned with
    the others, as a left-padded batch cache wants), so no slot idles while rows wait and no
    other row's cache is copied. Columns no running row attends to are cut off (a view)."""
    import mlx.core as mx

    t = time.perf_counter()
    waiting = sorted(rows, key=lambda r: r.length)  # popped from the end: longest first
    slots: list[Row | None] = []
    cache: list[Any] = []
    while waiting or any(slots):
        changed = False
        while waiting and (None in slots or len(slots) < WIDTH):
            changed = True
            r = waiting.pop()
            r.tokens = [r.first]
            if r.length <= 1:
                continue
            if not cache:
                cache = [type(layer).merge([layer]) for layer in r.cache]
                slots = [r]
            elif None in slots:
                s = slots.index(None)
                slots[s] = r
                for layer, own in zip(cache, r.cache, strict=True):
                    _write(layer, s, own)
            else:
                slots.append(r)
                for layer, own in zip(cache, r.cache, strict=True):
                    layer.extend(type(layer).merge([own]))
        live = [s for s, r in enumerate(slots) if r is not None]
        for layer in cache if changed else []:
            cut = min(min(layer.left_padding[mx.array(live)].tolist()), layer._idx)
            if cut > 0:
                layer.keys, layer.values = layer.keys[..., cut:, :], layer.values[..., cut:, :]
                layer._idx -= cut
                layer.left_padding = layer.left_padding - cut
        logits = step(mx.array([r.tokens[-1] if r else 0 for r in slots]), cache, slots)
        picked = mx.argmax(logits, axis=-1).tolist()
        parts.steps += 1
        for s in live:
            r = slots[s]
            r.tokens.append(picked[s])
            if len(r.tokens) >= r.length:
                slots[s] = None
        if not waiting and None in slots:  # the tail: drop idle slots
            keep = [s for s, r in enumerate(slots) if r is not None]
            if keep:
                for layer in cache:
                    layer.filter(keep)
            slots = [slots[s] for s in keep]
            cache = cache if keep else []
    parts.add("decode", t)


def _write(layer: Any, slot: int, own: Any) -> None:
    """A row's own KV cache written into one slot of a left-padded batch cache."""
    import mlx.core as mx

    n = own.offset
    if n > layer._idx:  # a longer row: room on the left for it
        pad = [(0, 0), (0, 0), (n - layer._idx, 0), (0, 0)]
        layer.keys, layer.values = mx.pad(layer.keys, pad), mx.pad(layer.values, pad)
        layer.left_padding = layer.left_padding + n - layer._idx
        layer._idx = n
    layer.keys[slot : slot + 1, :, layer._idx - n : layer._idx, :] = own.keys[..., :n, :]
    layer.values[slot : slot + 1, :, layer._idx - n : layer._idx, :] = own.values[..., :n, :]
    layer.left_padding[slot] = layer._idx - n
    layer.offset[slot] = n


@dataclass
class Unavoidable:
    """The job's I/O that no run can skip and the limit leaves out: loading the model from disk,
    reading and decoding its pictures, writing the results (measured on their own)."""

    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def line(self) -> str:
        return ", ".join(f"{k} {v:.2f} s" for k, v in self.parts.items())


def timed(call: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = call()
    return out, time.perf_counter() - t0


def run_batchgen(job: Path, model: Path, **kwargs: Any) -> tuple[float, Any, float, float]:
    """batchgen on the job, into a new output (a rerun into one file would only resume it):
    its wall time, its rows in job order, the lanes' share (the rows' generate_ms, which add up
    to the time the lanes ran) and the time writing the output takes on its own."""
    import pyarrow.parquet as pq

    out = job.with_name(f"{job.stem}-{len(list(job.parent.glob(job.stem + '-*.parquet')))}.parquet")
    config = batchgen.build_config(job, out, None, {"temperature": 0.0, **kwargs.pop("defaults", {})},
                                   model=str(model), quiet=True, plan_aside=PLAN_ASIDE, **kwargs)  # fmt: skip
    t0 = time.perf_counter()
    batchgen.run(config)
    took = time.perf_counter() - t0
    table = pq.read_table(out)
    _, write_s = timed(lambda: pq.write_table(table, out.with_suffix(".rewrite.parquet")))
    lanes = sum(table.column("generate_ms").to_pylist()) / 1000
    found = {r["id"]: r for r in table.select(["id", "generated_text", "completion_tokens"]).to_pylist()}
    return took, [found[r["id"]] for r in map(json.loads, job.read_text().splitlines())], lanes, write_s


def captioning(folder: Path) -> tuple[Any, Any]:
    """The captioning job's batchgen run and its limit, each a call."""
    import mlx.core as mx
    import mlx_vlm
    from mlx_vlm.models.cache import make_prompt_cache
    from mlx_vlm.utils import prepare_inputs
    from PIL import Image

    model_dir, paths = workload(folder)
    rows = [{"id": f"{i}-{k}", "image": str(p), "system": SYSTEM, "prompt": q}
            for i, p in enumerate(paths) for k, q in enumerate(QUESTION_TEXT)]  # fmt: skip
    job = folder / "captions.jsonl"
    job.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (model, processor), load_s = timed(lambda: mlx_vlm.load(str(model_dir)))
    images, decode_s = timed(lambda: [Image.open(p).convert("RGB") for p in paths])
    io = Unavoidable({"model load": load_s, "picture decode": decode_s})
    mlx_vlm.generate(model, processor, prompt_for("warm up"), image=[images[0]], max_tokens=2)  # untimed
    lm, config, tokenizer = model.language_model, model.config, processor.tokenizer
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}

    def inputs_for(image, question):
        return prepare_inputs(processor, images=[image], prompts=prompt_for(question),
                              image_token_index=getattr(config, "image_token_index", None))  # fmt: skip

    probe = inputs_for(images[0], QUESTION_TEXT[0])
    ids0 = probe["input_ids"][0].tolist()
    start = ids0.index(config.vision_start_token_id)
    end = ids0.index(tokenizer.convert_tokens_to_ids("<|vision_end|>")) + 1
    tails = {q: tokenizer.encode(prompt_for(q).split("<|vision_end|>", 1)[1], add_special_tokens=False)
             for q in QUESTION_TEXT}  # fmt: skip
    for q, tail in tails.items():  # the prompts batchgen saw, image and question tokens alike
        assert ids0[:end] + tail == inputs_for(images[0], q)["input_ids"][0].tolist()

    def step(tokens, cache, slots):
        pos = [r.start + len(r.tokens) - 1 if r else 0 for r in slots]
        positions = mx.broadcast_to(mx.array(pos, dtype=mx.int32).reshape(1, -1, 1), (3, len(slots), 1))
        return lm(tokens[:, None], cache=cache, position_ids=positions).logits[:, -1]

    def batchgen_run() -> tuple[float, list[dict], float, float]:
        return run_batchgen(job, model_dir, batch_size=WIDTH,
                            defaults={"max_tokens": MAX_TOKENS})  # fmt: skip

    def limit(out: list[dict]) -> tuple[Parts, list[str]]:
        parts = Parts()
        t = time.perf_counter()
        layouts = {}  # positions per prompt layout: the images are alike, the tails differ in length
        for q, tail in tails.items():
            ids = mx.array([ids0[:end] + tail])
            layouts[q] = lm.get_rope_index(ids, probe["image_grid_thw"], None, mx.ones(ids.shape))
        system = make_prompt_cache(lm)
        positions = layouts[QUESTION_TEXT[0]][0]
        lm(mx.array([ids0[:start]]), cache=system, position_ids=positions[:, :, :start])
        mx.eval([c.state for c in system])
        t = parts.add("system prompt", t)
        todo: list[Row] = []
        for image in images:
            inputs = inputs_for(image, QUESTION_TEXT[0])
            t = parts.add("processor", t)
            embeds = model.get_input_embeddings(inputs["input_ids"], pixel_values=inputs["pixel_values"],
                                                image_grid_thw=inputs["image_grid_thw"],
                                                mask=inputs["attention_mask"]).inputs_embeds  # fmt: skip
            mx.eval(embeds)
            t = parts.add("vision", t)
            cache = copy.deepcopy(system)
            lm(mx.array([ids0[start:end]]), inputs_embeds=embeds[:, start:end], cache=cache,
               position_ids=positions[:, :, start:end])  # fmt: skip
            mx.eval([c.state for c in cache])
            t = parts.add("image prefill", t)
            for q, tail in tails.items():
                row_cache = copy.deepcopy(cache)
                pos, delta = layouts[q]
                logits = lm(mx.array([tail]), cache=row_cache, position_ids=pos[:, :, end:]).logits[:, -1]
                first = mx.argmax(logits, axis=-1).item()
                todo.append(Row(row_cache, first, 0, end + len(tail) + int(delta.reshape(-1)[0].item())))
            t = parts.add("question tails", t)
        for r, done in zip(todo, out, strict=True):
            r.length = done["completion_tokens"]
        decode(todo, step, parts)
        return parts, [tokenizer.decode([t for t in r.tokens if t not in eos]) for r in todo]

    return batchgen_run, limit, io


def mixed_text(folder: Path) -> tuple[Any, Any]:
    """The mixed text job's batchgen run and its limit, each a call."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    rng = random.Random(1)  # bench/text.py mixed's rows
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120))) for _ in range(256)]
    budgets = [rng.randint(8, 256) for _ in range(256)]
    job = folder / "text.jsonl"
    job.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": m}) + "\n"
                           for i, (p, m) in enumerate(zip(prompts, budgets, strict=True))))  # fmt: skip
    (model, tokenizer), load_s = timed(lambda: mlx_lm.load(str(TEXT_MODEL)))
    io = Unavoidable({"model load": load_s})
    eos = set(tokenizer.eos_token_ids) | {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                          add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False) for p in prompts]  # fmt: skip
    mlx_lm.generate(model, tokenizer, ids[0], max_tokens=2)  # untimed warm-up
    head = model.model.embed_tokens.as_linear if model.args.tie_word_embeddings else model.lm_head

    def batchgen_run() -> tuple[float, list[dict], float, float]:
        return run_batchgen(job, TEXT_MODEL, batch_size=WIDTH)

    def limit(out: list[dict]) -> tuple[Parts, list[str]]:
        parts = Parts()
        t = time.perf_counter()
        todo = []
        for prompt, done in zip(ids, out, strict=True):
            cache = make_prompt_cache(model)
            hidden = model.model(mx.array([prompt]), cache=cache)[:, -1]  # one pass, logits of the last only
            todo.append(Row(cache, mx.argmax(head(hidden), axis=-1).item(), done["completion_tokens"]))
        parts.add("prefill", t)
        decode(todo, lambda tokens, cache, live: model(tokens[:, None], cache=cache)[:, -1], parts)
        return parts, [tokenizer.decode([t for t in r.tokens if t not in eos]) for r in todo]

    return batchgen_run, limit, io


def compare(name: str, batchgen_run: Any, limit: Any, io: Unavoidable) -> str:
    """batchgen and the limit, alternately REPEATS times (the machine's noise is ±10%): the
    best time of each, side by side, and whether every row's tokens agree; then the whole run
    against the limit plus the job's unavoidable I/O, beside the lanes' share of the run."""
    runs, limits, same, lanes, writes = [], [], True, [], []
    for _ in range(REPEATS):
        took, out, lane_s, write_s = batchgen_run()
        parts, texts = limit(out)
        runs.append(took)
        lanes.append(lane_s)
        writes.append(write_s)
        limits.append(parts)
        same = same and texts == [o["generated_text"] for o in out]
    best = min(limits, key=lambda p: p.total)
    k = runs.index(min(runs))
    io.parts["results write"] = min(writes)
    floor = best.total + io.total
    print(f"{name}: {len(out)} rows; best {best.line()}")
    print(f"{name}: batchgen best {min(runs):.2f} s of {_listed(runs)} (model loading, reading and writing "
          f"included); limits {_listed([p.total for p in limits])}; identical tokens: {same}")  # fmt: skip
    print(f"{name}: unavoidable I/O {io.total:.2f} s ({io.line()}); the best run's lanes {lanes[k]:.2f} s "
          f"({lanes[k] / best.total:.2f}x the limit), around them {runs[k] - lanes[k]:.2f} s")  # fmt: skip
    return (f"{name}: batchgen / limit {min(runs) / best.total:.2f}; whole run / (limit + unavoidable I/O) "
            f"{min(runs) / floor:.2f}")  # fmt: skip


def _listed(seconds: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in seconds)


JOBS = {"captioning": captioning, "mixed text": mixed_text}
PLAN_ASIDE = "--no-plan-aside" not in sys.argv


def main(names: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ratios = [compare(name, *JOBS[name](Path(tmp))) for name in names or JOBS]
    print("\n".join(ratios))


if __name__ == "__main__":
    fast_blas()
    main([" ".join(a.split("-")) for a in sys.argv[1:] if a != "--no-plan-aside"])
