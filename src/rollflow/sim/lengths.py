"""Completion lengths for the simulator: a lognormal or an empirical distribution (a run's
ledger or trace, or a list), correlated within a GRPO group (`rho`: the share of log-length
variance that belongs to the prompt). It times nothing; `rollflow.sim.components` asks it how
long each simulated request runs.
"""

from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path


class LengthModel:
    """Completion lengths, correlated within a group.

    For request `group/index`, z = rho·z_group + sqrt(1 − rho²)·z_sample (both standard normal,
    seeded by the names, so a run is reproducible); the length is the distribution's quantile
    at z: exp(mu + sigma·z) for a lognormal, the empirical quantile at Φ(z) otherwise.
    """

    def __init__(
        self,
        *,
        mean: float = 256.0,
        sigma: float = 0.8,
        empirical: list[int] | None = None,
        rho: float = 0.5,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"rho must be in [0, 1], got {rho}")
        self.mu = math.log(mean) - sigma**2 / 2  # the lognormal's mean is `mean`
        self.sigma = sigma
        self.empirical = sorted(empirical) if empirical else None
        self.rho = rho
        self.seed = seed

    @classmethod
    def parse(cls, spec: str, *, rho: float = 0.5, seed: int = 0) -> LengthModel:
        """`lognormal:MEAN,SIGMA`, or a file: a run's `ledger.jsonl` or `trace.json`, or one
        length per line."""
        if spec.startswith("lognormal:"):
            try:
                mean, sigma = (float(x) for x in spec.removeprefix("lognormal:").split(","))
            except ValueError:
                raise ValueError(f"--lengths {spec!r}: expected lognormal:MEAN,SIGMA, e.g. lognormal:300,0.8") from None
            if mean <= 0 or sigma < 0:
                raise ValueError(f"--lengths {spec!r}: MEAN must be > 0 and SIGMA >= 0")
            return cls(mean=mean, sigma=sigma, rho=rho, seed=seed)
        return cls(empirical=read_lengths(Path(spec)), rho=rho, seed=seed)

    def _z(self, name: str) -> float:
        digest = hashlib.blake2b(f"{self.seed}:{name}".encode(), digest_size=8).digest()
        return random.Random(int.from_bytes(digest, "little")).gauss(0.0, 1.0)

    def length(self, request_id: str) -> int:
        base = request_id.split("#", 1)[0]  # a resubmission continues the same sample
        group = base.rsplit("/", 1)[0]
        z = self.rho * self._z(group) + math.sqrt(1 - self.rho**2) * self._z(base)
        if self.empirical is not None:
            q = 0.5 * (1 + math.erf(z / math.sqrt(2)))
            return self.empirical[min(int(q * len(self.empirical)), len(self.empirical) - 1)]
        return max(1, round(math.exp(self.mu + self.sigma * z)))


def read_lengths(path: Path) -> list[int]:
    """Completion lengths from a run's ledger.jsonl or trace.json, or from a file with one
    integer per line."""
    if not path.is_file():
        raise ValueError(f"--lengths {path}: no such file; expected lognormal:MEAN,SIGMA or a file of lengths")
    if path.suffix == ".jsonl":
        import json

        lengths: list[int] = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                lengths += entry.get("tokens") or []
            except (json.JSONDecodeError, AttributeError):
                raise ValueError(f"{path}:{number}: expected a ledger line (a JSON object)") from None
    elif path.suffix == ".json":
        from rollflow.trace import load_trace

        lengths = [int(s["args"]["tokens"]) for s in load_trace(path)["spans"] if s["name"] == "generate"]
    else:
        lengths = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    lengths.append(int(line))
                except ValueError:
                    raise ValueError(f"{path}:{number}: expected a whole number of tokens, got {line!r}") from None
    if not lengths or min(lengths) < 0:
        raise ValueError(f"{path}: no completion lengths found")
    return lengths
