"""The producer: admission -> prompt -> G rollouts -> scoring -> advantages -> the group buffer.

`Producer.run` waits for room under the capacity rule (`buffer.Admission`), draws the next
prompt and launches its group as one task; the group's G rollouts stream concurrently (single
turns, or multi-turn episodes played by the run's episode source, `rollflow.episodes`), each
surviving engine deaths through the supervisor; the finished samples are scored beside generation
(`controller.groups.score_group`) and go into the buffer. A group that cannot be used is dropped
with its reason in the ledger and gives its admission room back: every drop, admission release
and stall notice is made here.

Every group lives in ONE registry (`in_flight`) from launch until it is buffered or dropped:
its prompt, its samples' progress (what a checkpoint saves) and its task. The producer does
not train and does not move weights.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import msgspec

from rollflow.checkpoint import PendingGroup
from rollflow.config import Config
from rollflow.controller.groups import Dropped, InFlight, Scoring, score_group
from rollflow.controller.setup import Components, Flow
from rollflow.episodes import EpisodeContext, EpisodeSource
from rollflow.errors import EngineDeadError, EngineError, UnusablePrompt
from rollflow.records import Prompt, Sample, SamplingSpec
from rollflow.rollout import PartialSample, Progress, request_seed, rollout, unusable
from rollflow.scoring import Scorer


class Producer:
    """Turns prompts into scored groups in the buffer, as fast as admission allows."""

    def __init__(
        self,
        config: Config,
        flow: Flow,
        parts: Components,
        scorer: Scorer,
        episodes: EpisodeSource | None,
        spec: SamplingSpec,
    ) -> None:
        """`config`: the run's, made concrete by `build`; `flow`: what the producer shares with
        the training loop; `parts`: the sampler, tokenizer, chat format and teacher it uses;
        `episodes`: plays each sample's episode (None: single-turn samples); `spec`: the run's
        sampling."""
        self.config = config
        self.flow = flow
        self.sampler = parts.sampler
        self.spec = spec
        self.episodes = episodes
        self.context = (
            EpisodeContext(
                chat=parts.chat, sampling=spec, max_model_len=config.engine.max_model_len, version=self._version
            )
            if parts.chat is not None
            else None
        )
        """What every episode is played with (only with episodes)."""
        self._teacher_thread = ThreadPoolExecutor(1, "rollflow-teacher")
        self.scoring = Scoring(
            config, scorer, parts.tokenizer, parts.teacher, self._teacher_thread, flow.trace, flow.clock, episodes
        )
        self.in_flight: dict[str, InFlight] = {}
        """Every group launched and not yet buffered or dropped, by prompt id."""
        self.resume_from: list[PendingGroup] = []
        """Groups in flight at the checkpoint this run resumed from (launched first)."""
        self.consumed: list[str] = []
        """Ids of every prompt drawn, in order."""
        self.group_seq = 0
        self.generated_tokens = 0
        self.filtered = 0
        """Groups dropped because their rewards were all equal (`rollout.filter_equal_rewards`)."""
        self.engine_busy_s = 0.0
        """Wall time with at least one group generating (the engine's busy time)."""
        self._busy_since: float | None = None
        self._generating = 0

    def _version(self) -> int:
        """The policy version the serving engine generates under now (`EpisodeContext.version`)."""
        return self.flow.supervisor.engine.version

    # ---- launching groups -----------------------------------------------------------------

    async def run(self, tg: asyncio.TaskGroup) -> None:
        group_size = self.config.rollout.group_size
        for pending in self.resume_from:  # groups in flight at the checkpoint continue first
            self._launch(tg, pending.prompt, pending.group_id, pending.samples)
        self.resume_from = []
        while await self.flow.admission.acquire(group_size):
            try:
                prompt = await self.sampler.draw()
            except UnusablePrompt as err:
                await self._refuse(err.prompt_id, err.reason)
                continue
            if (reason := unusable(prompt, self.config.engine.max_model_len)) is not None:
                await self._refuse(prompt.id, reason)
                continue
            self.consumed.append(prompt.id)
            group_id = f"g{self.group_seq}"
            self.group_seq += 1
            self._launch(tg, prompt, group_id, [PartialSample() for _ in range(group_size)])

    async def _refuse(self, prompt_id: str, reason: str) -> None:
        """A drawn prompt is dropped before it is sent, giving its admission room back."""
        self.consumed.append(prompt_id)
        self.flow.accounting.drop(prompt_id, reason)
        self.flow.stall.failed(reason)
        await self.flow.admission.release(self.config.rollout.group_size)
        await asyncio.sleep(0)  # nothing above may wait: let the rest of the run see the drop

    def _launch(self, tg: asyncio.TaskGroup, prompt: Prompt, group_id: str, start: list[PartialSample]) -> None:
        if self._generating == 0:
            self._busy_since = self.flow.clock()
        self._generating += 1
        entry = InFlight(prompt, group_id, [Progress(s) for s in start])
        self.in_flight[prompt.id] = entry
        entry.task = tg.create_task(self._group(entry), name=f"group-{prompt.id}")

    async def _group(self, entry: InFlight) -> None:
        try:
            samples = await self._generate(entry)
            if samples is not None:
                await self._score(entry, samples)
        finally:
            if entry.settled:
                self.in_flight.pop(entry.prompt.id, None)
            if self.episodes is not None:
                self.episodes.done(entry.group_id)

    async def _score(self, entry: InFlight, samples: list[Sample]) -> None:
        """The group into the buffer, or dropped with its reason (its admission room back)."""
        flow = self.flow
        try:
            scored = await score_group(self.scoring, entry.prompt, samples)
        except asyncio.CancelledError:
            if not flow.accounting.pending_held:
                self._drop(entry, "run ended: being scored", abandoned=len(samples))
            raise
        if isinstance(scored, Dropped):
            if scored.failed:
                self._fail(entry, scored.reason)
            else:
                self._drop(entry, scored.reason)
                flow.stall.filtered(scored.reason)
                self.filtered += 1
            await flow.admission.release(len(samples))
            return
        await flow.buffer.put(scored)
        entry.settled = True
        flow.stall.buffered()

    def _drop(self, entry: InFlight, reason: str, *, abandoned: int = 0) -> None:
        """The group ends without training; `abandoned`: samples the run's end left unfinished."""
        entry.settled = True
        if abandoned:
            self.flow.accounting.abandon(entry.prompt.id, reason, abandoned)
        else:
            self.flow.accounting.drop(entry.prompt.id, reason)

    def _fail(self, entry: InFlight, reason: str) -> None:
        """The group is dropped as failed: nothing of it can be trained (the stop rule counts it)."""
        self._drop(entry, reason)
        self.flow.stall.failed(reason)

    def _generated(self, entry: InFlight) -> None:
        entry.generating = False
        self._generating -= 1
        if self._generating == 0 and self._busy_since is not None:
            self.engine_busy_s += self.flow.clock() - self._busy_since
            self._busy_since = None

    def busy_total(self) -> float:
        """Engine busy time so far, counting the current busy stretch."""
        current = self.flow.clock() - self._busy_since if self._busy_since is not None else 0.0
        return self.engine_busy_s + current

    # ---- generating -------------------------------------------------------------------------

    async def _generate(self, entry: InFlight) -> list[Sample] | None:
        """The group's samples, or None when an engine error dropped the group."""
        prompt, group_id = entry.prompt, entry.group_id
        # Owned here: awaited together below, and cancelled together if any fails.
        tasks = [
            asyncio.create_task(self._rollout(prompt, group_id, i, p), name=f"rollout-{group_id}/{i}")
            for i, p in enumerate(entry.progress)
        ]
        try:
            samples = await asyncio.gather(*tasks)
        except BaseException as err:
            # One sample failed or the run is ending: stop the group's other samples too.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._generated(entry)
            if isinstance(err, asyncio.CancelledError):
                if not self.flow.accounting.pending_held:
                    self._drop(entry, "run ended: in flight", abandoned=len(tasks))
                raise
            if isinstance(err, EngineError) and not isinstance(err, EngineDeadError):
                self._fail(entry, f"engine error: {err}")
                await self.flow.admission.release(len(tasks))
                return None
            self._drop(entry, f"run failed: {err}")  # the error ends the run; the prompt is still accounted for
            raise
        self._generated(entry)
        self.generated_tokens += sum(sample.num_tokens for sample in samples)
        return samples

    async def _rollout(self, prompt: Prompt, group_id: str, index: int, progress: Progress) -> Sample:
        lane = self.flow.trace.lane()
        version, began = self.flow.supervisor.engine.version, self.flow.clock()
        try:
            if self.episodes is None:
                sample = await self._stream(prompt, self.spec, group_id, index, progress)
            else:
                sample = await self._episode(prompt, group_id, index, progress)
        except BaseException:
            self.flow.trace.span(
                "generate (ended early)", lane, began, self.flow.clock(), prompt=prompt.id, sample=index
            )
            raise
        finally:
            self.flow.trace.release(lane)
        self.flow.trace.span(
            "generate",
            lane,
            began,
            self.flow.clock(),
            prompt=prompt.id,
            sample=index,
            tokens=sample.num_tokens,
            version_start=sample.versions[0] if sample.versions else version,
            version_end=sample.versions[-1] if sample.versions else version,
            interruptions=sample.interruptions,
            turns=sample.turns,
        )
        return sample

    async def _stream(
        self, prompt: Prompt, spec: SamplingSpec, group_id: str, index: int, progress: Progress
    ) -> Sample:
        """One generation, carried over to a new engine (from the tokens it had) if the engine dies.
        A request without a seed of its own (an agent may give one) gets the sample's
        (`request_seed`), so its draws do not depend on which engine decodes it."""
        partial = self.config.rollout.partial
        if spec.seed is None:
            seed = request_seed(self.config.engine.seed, prompt.id, group_id, index)
            spec = msgspec.structs.replace(spec, seed=seed)
        return await self.flow.supervisor.persist(
            lambda engine: rollout(
                engine, prompt, spec, group_id=group_id, index=index, partial=partial, progress=progress
            )
        )

    async def _episode(self, prompt: Prompt, group_id: str, index: int, progress: Progress) -> Sample:
        """A multi-turn episode. Its progress is saved only once it is done: a checkpoint taken
        mid-episode restarts it from its prompt (an environment's state cannot be saved), and so
        does one taken after it when the group's scoring needs the episode's live state."""
        assert self.episodes is not None and self.context is not None
        done = progress.saved.done  # finished before the checkpoint this run resumed from
        if done is not None and not self.episodes.replay_on_resume:
            return done

        first: list[int] = []  # the version of the episode's first model token: its later turns ask for it

        async def turn(token_ids: list[int], spec: SamplingSpec, n: int) -> Sample:
            turn_prompt = Prompt(id=prompt.id, token_ids=token_ids)
            if first:
                spec = msgspec.structs.replace(spec, on_version=first[0])
            made = await self._stream(turn_prompt, spec, f"{group_id}/t{n}", index, Progress())
            if not first and made.versions:
                first.append(made.versions[0])
            return made

        sample = await self.episodes.play(prompt, group_id=group_id, index=index, generate=turn, context=self.context)
        if sample.done_version is None:
            sample = msgspec.structs.replace(sample, done_version=self._version())
        progress.saved = PartialSample(done=sample)
        return sample

    # ---- what the rest of the controller asks -------------------------------------------------

    def snapshot(self) -> list[PendingGroup]:
        """Every group in flight with each sample's progress, at this instant."""
        engine = self.flow.supervisor.engine
        return [
            PendingGroup(prompt=e.prompt, group_id=e.group_id, samples=[p.snapshot(engine) for p in e.progress])
            for e in self.in_flight.values()
        ]

    def cancel(self) -> None:
        """Cancel every group in flight (their engine requests are aborted)."""
        for entry in self.in_flight.values():
            if entry.task is not None:
                entry.task.cancel()

    def take_in_flight(self) -> list[str]:
        """The prompt ids still registered (cancelled before they were buffered or dropped),
        forgetting them."""
        ids = list(self.in_flight)
        self.in_flight.clear()
        return ids

    async def aclose(self) -> None:
        self._teacher_thread.shutdown(wait=False)
