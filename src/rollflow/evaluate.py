"""Sample completions for a set of prompts and score them with the run's reward.

This is the smallest end-to-end path through rollflow (sampler -> engine -> rollout -> scorer)
and the yardstick for training: accuracy on held-out prompts before and after. Scoring goes
through a `Scorer` like training's, so a checker that raises, hangs or returns garbage makes
its sample unscorable (counted, and not correct) instead of ending the evaluation. When the run's
samples are episodes (`[env]`), each held-out prompt is played as an episode of the run's source
(`HeldOutEpisodes`) and scored as training scores it: by the environment, plus the run's reward
functions. It trains nothing and keeps no state between calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from rollflow.config import CONTEXT_CAP, Config
from rollflow.engine import Engine
from rollflow.errors import ConfigError, RequestRefused, UnusablePrompt, UserInputError
from rollflow.records import Prompt, Sample, SamplingSpec
from rollflow.rollout import rollout, unusable
from rollflow.sampler import sampling_spec
from rollflow.scoring import Scored, Scorer, eval_scorer
from rollflow.tasks import parse_task

if TYPE_CHECKING:
    from rollflow.data_files import Row
    from rollflow.episodes import EpisodeContext, EpisodeSource

log = logging.getLogger(__name__)


class EvalReport(msgspec.Struct, frozen=True, kw_only=True):
    """Outcome of `evaluate`: per-sample rewards and throughput."""

    prompts: int
    samples: int
    accuracy: float
    """Mean verifier reward over all samples."""
    pass_at_group: float
    """Fraction of prompts with at least one correct sample."""
    tokens: int
    wall_s: float
    examples: list[tuple[str, str, float]]
    """(question, completion text, reward) for the first few samples."""
    unscorable: int = 0
    """Samples the reward could not score (counted as not correct), with `reasons` for them."""
    reasons: dict[str, int] = {}
    dropped: dict[str, int] = {}
    """Prompts not evaluated, by reason (too long for the context, refused by the engine), as
    training drops them; `prompts` counts those evaluated."""
    versions: list[int] = []
    """The policy versions whose weights generated the evaluated tokens (one, unless the engine's
    weights changed during the evaluation)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class HeldOutEpisodes:
    """How held-out prompts are played when the run's samples are episodes: as episodes of
    `source` (in `context`, its sampling replaced by the evaluation's), and from which prompts."""

    source: EpisodeSource
    context: EpisodeContext
    rows: list[Row] | None = None
    """The source's held-out rows (its last `run.eval_prompts`, never trained), or None: the source
    brings no prompts, so they are `data.task`'s held-out prompts."""

    async def play(self, engine: Engine, prompt: Prompt, spec: SamplingSpec, group_id: str, index: int) -> Sample:
        """One held-out episode; every model turn is generated on `engine` with `spec`."""

        async def turn(token_ids: list[int], turn_spec: SamplingSpec, n: int) -> Sample:
            return await rollout(engine, Prompt(id=prompt.id, token_ids=token_ids), turn_spec,
                                 group_id=f"{group_id}/t{n}", index=index)  # fmt: skip

        context = dataclasses.replace(self.context, sampling=spec)
        return await self.source.play(prompt, group_id=group_id, index=index, generate=turn, context=context)


def split_held_out(rows: list[Row], n: int, name: str) -> tuple[list[Row], list[Row]]:
    """(the rows to train, the last `n`, held out for evaluation); ConfigError when `n` leaves
    nothing to train."""
    if n >= len(rows):
        raise ConfigError(
            f"run.eval_prompts: {name} brings {len(rows)} prompts; holding out {n} for evaluation leaves none "
            "to train (give fewer)"
        )
    return rows[: len(rows) - n], rows[len(rows) - n :]


async def evaluate(
    engine: Engine,
    prompts: list[Prompt],
    sampling: SamplingSpec,
    *,
    samples_per_prompt: int,
    decode: Callable[[list[int]], str],
    scorer: Scorer,
    on_sample: Callable[[Sample], None] | None = None,
    num_examples: int = 3,
    max_model_len: int | None = None,
    episodes: HeldOutEpisodes | None = None,
) -> EvalReport:
    """Generate `samples_per_prompt` completions per prompt concurrently and score each prompt's
    completions with `scorer` (an unscorable sample counts as not correct). A prompt that cannot
    fit `max_model_len`, or that the engine refuses, is dropped with the reason, as in training.
    With `episodes`, each completion is an episode of the run's source, scored with what its
    environment gave it."""
    began = time.monotonic()
    dropped: dict[str, int] = {}

    def drop(reason: str) -> None:
        dropped[reason] = dropped.get(reason, 0) + 1

    if max_model_len is not None:
        fitting = []
        for prompt in prompts:
            reason = unusable(prompt, max_model_len)
            if reason is None:
                fitting.append(prompt)
            else:
                drop(reason)
        prompts = fitting

    async def one(prompt: Prompt, index: int) -> Sample:
        if episodes is None:
            sample = await rollout(engine, prompt, sampling, group_id=f"eval-{prompt.id}", index=index)
        else:
            sample = await episodes.play(engine, prompt, sampling, f"eval-{prompt.id}", index)
        if on_sample is not None:
            on_sample(sample)
        return sample

    async def group(prompt: Prompt) -> Graded | None:
        try:
            samples = await asyncio.gather(*(one(prompt, i) for i in range(samples_per_prompt)))
        except RequestRefused as err:  # this prompt's, as in training
            drop(f"engine error: {err}")
            return None
        texts = [decode(s.completion_token_ids) for s in samples]
        ids = [s.completion_token_ids for s in samples]
        if episodes is None:
            return prompt, texts, samples, await scorer.score(prompt, texts, ids)
        from rollflow.envs import episode_score

        try:
            prior, extra = [episode_score(s) for s in samples], episodes.source.columns(samples)
            return prompt, texts, samples, await scorer.score(prompt, texts, ids, prior, extra)
        finally:
            episodes.source.done(f"eval-{prompt.id}")

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(group(p), name=f"eval-{p.id}") for p in prompts]
    results = [done for task in tasks if (done := task.result()) is not None]
    return _report(results, time.monotonic() - began, num_examples, dropped)


Graded = tuple[Prompt, list[str], list[Sample], list[Scored]]
"""One prompt's evaluation: its completions' texts, samples and scores."""


def _report(results: list[Graded], wall_s: float, num_examples: int, dropped: dict[str, int]) -> EvalReport:
    rewards: dict[str, list[float]] = {}
    examples: list[tuple[str, str, float]] = []
    reasons: dict[str, int] = {}
    versions: set[int] = set()
    tokens = 0
    for prompt, texts, samples, scored in results:
        for text, sample, result in zip(texts, samples, scored, strict=True):
            reward = 0.0 if result.reward is None else result.reward
            if result.reason is not None:
                reasons[result.reason] = reasons.get(result.reason, 0) + 1
            rewards.setdefault(prompt.id, []).append(reward)
            tokens += sample.num_tokens
            versions.update(sample.versions)
            if len(examples) < num_examples:
                question = prompt.messages[-1].content if prompt.messages else ""
                examples.append((question, text, reward))
    flat = [r for rs in rewards.values() for r in rs]
    return EvalReport(
        prompts=len(rewards),
        samples=len(flat),
        accuracy=sum(flat) / len(flat) if flat else 0.0,
        pass_at_group=sum(max(rs) > 0 for rs in rewards.values()) / len(rewards) if rewards else 0.0,
        tokens=tokens,
        wall_s=wall_s,
        examples=examples,
        unscorable=sum(reasons.values()),
        reasons=reasons,
        dropped=dropped,
        versions=sorted(versions),
    )


async def held_out_prompts(config: Config, tokenizer: Any, n: int, rows: list[Row] | None = None) -> list[Prompt]:
    """`n` prompts drawn with `run.eval_seed` (the same ones at every evaluation of a run), from
    `rows` when given (an episode source's held-out rows; at most all of them), else from
    `data.task`; what is slow to make (a reasoning-gym item) is made on a worker thread, and an
    item that cannot be made is left out with a warning."""
    from rollflow.models import prompt_encoder
    from rollflow.sampler import Sampler

    task = parse_task(config.data)
    if rows is not None:
        n = min(n, len(rows))
    elif task.held_out_items and n > task.held_out_items:
        raise UserInputError(
            f"held-out prompts: at most {task.held_out_items:,} of {task.name!r} are held out, not {n:,}"
        )
    held_out = Sampler(
        msgspec.structs.replace(config.data, seed=config.run.eval_seed),
        prompt_encoder(tokenizer, config.data),
        task=task,
        rows=rows,
    )
    prompts = []
    for _ in range(n):
        try:
            prompts.append(await held_out.draw())
        except UnusablePrompt as err:
            log.warning("held-out prompts: %s", err)
    return prompts


class HeldOut(msgspec.Struct, frozen=True, kw_only=True):
    """One evaluation on the held-out prompts."""

    greedy: EvalReport
    """Greedy decoding, one completion per prompt: `greedy.accuracy` is the held-out accuracy."""
    sampled: EvalReport | None = None
    """k completions per prompt with the sampling settings (pass@k), when asked."""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompts": self.greedy.prompts,
            "accuracy": self.greedy.accuracy,
            "tokens": self.greedy.tokens,
            "wall_s": self.greedy.wall_s,
            "unscorable": self.greedy.unscorable,
            "versions": sorted(set(self.greedy.versions) | set(self.sampled.versions if self.sampled else [])),
        }
        if self.sampled is not None:
            k = self.sampled.samples // max(self.sampled.prompts, 1)
            out |= {"k": k, "pass_at_k": self.sampled.pass_at_group, "sample_accuracy": self.sampled.accuracy}
            out["tokens"] += self.sampled.tokens
            out["wall_s"] += self.sampled.wall_s
            out["unscorable"] += self.sampled.unscorable
        reasons = dict(self.greedy.reasons)
        for reason, count in (self.sampled.reasons if self.sampled is not None else {}).items():
            reasons[reason] = reasons.get(reason, 0) + count
        if reasons:
            out["unscorable_reasons"] = reasons
        if self.greedy.dropped:  # the same prompts are dropped from both
            out["dropped"] = sum(self.greedy.dropped.values())
            out["dropped_reasons"] = dict(self.greedy.dropped)
        return out


async def evaluate_held_out(
    engine: Engine,
    config: Config,
    tokenizer: Any,
    scorer: Scorer,
    *,
    prompts: int | list[Prompt] | None = None,
    pass_k: int = 0,
    on_sample: Callable[[Sample], None] | None = None,
    episodes: HeldOutEpisodes | None = None,
) -> HeldOut:
    """Greedy accuracy on `prompts` held-out prompts (default `run.eval_prompts`; or the prompts
    `held_out_prompts` made), and pass@k with `pass_k` samples per prompt when > 0, scored by
    `scorer`; played as episodes with `episodes`."""
    if isinstance(prompts, list):
        chosen = prompts
    else:
        n = config.run.eval_prompts if prompts is None else prompts
        chosen = await held_out_prompts(config, tokenizer, n, episodes.rows if episodes is not None else None)

    def run(spec: SamplingSpec, k: int) -> Awaitable[EvalReport]:
        return evaluate(
            engine,
            chosen,
            spec,
            samples_per_prompt=k,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            scorer=scorer,
            on_sample=on_sample,
            max_model_len=config.engine.max_model_len or CONTEXT_CAP,
            episodes=episodes,
        )

    greedy = await run(sampling_spec(config, greedy=True), 1)
    sampled = await run(sampling_spec(config), pass_k) if pass_k > 0 else None
    return HeldOut(greedy=greedy, sampled=sampled)


async def held_out_report(
    engine: Engine,
    config: Config,
    tokenizer: Any,
    prompts: int | list[Prompt],
    pass_k: int,
    *,
    on_sample: Callable[[Sample], None] | None = None,
    episodes: HeldOutEpisodes | None = None,
    scorer: Scorer | None = None,
) -> dict[str, Any]:
    """What `python -m rollflow eval` prints: the model, task and reward, and the held-out scores
    on `engine` (scored with `run.reward`, or `scorer`) of `prompts` (a number, or
    `held_out_prompts`' own), played as `episodes` when given."""
    own = scorer is None
    used = eval_scorer(config) if scorer is None else scorer
    try:
        held_out = await evaluate_held_out(
            engine, config, tokenizer, used, prompts=prompts, pass_k=pass_k, on_sample=on_sample, episodes=episodes
        )
    finally:
        if own:
            await used.aclose()
    report: dict[str, Any] = {"model": config.model.path, "task": config.data.task, "reward": config.run.reward}
    if episodes is not None and config.env is not None:
        report = {"model": config.model.path, "env": config.env.__struct_config__.tag}
        if episodes.rows is None:
            report["task"] = config.data.task
    return report | {"eval_seed": config.run.eval_seed} | held_out.as_dict()
