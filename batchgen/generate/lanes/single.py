"""The one-row lanes: rows through mlx-vlm's or mlx-lm's own generate where no batched lane can."""

from __future__ import annotations

from collections.abc import Iterator

from ...core.errors import BatchgenError, RowError
from ...core.records import Generation, Job, Media
from ..base.models import ModelInfo
from ..base.watch import Watch
from ..decode.batch_cache import KVQuant
from ..load.loading import Models
from .batched import Lane, Plan, TextLane, row_error, seq_of
from .one_row import generate_lm, generate_vlm, vlm_prompt_ids

__all__ = ["SingleLane", "LMSingleLane"]


class _OneByOne(Lane):
    """Rows through an engine's own generate, one at a time, with the run's quantized KV cache
    if it asks for one."""

    solo = True

    def run(self, plans: list[Plan], watch: Watch, width: int) -> Iterator[tuple[int, Generation | RowError]]:
        for i, plan in enumerate(plans):
            yield i, self._guarded(plan, watch)

    def _guarded(self, plan: Plan, watch: Watch) -> Generation | RowError:
        if plan.job.scoring is not None and (plan.job.scoring.asked or plan.job.params.score_only):
            why = f"--kv-bits {self.kv.bits}" if self.kv else self.name
            return RowError("generate", f"scores need a batched lane; this row runs one at a time ({why})")
        try:
            return self._generate(plan, watch)
        except RowError as e:
            return e
        except BatchgenError:  # a model or drafter that cannot load stops the run
            raise
        except Exception as e:
            return row_error(e)

    def _generate(self, plan: Plan, watch: Watch) -> Generation:
        raise NotImplementedError


class SingleLane(_OneByOne):
    """mlx-vlm's own generate, with the run's vision drafter if it has one."""

    name = "single"

    def plan(self, job: Job, media: Media) -> Plan:
        return Plan(job, media, self)

    def prompt_tokens(self, plan: Plan) -> int:
        model, processor = self.models.vlm()
        return len(vlm_prompt_ids(model, processor, plan.job, plan.media, self.models.traits(vision=True)))

    def _generate(self, plan: Plan, watch: Watch) -> Generation:
        model, processor = self.models.vlm()
        p = plan.job.params
        vision_drafter = self.models.drafter_lane == "vlm" and p.constraint is None and not p.wants_logprobs
        drafter = self.models.drafter if vision_drafter else None
        if drafter is not None:
            self.models.load_drafter()
        traits = self.models.traits(vision=True)
        return generate_vlm(model, processor, plan.job, plan.media, drafter, watch, self.kv, traits)


class LMSingleLane(_OneByOne):
    """mlx-lm's own generate: its speculative loop with the run's text draft model (`draft`),
    and its quantized KV cache (`kv`). Rows are tokenized and fitted as the text lane does."""

    def __init__(
        self, models: Models, info: ModelInfo, text: TextLane, draft: bool, kv: KVQuant | None = None
    ):
        super().__init__(models, info, kv=kv)
        self.text, self.drafts = text, draft
        self.name = "draft" if draft else "lm-single"

    def plan(self, job: Job, media: Media) -> Plan:
        return Plan(job, media, self, self.text.plan(job, media).seq)  # tokenized once

    def _generate(self, plan: Plan, watch: Watch) -> Generation:
        model, _ = self.models.text()
        seq = seq_of(plan)
        drafter = self.models.drafter if self.drafts else None
        traits = self.models.traits(vision=False)
        gen = generate_lm(model, traits, seq.ids, seq.params, watch, seq.part, drafter, self.kv)
        gen.capped = gen.capped or seq.capped
        return gen
