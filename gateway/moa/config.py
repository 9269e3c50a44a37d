"""Configuration of the mixture-of-agents upstream (``model="mesh"``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# What the arbiter runs; "auto" picks one of them per request (gateway/moa/auto.py). "single":
# one call to the best model, greedy when the caller left temperature unset.
Policy = Literal["race", "consensus", "reduce", "vote", "judge", "single"]
PolicyChoice = Literal["race", "consensus", "reduce", "vote", "judge", "single", "auto"]
POLICIES: tuple[PolicyChoice, ...] = (
    "race",
    "consensus",
    "reduce",
    "vote",
    "judge",
    "single",
    "auto",
)
MAX_SAMPLES = 32  # metadata.moa_samples: 1..MAX_SAMPLES
# How the vote's samples differ (issue 43, item 3; bench/moa_heldout.py measures each):
# "temperature": hotter samples with seeds of their own; "framings": greedy samples, each under
# another framing of the task; "reasoning": each sample reasons before its final answer
# (self-consistency over reasoning paths).
SampleStyle = Literal["temperature", "framings", "reasoning"]
# judge without the pick: which complete sample stands (metadata.moa_select overrides).
JudgeSelection = Literal["confidence", "consensus"]
JUDGE_SELECTIONS: tuple[JudgeSelection, ...] = ("confidence", "consensus")


@dataclass(frozen=True, slots=True)
class MoaConfig:
    """How ``mesh`` picks, runs and judges its workers.

    The CLI builds one of these; per request, ``metadata["moa_policy"]`` overrides ``policy``.
    """

    # Which arbiter policy decides (see gateway/moa/arbiter.py and bench/results/moa.md).
    policy: PolicyChoice = "race"
    # auto: whether a short-answer question gets the vote (True) or the best model's single
    # answer (False). Off: on six task families no rule was tuned on, no variant of the vote
    # beat greedy (+0.8 points, p = 1, one batch) and each made the user wait 2-4x as long
    # (bench/results/moa-heldout.md).
    auto_vote: bool = False
    # Most worker calls per request (distinct models first; one model → that many samples).
    max_workers: int = 3
    # Temperatures of the self-mixture samples; None keeps the caller's own temperature.
    sample_temperatures: tuple[float | None, ...] = (None, 0.7, 1.0)
    # race: commit to the first worker whose first N deltas pass the gates – or, with
    # race_early_commit, as soon as its opening is conclusive (cannot still become a refusal or
    # markup: "The…" commits at once, "I…" waits for more).
    race_min_tokens: int = 4
    race_early_commit: bool = True
    # race, self-mixture: when a hotter sample passes first, wait for the caller's own sample
    # (the first candidate) to pass too and take it instead (hot samples answer worse): for its
    # first token, at least this long, or this fraction of the passer's time to first token
    # (samples admitted one prefill apart lag by a share of it); once it streams, for its verdict.
    race_prefer_window_s: float = 0.075
    race_prefer_fraction: float = 0.25
    # consensus: workers agree when their normalised texts share this many leading characters.
    agree_prefix_chars: int = 24
    # consensus/reduce: after the first content delta anywhere, wait at most this long to decide.
    grace_s: float = 2.0
    # reduce: run the aggregator once this many answers are complete (None: a majority).
    reduce_k: int | None = None
    # Per worker: first content delta within this, whole stream within total_timeout_s.
    first_token_timeout_s: float = 60.0
    total_timeout_s: float = 600.0
    # vote: how many samples (metadata.moa_samples overrides, 1..MAX_SAMPLES), spread over the
    # mesh's models and their routes, and the Beta stopping rule's confidence (Aggarwal et al.).
    # Chosen on the 300 tuning items of bench/moa_quality.py (bench/results/moa-quality.md):
    # at 0.85 two agreeing votes settle it (2 : 0 is 0.875) but 3 : 1 does not (0.81). With the
    # scatter rule below and the tie and abstention rules the vote of 8 then starts 48 % of its
    # samples instead of 61 % at 0.9 (three agreeing votes), for 1 item of 300 (39.7 % vs
    # 40.0 %); 0.8 also stops at 3 : 1 and lost 4 items. (Before the scatter rule, 0.8 lost
    # 2 points against 0.9.)
    vote_samples: int = 8
    vote_confidence: float = 0.85
    # vote: once half the samples are in and no answer has more than this share of them, the
    # leader stands (None: off). Chosen on the tuning items: at 1/3 the vote of 8 started 60 %
    # of its samples instead of 83 % for one point; 1/4 (no two agree) saved less. Held out
    # (900 items, with confidence 0.85): 52 % instead of 66 %, ~28 % fewer decode steps,
    # 1.1 points (p = 0.13).
    vote_scatter: float | None = 1 / 3
    # vote: samples start in waves of this many; the next wave only when a whole wave has
    # finished and the vote is still open (bench/results/moa-quality.md measures the size).
    vote_wave: int = 2
    # vote and judge: the samples (all but the caller's own) sample with their model's own
    # values, but never colder than this: SmolLM2's 0.2 repeats the greedy answer and the vote
    # learns nothing (0.5 beat both 0.2 and 0.8 on the screening items). None: no floor.
    vote_min_temperature: float | None = 0.5
    # vote: how the samples differ (SampleStyle); and whether a ballot counts as one vote
    # (None) or by its confidence (CISC, Taubenfeld et al. 2025: softmax of the samples' mean
    # token log-probabilities at this temperature; the vote then waits for every sample).
    vote_style: SampleStyle = "temperature"
    vote_confidence_tau: float | None = None
    # judge: as many samples as the vote; once most have finished, the rest get grace_s more;
    # the most confident complete candidate stands – or, with judge_pick, the largest model
    # picks among at most judge_options distinct ones. Off by default: on 300 held-out items
    # SmolLM2-135M's pick lost 6.3 points to one sample (p = 0.04; bench/results/moa-quality.md).
    judge_options: int = 4
    judge_pick: bool = False
    # judge without the pick: which complete sample stands – the most confident one, or
    # ("consensus") the one most like the others, weighted by confidence (gateway/moa/central.py).
    judge_select: JudgeSelection = "confidence"
    # Emit one Progress note ("asking 3 models…") before the decision: Responses clients see it
    # as a reasoning summary; the other APIs drop it.
    progress: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown MoA policy {self.policy!r}; expected one of {POLICIES}")
        if self.max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        if not 1 <= self.vote_samples <= MAX_SAMPLES:
            raise ValueError(f"vote_samples must be between 1 and {MAX_SAMPLES}")
        if self.judge_options < 2:
            raise ValueError("judge_options must be at least 2")
        if self.vote_wave < 1:
            raise ValueError("vote_wave must be at least 1")
        if not 0.5 < self.vote_confidence <= 1:
            raise ValueError("vote_confidence must be in (0.5, 1]")
        if self.vote_scatter is not None and not 0 < self.vote_scatter < 0.5:
            raise ValueError("vote_scatter must be in (0, 0.5) or None")
        if self.race_min_tokens < 1:
            raise ValueError("race_min_tokens must be at least 1")
        if self.race_prefer_window_s < 0 or self.race_prefer_fraction < 0:
            raise ValueError("race_prefer_window_s and race_prefer_fraction must not be negative")
