"""``model="mesh"``'s track record per model, as gossip carries it (gateway/moa/track_record.py
counts and uses it). Pure.

Every field has a default and a node of an older version sends none (``NodeState.track_record``
empty). A receiver bounds each sender's word (``TrackRecord.merged``): a member gossiping huge
counts weighs no more than ``MAX_PER_SOURCE`` observations a model.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from gateway.moa.track_record import MAX_MODELS


class TrackRecordAd(BaseModel):
    """One model's track record in one node's pools: its ballots in decided votes and how many
    agreed with the decided answer, its race openings and how many passed the gates."""

    model_config = ConfigDict(extra="ignore")  # newer peers may add fields

    agreed: int = Field(default=0, ge=0)
    ballots: int = Field(default=0, ge=0)
    passed: int = Field(default=0, ge=0)
    openings: int = Field(default=0, ge=0)


def track_record_ads(counts: Mapping[str, Mapping[str, int]]) -> dict[str, TrackRecordAd]:
    """A node's own counts (``TrackRecord.as_dict``) as it gossips them: at most MAX_MODELS."""
    return {model: TrackRecordAd(**c) for model, c in list(counts.items())[:MAX_MODELS]}
