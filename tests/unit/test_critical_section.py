"""The weight-update critical section's failure rule, for an update in stages and in one call."""

from __future__ import annotations

import pytest

from rollflow.engine import critical_section
from rollflow.errors import EngineDeadError, WeightSyncError


class Engine:
    """Records what the critical section asked of it."""

    def __init__(self, intact: bool) -> None:
        self.calls: list[str] = []
        self._intact = intact

    def stage(self, name: str, error: Exception | None = None):
        async def run() -> None:
            self.calls.append(name)
            if error is not None:
                raise error

        return name, run

    async def resume(self) -> None:
        self.calls.append("resume")

    async def intact(self) -> bool:
        self.calls.append("intact?")
        return self._intact

    async def lose(self, reason: str) -> EngineDeadError:
        self.calls.append("lose")
        return EngineDeadError(f"taken out of service: {reason}")


async def run(engine: Engine, stages, load_stage: str = "load", timings=None) -> None:
    await critical_section(
        "engine",
        3,
        stages,
        deadline_s=5,
        resume=engine.resume,
        can_resume=lambda: True,
        intact=engine.intact,
        lose=engine.lose,
        timings=timings,
        load_stage=load_stage,
    )


async def test_a_one_call_update_that_fails_with_the_model_untouched_keeps_the_version():
    engine = Engine(intact=True)
    with pytest.raises(WeightSyncError, match=r"stage 'update': load: no segment; the engine keeps version 3"):
        await run(engine, [engine.stage("update", RuntimeError("load: no segment"))], load_stage="update")
    assert engine.calls == ["update", "intact?", "resume"]


async def test_a_one_call_update_that_fails_after_the_model_changed_takes_the_engine_out():
    engine = Engine(intact=False)  # the worker was told its weights no longer match the label
    with pytest.raises(EngineDeadError, match=r"stage 'update': label, after the new weights"):
        await run(
            engine,
            [engine.stage("update", RuntimeError("label, after the new weights were loaded: boom"))],
            load_stage="update",
        )
    assert engine.calls == ["update", "intact?", "lose"]


async def test_stages_before_the_load_never_ask_the_worker_and_timings_name_every_stage():
    engine = Engine(intact=False)
    with pytest.raises(WeightSyncError, match="stage 'pause'.*keeps version 3"):
        await run(engine, [engine.stage("pause", RuntimeError("no")), engine.stage("load")])
    assert engine.calls == ["pause", "resume"]
    timings: dict[str, float] = {}
    engine = Engine(intact=True)
    await run(engine, [engine.stage("update")], load_stage="update", timings=timings)
    assert list(timings) == ["update", "resume"] and all(0 <= s < 5 for s in timings.values())
