"""The verifiers harness plugin `rollflow-harness` (verifiers' loader imports a harness id as a
module exporting its `Harness` subclass in `__all__`): rollflow's in-process chat loop,
`rollflow.verifiers.harness.InProcessHarness`."""

from rollflow.verifiers.harness import InProcessHarness

__all__ = ["InProcessHarness"]
