"""The seam every source of episodes enters through, below every adapter.

The source protocol and what it is played with (`source.py`: `EpisodeSource`, `EpisodeContext`,
`EpisodeLimits`, `GenerateTurn`, `Served`), conversations as token sequences (`chat.py`:
`ChatFormat`) and an episode's recording made into its `Sample` (`record.py`: `Sequence`,
`Recording`, `sample_of`, `failed_episode`). It imports no adapter: step-wise environments
(`rollflow.envs`), agents (`rollflow.agent`) and verifiers (`rollflow.verifiers`) import it, and
`rollflow.sources` picks the one `[env].kind` names.
"""

from rollflow.episodes.chat import ChatFormat
from rollflow.episodes.record import Recording, Sequence, failed_episode, sample_of
from rollflow.episodes.source import EpisodeContext, EpisodeLimits, EpisodeSource, GenerateTurn, Served
from rollflow.records import Sample

__all__ = [
    "ChatFormat",
    "EpisodeContext",
    "EpisodeLimits",
    "EpisodeSource",
    "GenerateTurn",
    "Recording",
    "Sample",
    "Sequence",
    "Served",
    "failed_episode",
    "sample_of",
]
