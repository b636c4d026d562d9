"""The router: every row onto its lane (lanes/), over the models load/loading loads.

Rows are first planned (routed, tokenized), then run in batches of one lane; generator.py
drives it a window at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Iterator

from ..core.budget import budget_spec
from ..core.errors import BatchgenError, RowError
from ..core.families import BIDIRECTIONAL, Family, family
from ..core.params import GenParams
from ..core.records import Generation, Job, Media
from ..core.settings import GenerationSettings
from .base.arrays import Model
from .base.aside import PlanAtHome
from .base.models import inspect_model
from .base.watch import Watch
from .chat.prompts import frames_as_images
from .decode.adapters import LMAdapter, Sequence, VLMAdapter
from .decode.batch_cache import KVQuant
from .decode.memory import Memory
from .decode.prefix_cache import PrefixCache
from .lanes.batched import Lane, Plan, TextLane, row_error
from .lanes.single import LMSingleLane, SingleLane
from .lanes.speculative import SpeculativeLane, VisionSpeculativeLane
from .lanes.vision import OffsetVisionLane, VisionLane
from .load.drafts import Drafter, inspect_drafter
from .load.fine_tunes import AdapterSet
from .load.loading import Models

__all__ = ["Plan", "Router"]


class Router:
    """The run's models, lanes and prefix cache: plans each row (one routing function) and
    runs batches of plans of one lane. A set `stop` ends a batch between decode steps."""

    def __init__(
        self,
        model: str,
        text_model: str | None = None,
        prefix_cache: PrefixCache | None = None,
        drafter: Drafter | None = None,
        row_timeout: float | None = None,
        lazy: bool = False,
        memory_budget: str | None = None,
        kv: KVQuant | None = None,
        stop: threading.Event | None = None,
        adapters: AdapterSet | None = None,
        named_models: tuple[str, ...] = (),
    ):
        self.vision_info = inspect_model(model)
        self.text_info = inspect_model(text_model) if text_model else self.vision_info
        if kv is not None:  # a group size the heads cannot take stops the run here
            for info in (self.vision_info, self.text_info):
                kv.check(info.name, info.head_dim)
        self.kv = kv
        self.prefixes = prefix_cache
        self.models = Models(self.vision_info, self.text_info, drafter, lazy, adapters or AdapterSet())
        self.named_models = named_models  # the names rows may give in `model` (--models)
        spec = budget_spec(memory_budget) if not lazy else None
        self.memory = Memory(spec, self.models, prefix_cache) if spec is not None else None
        self.text = TextLane(self.models, self.text_info, prefix_cache, self.memory)
        # --kv-bits text rows batch on caches quantized as mlx-lm quantizes them (the budget
        # measures a row on the quantized cache).
        self.text_kv = TextLane(self.models, self.text_info, None, self.memory, kv) if kv else None
        self.vision = VisionLane(self.models, self.vision_info, prefix_cache, self.memory)
        self.offset = OffsetVisionLane(self.models, self.vision_info, prefix_cache, self.memory)
        self.vision_kv = VisionLane(self.models, self.vision_info, None, self.memory, kv) if kv else None
        self.offset_kv = (
            OffsetVisionLane(self.models, self.vision_info, None, self.memory, kv) if kv else None
        )
        self.single = SingleLane(self.models, self.vision_info, kv=kv)
        self.draft = LMSingleLane(self.models, self.text_info, self.text, draft=True, kv=kv)
        self.speculative = SpeculativeLane(self.models, self.text_info)
        self.vision_speculative = VisionSpeculativeLane(self.models, self.vision_info, None, self.memory)
        # Rows whose cache is quantized while they decode run alone (unbudgeted).
        unbudgeted = TextLane(self.models, self.text_info)
        self.text_alone = LMSingleLane(self.models, self.text_info, unbudgeted, draft=False, kv=kv)
        self.row_timeout = row_timeout  # seconds a row may generate, counted from its batch's start
        self.stop = stop if stop is not None else threading.Event()  # checked between decode steps
        self.capped = 0  # rows whose max_tokens was lowered to fit the model's context
        self.one_at_a_time: dict[str, int] = {}  # rows that could not batch, by reason
        self._quantizable: set[str] = set()  # models whose caches --kv-bits was checked on

    @classmethod
    def from_settings(
        cls, config: GenerationSettings, stop: threading.Event | None = None, lazy: bool = False
    ) -> Router:
        """The router a run asks for: its models, a prefix cache unless --no-cache, its drafter;
        `lazy`: to plan rows only (no weights read, nothing generated)."""
        prefixes = PrefixCache(config.cache_entries, config.cache_bytes) if config.cache else None
        drafter = None
        if config.draft_model:
            drafter = inspect_drafter(
                config.draft_model, config.draft_kind, config.draft_block_size, config.num_draft_tokens
            )
        kv = None
        if config.kv_bits:
            kv = KVQuant(config.kv_bits, config.kv_group_size, config.quantized_kv_start)
        models, named = (config.model, config.text_model), tuple(name for name, _ in config.models)
        adapters, budget = AdapterSet.of(config), config.memory_budget
        return cls(*models, prefixes, drafter, config.row_timeout, lazy, budget, kv, stop, adapters, named)

    # -- loading ---------------------------------------------------------------
    def load(self, vision: bool, text: bool) -> None:
        """Load up front what the first rows need (so it overlaps their downloads)."""
        if text and not self._text_via_vlm() and self.models.lm() is None:
            vision = True
        if vision and (self.vision_info.multimodal or self.models.text_on_vlm) or self._text_via_vlm():
            self.models.vlm()
        self._measure()

    def _measure(self) -> None:
        """The loaded models' batched lanes measure a row's memory now, here: rows planned
        aside cannot (aside.py), and would all be handed back until one was planned here.
        (A --kv-bits lane measures on its first row, after the run checked its cache.)"""
        lanes: list[Lane] = [self.text] if self.models.lm_loaded else []
        if self.models.vlm_loaded:
            kind = family(self.models.vlm()[0].config.model_type).lane
            by_kind: dict[str, Lane] = {"mrope": self.vision, "offset": self.offset}
            lanes += [by_kind[kind]] if kind in by_kind else []
        for lane in lanes:
            lane.footprint()

    def load_drafter(self) -> None:
        self.models.load_drafter()

    def _text_via_vlm(self) -> bool:
        """A vision drafter serves text rows too when they share its target."""
        return self.models.drafter_lane == "vlm" and self.text_info is self.vision_info

    def model_for(self, job: Job) -> str:
        on_vlm = job.media or self.models.text_on_vlm or self._text_via_vlm()
        return self.vision_info.name if on_vlm else self.text_info.name

    # -- planning --------------------------------------------------------------
    def route(self, job: Job, media: Media) -> Lane:
        """The lane of a row: text rows on mlx-lm (speculative with a text drafter), media rows
        (and text rows mlx-lm cannot serve) batched on the vision lane where the family allows,
        else one at a time through mlx-vlm; with --kv-bits, the batched lanes' quantized forms
        (see `plan`)."""
        # A drafter's guesses would skip the mask, and mlx-vlm's drafters report no logprobs.
        # A reasoning budget forces tokens through a logits processor, which the drafters skip too.
        p = job.params
        constrained = (
            p.constraint is not None
            or p.wants_logprobs
            or job.scoring is not None
            or p.reasoning_budget is not None
        )
        if not media and not self._text_via_vlm() and self.models.lm() is not None:
            if self.models.drafter_lane == "lm" and not constrained:
                return self._drafting(p)
            return self.text_kv or self.text
        model = self.models.vlm()[0]
        fam = family(model.config.model_type)
        name = fam.model_type
        if media.audio:
            return self._alone("rows with audio")
        if fam.lane == "mrope" and media.images and media.videos and not fam.images_with_video:
            unseen = (
                "this row's video would go unseen beside its images (ask about them in rows of their own)"
            )
            raise RowError(
                "generate", f"{name}: mlx-vlm's {name} embeds one kind of media a prompt, so {unseen}"
            )
        if fam.first_image_only and len(media.images) > 1:
            unseen = "this row's other images (or its clip's other frames) would go unseen: one image a row"
            raise RowError(
                "generate", f"{name}: mlx-vlm merges the first image of a prompt only, so {unseen}"
            )
        if self.models.drafter_lane == "vlm" and not constrained:
            return self._vision_drafting(p, fam)
        if fam.lane == "mrope":
            return self._vision_kv(model, self.vision_kv) if self.kv else self.vision
        if fam.lane == "offset":
            if media.videos:
                return self._alone(f"{name}: video rows")
            if getattr(model.config.text_config, "use_bidirectional_attention", None) == "vision":
                return self._alone(f"{name}: {BIDIRECTIONAL}")
            return self._vision_kv(model, self.offset_kv) if self.kv else self.offset
        return self._alone(f"{name}: {fam.why_unbatched}")

    def _vision_kv(self, model: Model, lane: Lane | None) -> Lane:
        """A media row's quantized lane: batched where mlx-vlm's generate fills the prompt in
        chunks and quantizes after each (its uniform scheme), one at a time through it where
        the model sets its own prefill policy (then where it quantizes is the model's)."""
        assert self.kv is not None and lane is not None
        owners = (model, getattr(model, "language_model", model))
        if any(
            hasattr(m, "chunked_prefill_policy") or getattr(m, "no_chunked_prefill", False) for m in owners
        ):
            why = f"--kv-bits {self.kv.bits}: {model.config.model_type}'s own prefill policy"
            return self._alone(f"{why} (mlx-vlm's quantized generate)")
        return lane

    def _vision_drafting(self, p: GenParams, fam: Family) -> Lane:
        """A row with the run's mlx-vlm drafter: MTP rows of a family whose batched rounds
        give its target's own tokens batch in mlx-vlm's rounds; the rest run one at a time in its
        generate, each for the reason named."""
        drafter = self.models.drafter
        kind = drafter.kind if drafter is not None else None
        if kind != "mtp" or not fam.drafts_batch:
            why = f"{kind} drafter on {fam.model_type} (batched rounds checked for Qwen3.5's MTP head only)"
        elif _processed(p):
            why = "vision drafter rows with penalties or biases"
        elif self.kv is not None:
            why = f"vision drafter rows with --kv-bits {self.kv.bits}"
        else:
            return self.vision_speculative
        return self._alone(f"{why}: mlx-vlm's generate")

    def _drafting(self, p: GenParams) -> Lane:
        """A text drafter's row: rows speculate batched; a row that carries a logits processor
        (penalties, biases) or a quantized cache goes through mlx-lm's own speculative loop, one
        at a time (the processors see each draft block's history there, round by round)."""
        if not _processed(p) and self.kv is None:
            return self.speculative
        why = "--kv-bits" if self.kv is not None else "penalties or biases"
        return self._alone(f"text drafter rows with {why}: mlx-lm's speculative loop", self.draft)

    def _alone(self, reason: str, lane: Lane | None = None) -> Lane:
        """A one-row lane (mlx-vlm's by default), with the reason counted for the run summary."""
        self.one_at_a_time[reason] = self.one_at_a_time.get(reason, 0) + 1
        return lane or self.single

    def plan(self, job: Job, media: Media) -> Plan:
        """Route and tokenize the row; unsupported media raise a `generate` RowError, a model
        that cannot load stops the run (ConfigError), wherever its first row is."""
        if job.model is not None and job.model not in self.named_models:
            known = ", ".join(self.named_models) or "none given"
            raise RowError("read", f"model {job.model!r} is not one of --models ({known})")
        if media:
            self._check_supported(media)
        if media.videos and not self.vision_info.video:  # the frames go in as images, each with its slot
            job, media = frames_as_images(job, media)
        if self.kv is not None:
            self._check_quantizable(job)
        adapter = self._adapter_of(job)
        counted = dict(self.one_at_a_time)
        try:
            plan = self.route(job, media).plan(job, media)
        except PlanAtHome:  # routed aside, planned again at home: counted there
            self.one_at_a_time = counted
            raise
        except (RowError, BatchgenError):
            raise
        except Exception as e:  # a template or processor that rejects this row
            raise row_error(e) from e
        plan.adapter = adapter
        if adapter is not None and plan.seq is not None:  # a prefix's keys and values are the adapter's
            plan.seq.boundaries = [(n, _salted(key, adapter)) for n, key in plan.seq.boundaries]
        if self.kv is not None and plan.seq is not None:
            quantized = {
                self.text_kv: (self.text, self.text_alone),
                self.vision_kv: (self.vision, self.single),
                self.offset_kv: (self.offset, self.single),
            }
            if plan.lane in quantized:
                plan.lane = self._quantized(plan.seq, plan.lane, *quantized[plan.lane])
        return plan

    def _adapter_of(self, job: Job) -> str | None:
        """The folder of the adapter the row runs with (AdapterSet.folder_of)."""
        folder, by_folder = self.models.adapters.folder_of(job.adapter)
        if by_folder and self.text_info.multimodal and self.model_for(job) != self.vision_info.name:
            # Its text rows run on mlx-lm, whose model does not carry mlx-vlm's adapters.
            why = (
                "give it in --adapters, which runs the model's text rows on mlx-vlm, where its adapters apply"
            )
            raise RowError("read", f"adapter {job.adapter!r} on a text row of a vision-language model: {why}")
        return folder

    def _quantized(self, seq: Sequence, lane: Lane, full: Lane, alone: Lane) -> Lane:
        """A --kv-bits row's lane, by where the engine's generate would quantize its cache: its
        quantized batched lane, the `full`-precision one if never before its last token, or
        one at a time through the engine (`alone`) if while it decodes."""
        kv = self.kv
        assert kv is not None
        fate = kv.fate(len(seq.ids), seq.params.max_tokens)
        if fate == "full":
            return full
        if fate == "crosses":
            why = f"--kv-bits {kv.bits}: rows whose cache is quantized while they decode"
            return self._alone(f"{why} (--quantized-kv-start {kv.start})", alone)
        return lane

    def _check_quantizable(self, job: Job) -> None:
        """--kv-bits on a model whose cache cannot be quantized stops the run (once per model)."""
        assert self.kv is not None
        name = self.model_for(job)
        if name in self._quantizable:
            return
        if name == self.vision_info.name and (job.media or self.models.lm() is None or self._text_via_vlm()):
            cache = VLMAdapter(self.models.vlm()[0]).make_cache()
        else:
            cache = LMAdapter(self.models.text()[0]).make_cache()
        self.kv.check_cache(name, cache)
        self._quantizable.add(name)

    @property
    def adapter_switches(self) -> int:
        """Times the model's adapter changed between runs of rows."""
        return self.models.switches

    @property
    def applied(self) -> str | None:
        """The adapter the model carries now (its folder; None: none)."""
        return self.models.applied

    @property
    def model_loads(self) -> int:
        return self.models.loads

    def restart(self, stop: threading.Event) -> None:
        """The router kept for another run (`Resident`): its models, prefix snapshots and what
        the memory budget learned stay; the run's stop request and its counts start over."""
        self.stop, self.capped, self.one_at_a_time = stop, 0, {}
        self.models.switches = self.models.loads = 0
        if self.prefixes is not None:
            self.prefixes.recount()
        if self.memory is not None:
            self.memory.stats = dataclasses.replace(
                self.memory.stats, out_of_memory=0, retried=0, too_big=0, widths={}
            )

    def release(self) -> None:
        """Let go of the models and the prefix snapshots (the next model of a run of several
        loads into the memory they held)."""
        if self.prefixes is not None:
            self.prefixes.shrink(0)
        self.models.release()

    def prompt_tokens(self, plan: Plan) -> int:
        """The prompt's tokens as the row's generation will count them (media slots expanded)."""
        return plan.lane.prompt_tokens(plan)

    # -- generation ------------------------------------------------------------
    def run(self, plans: list[Plan], width: int) -> Iterator[tuple[int, Generation | RowError]]:
        """Plans of one lane, at most `width` decoding at once; each row's Generation or RowError
        as it finishes. A row past --row-timeout is a `generate` error; a stop request raises
        StopRequested."""
        lane = plans[0].lane
        try:
            self.models.use(plans[0].adapter)  # one adapter a run (schedule.py)
        except RowError as e:
            yield from ((i, e) for i in range(len(plans)))
            return
        for i, outcome in lane.run(plans, Watch(self.stop, self.row_timeout, lane.info.context), width):
            if isinstance(outcome, Generation):
                self.capped += outcome.capped
                if outcome.finish_reason == "timeout":
                    outcome = RowError(
                        "generate",
                        f"no answer within --row-timeout {self.row_timeout:g} s "
                        f"({outcome.completion_tokens} tokens generated)",
                    )
            yield i, outcome

    def _check_supported(self, media: Media) -> None:
        info = self.vision_info
        if not info.multimodal:
            raise RowError(
                "generate", f"model {info.name!r} is text-only (no vision or audio tower in its config)"
            )
        if media.audio and not info.audio:
            raise RowError("generate", f"model {info.name!r} has no audio encoder; the row has audio")
        if (media.images or media.videos) and not info.vision:
            raise RowError(
                "generate", f"model {info.name!r} has no vision tower; the row has images or video"
            )


def _processed(p: GenParams) -> bool:
    """Whether a row's logits pass through processors (penalties, biases), which a drafter's
    batched rounds skip."""
    return bool(p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)


def _salted(key: str, adapter: str) -> str:
    """A prefix's cache key under an adapter (its folder): never another adapter's snapshot."""
    return hashlib.sha256(f"{key}:{adapter}".encode()).hexdigest()
