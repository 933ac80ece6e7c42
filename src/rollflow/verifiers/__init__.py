"""Everything verifiers, in one package: its classic environments (`environments`), its v1
tasksets loaded and refused (`loader`), played turn by turn (`tasksets`) or by their own `Env`
(`taskset_envs`) with rollflow's in-process harness (`harness`), and their toolsets served
in-process or reached at a URL (`toolsets`).

The package depends on the episode seam (`rollflow.episodes`), the step-wise environments
(`rollflow.envs`) and the endpoint (`rollflow.agent`), never the other way round:
`[env] kind = "verifiers"` reaches it through `rollflow.sources`' table of sources. verifiers
itself is imported lazily, inside the functions that need it, and a missing one is named with
its pip extra. Nothing here is imported by `import rollflow`.
"""
