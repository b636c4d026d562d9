"""A curation job of three stages (caption → yes/no score of the caption → tags) on 120 distinct
448x448 pictures, two ways in one process, outputs compared by id:

  (a) chained by hand: three `batchgen.run`s, each later job made from the earlier outputs
      (each run loads the model and prefills every picture again);
  (b) staged: one `batchgen.run` of a job with `stages:` (the model loaded once, the decoded
      pictures and the prefix cache kept from stage to stage).

    python bench/stages.py [--fast-blas] [--pictures 120]   # last line: staged X× the chained runs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blas import fast_blas  # noqa: E402  (bench/blas.py: --fast-blas)
from captioning import workload  # noqa: E402

import batchgen  # noqa: E402

CAPTION = "Describe the picture in one sentence."
SCORE = 'Does this figure show "{caption.generated_text}"? Please answer yes or no.'
TAGS = "Three tags for this picture, whose caption is: {caption.generated_text}"
STAGES = [
    {"name": "caption", "prompt_template": CAPTION, "generation": {"max_tokens": 24}},
    {
        "name": "score",
        "prompt_template": SCORE,
        "generation": {"choices_to_score": ["Yes", "No"], "score_only": True},
    },
    {"name": "tags", "prompt_template": TAGS, "generation": {"max_tokens": 12}},
]


def _run(job: Path, out: Path, model: Path, stage: dict | None = None, **more) -> tuple[float, list[dict]]:
    generation = {"temperature": 0.0, **((stage or {}).get("generation") or {})}
    template = (stage or {}).get("prompt_template")
    config = batchgen.build_config(
        job,
        out,
        None,
        generation,
        model=str(model),
        quiet=True,
        overwrite=True,
        prompt_template=template,
        **more,
    )
    t0 = time.perf_counter()
    batchgen.run(config)
    return time.perf_counter() - t0, pq.read_table(out).to_pylist()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pictures", type=int, default=120)
    args, _ = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model, paths = workload(folder, args.pictures)
        job = _jsonl(folder / "jobs.jsonl", [{"id": f"p{i}", "image": str(p)} for i, p in enumerate(paths)])
        print(f"{len(paths)} pictures, stages caption (24 tokens) → score (Yes/No) → tags (12 tokens)")

        t_chained = 0.0
        made: dict[str, dict[str, dict]] = {}
        rows = [{"id": f"p{i}", "image": str(p)} for i, p in enumerate(paths)]
        for stage in STAGES:
            name = stage["name"]
            seconds, out = _run(
                _jsonl(folder / f"{name}.jsonl", rows), folder / f"{name}.parquet", model, stage
            )
            t_chained += seconds
            made[name] = {r["id"]: r for r in out}
            print(f"  chained, {name:<8} {seconds:6.2f} s")
            rows = [{**r, f"{name}.generated_text": made[name][r["id"]]["generated_text"]} for r in rows]
        print(f"chained by hand (3 runs): {t_chained:6.2f} s")

        t_staged, staged = _run(job, folder / "staged.parquet", model, stages=STAGES)
        print(f"staged (1 run):           {t_staged:6.2f} s")
        by_id = {r["id"]: r for r in staged}
        same = all(
            by_id[i]["caption.generated_text"] == made["caption"][i]["generated_text"]
            and by_id[i]["tags.generated_text"] == made["tags"][i]["generated_text"]
            and [c["choice"] for c in by_id[i]["score.choice_scores"]]
            == [c["choice"] for c in made["score"][i]["choice_scores"]]
            for i in by_id
        )
        cached = (
            sum(r["score.cached_tokens"] for r in staged),
            sum(r["cached_tokens"] for r in made["score"].values()),
        )
        print(f"the same captions, scores' choices and tags by id: {same}")
        print(f"stage 2's cached prompt tokens: staged {cached[0]:,}, chained {cached[1]:,}")
        decodes = [
            json.loads(Path(f"{out}.stats.json").read_text())["media"]["image_decodes"]
            for out in [folder / "staged.parquet", *(folder / f"{s['name']}.parquet" for s in STAGES)]
        ]
        print(f"pictures decoded: staged {decodes[0]:,}, chained {sum(decodes[1:]):,}")
        print(f"staged {t_chained / t_staged:.2f}× the chained runs")


if __name__ == "__main__":
    fast_blas()
    main()
