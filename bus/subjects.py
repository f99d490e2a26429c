"""Names of everything a run owns on the broker: streams, subjects, consumers, KV bucket.

Every name embeds the run, so several runs share one broker without seeing each other:
subjects are `specbus.<run>.tasks|samples|dead.<kind>`, streams `SPECBUS_<run>_TASKS|SAMPLES|DEAD`,
the KV bucket `SPECBUS_<run>`. The run name is validated by `core.config.RUN_NAME`
(`[A-Za-z0-9_-]{1,64}`), which is a legal subject token, stream name and bucket name. Stream
names cannot collide across runs: each ends in exactly one of the fixed kind suffixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specbus.core.config import RUN_NAME
from specbus.core.errors import ConfigError

Group = Literal["producers", "trainers"]
PRODUCERS: Group = "producers"
TRAINERS: Group = "trainers"

# Server advisories the DEAD stream captures, per source stream (any consumer of it).
ADVISORY_MAX_DELIVERIES = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"
ADVISORY_TERMINATED = "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED"


@dataclass(frozen=True)
class Names:
    """All broker names of one run. `Names("r1").samples_stream == "SPECBUS_r1_SAMPLES"`."""

    run: str

    def __post_init__(self) -> None:
        if not RUN_NAME.match(self.run):
            raise ConfigError(f"run name {self.run!r} must match {RUN_NAME.pattern}")

    # -- subjects
    @property
    def tasks(self) -> str:
        """The subject of the run's PromptTasks."""
        return f"specbus.{self.run}.tasks"

    @property
    def samples(self) -> str:
        """The subject of the run's SampleRefs."""
        return f"specbus.{self.run}.samples"

    def dead(self, kind: str) -> str:
        """Subject of explicit dead letters from `kind` ("tasks" or "samples")."""
        return f"specbus.{self.run}.dead.{kind}"

    @property
    def dead_all(self) -> str:
        """A wildcard over the run's explicit dead-letter subjects."""
        return f"specbus.{self.run}.dead.>"

    # -- streams
    @property
    def tasks_stream(self) -> str:
        """The stream of the run's tasks (TASKS)."""
        return f"SPECBUS_{self.run}_TASKS"

    @property
    def samples_stream(self) -> str:
        """The stream of the run's sample refs (SAMPLES)."""
        return f"SPECBUS_{self.run}_SAMPLES"

    @property
    def dead_stream(self) -> str:
        """The stream of the run's dead letters (DEAD)."""
        return f"SPECBUS_{self.run}_DEAD"

    @property
    def kv_bucket(self) -> str:
        """The run's KV bucket (manifest, markers)."""
        return f"SPECBUS_{self.run}"

    def dead_subjects(self) -> list[str]:
        """What the DEAD stream listens on: explicit dead letters + this run's advisories."""
        subjects = [self.dead_all]
        for stream in (self.tasks_stream, self.samples_stream):
            subjects.append(f"{ADVISORY_MAX_DELIVERIES}.{stream}.*")
            subjects.append(f"{ADVISORY_TERMINATED}.{stream}.*")
        return subjects

    # -- consumer groups
    def stream_of(self, group: Group) -> str:
        """The stream a consumer group reads: producers <- TASKS, trainers <- SAMPLES."""
        if group == PRODUCERS:
            return self.tasks_stream
        if group == TRAINERS:
            return self.samples_stream
        raise ConfigError(f"consumer group {group!r} is not one of 'producers', 'trainers'")

    def subject_of(self, group: Group) -> str:
        """The subject `group` consumes: producers <- tasks, trainers <- samples."""
        return (
            self.tasks
            if group == PRODUCERS
            else self.samples
            if group == TRAINERS
            else self.stream_of(group)
        )

    def kind_of_stream(self, stream: str) -> str:
        """ "tasks" / "samples" / "dead" for one of this run's streams."""
        kinds = {
            self.tasks_stream: "tasks",
            self.samples_stream: "samples",
            self.dead_stream: "dead",
        }
        if stream not in kinds:
            raise ConfigError(f"stream {stream!r} does not belong to run {self.run!r}")
        return kinds[stream]
