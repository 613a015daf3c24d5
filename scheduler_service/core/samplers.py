"""Sequence-length samplers shaped like the paper's Table 1.

No data set can be downloaded at run time, so batches are sampled from the
published cumulative fractions of three real Long-SFT data sets (Skrull paper,
Table 1: share of sequences below 1K/4K/8K/32K/128K tokens and the longest).
Within each bin lengths are log-uniform — an approximation: the table fixes the
bin masses exactly and nothing finer. The shortest sequence is assumed to be
32 tokens (a prompt and a short answer).

Two long-heavy shapes of our own (not measured data sets) stress hybrid DACP:
``longtail64k`` (a 16K–64K tail under a chat-length body, shaped like
long-context instruction mixes such as Qwen2.5-Turbo's) and ``docmix`` (flat
4K–16K documents).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["DATASETS", "LengthDistribution", "sample_lengths"]

K = 1024
MIN_TOKENS = 32


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthDistribution:
    """Cumulative fractions below each threshold, and the longest sequence seen."""

    name: str
    thresholds: tuple[int, ...]
    cumulative: tuple[float, ...]
    longest: int

    def bins(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """(lower edges, upper edges, probabilities) of the non-empty bins."""
        edges = [MIN_TOKENS, *[min(t, self.longest) for t in self.thresholds], self.longest]
        masses = np.diff([0.0, *self.cumulative, 1.0])
        lows, highs, probs = [], [], []
        for low, high, mass in zip(edges[:-1], edges[1:], masses, strict=True):
            if mass > 0 and high > low:
                lows.append(low)
                highs.append(high)
                probs.append(mass)
        probabilities = np.array(probs) / np.sum(probs)
        return np.array(lows, dtype=np.float64), np.array(highs, dtype=np.float64), probabilities


_THRESHOLDS = (1 * K, 4 * K, 8 * K, 32 * K, 128 * K)

DATASETS: dict[str, LengthDistribution] = {
    d.name: d
    for d in (
        LengthDistribution(name="wikipedia", thresholds=_THRESHOLDS,
                           cumulative=(0.8788, 0.9934, 0.9992, 0.9999, 1.0), longest=78 * K),
        LengthDistribution(name="lmsys", thresholds=_THRESHOLDS,
                           cumulative=(0.8712, 0.9935, 0.9987, 0.9998, 0.9999), longest=1643 * K),
        LengthDistribution(name="chatqa2", thresholds=_THRESHOLDS,
                           cumulative=(0.2192, 0.3148, 0.4043, 0.9986, 1.0), longest=99 * K),
        LengthDistribution(name="longtail64k", thresholds=_THRESHOLDS,
                           cumulative=(0.35, 0.55, 0.65, 0.80, 1.0), longest=64 * K),
        LengthDistribution(name="docmix", thresholds=(4 * K, 16 * K), cumulative=(0.0, 1.0), longest=16 * K),
    )
}


def sample_lengths(
    dataset: str, num_sequences: int, rng: np.random.Generator, max_length: int | None = None
) -> npt.NDArray[np.int64]:
    """``num_sequences`` lengths from ``dataset``; ``max_length`` truncates, as a trainer would."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
    lows, highs, probabilities = DATASETS[dataset].bins()
    chosen = rng.choice(len(probabilities), size=num_sequences, p=probabilities)
    log_lengths = rng.uniform(np.log(lows[chosen]), np.log(highs[chosen]))
    lengths = np.exp(log_lengths).astype(np.int64)
    if max_length is not None:
        lengths = np.minimum(lengths, max_length)
    return lengths
