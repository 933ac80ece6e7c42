"""On-policy distillation: a teacher scores the student's own samples token by token.

The teacher is a local Hugging Face model (`scoring.teacher`). For every sampled completion it
returns the log-probability of each sampled token under the teacher, computed exactly as the
trainer computes the student's (same chunked LM head, same temperature / top-k / top-p
support). With the behaviour log-probs the engine recorded, each token gets a reverse-KL
advantage, `coef × (log p_teacher(y_t) − log p_student(y_t))`: positive where the teacher likes the
student's token more than the student did. Its mean over tokens of `log p_student − log p_teacher`
is the sampled estimate of KL(student ‖ teacher) (`teacher_kl` in the metrics). The teacher is a
scoring stage like a reward: it runs per group, on its own thread, beside generation; a teacher
that fails makes the group's samples unscorable with the reason.
"""

from __future__ import annotations

from pathlib import Path

from rollflow.batch import train_sample
from rollflow.config import LossConfig, TrainerConfig
from rollflow.records import Sample


class Teacher:
    """Per-token log-probs of the student's sampled tokens under a fixed teacher model."""

    def __init__(self, model_path: str | Path, config: TrainerConfig = TrainerConfig()) -> None:  # noqa: B008
        from rollflow.trainer import Trainer

        # The trainer's scoring path, without LoRA; its optimizer never steps (no state is allocated).
        plain = TrainerConfig(dtype=config.dtype, loss_chunk=config.loss_chunk, seed=config.seed)
        self._model = Trainer(model_path, plain, LossConfig())
        self._model.lm.requires_grad_(False)

    def __call__(self, samples: list[Sample]) -> list[list[float]]:
        """One list of teacher log-probs per sample, one per completion token (blocking)."""
        return self._model.score([train_sample(s, 0.0) for s in samples])


def reverse_kl_advantages(teacher: list[float], behaviour: list[float], coef: float) -> list[float]:
    """Per-token advantage `coef × (teacher − behaviour)` (zero where the two agree)."""
    return [coef * (t - b) for t, b in zip(teacher, behaviour, strict=True)]
