"""The prompt feeder: keeps `prompt_buffer` tasks waiting in rs:{<run>}:prompts.

Its position (prompts fed so far) lives in Redis, written in the same atomic script as the
tasks it counts, so a restarted trainer continues the seeded prompt source exactly where the
stream left it: no prompt is fed twice and none is skipped, whichever checkpoint it resumed.
"""

from __future__ import annotations

import itertools

from rollstream.core import codec, redis_policy, streams
from rollstream.trainer import prompts
from rollstream.trainer.config import TrainerSettings
from rollstream.v1 import rollout_pb2


class PromptFeeder:
    def __init__(self, settings: TrainerSettings, client: redis_policy.Client, stage: streams.StreamStage, fed: int):
        self.settings = settings
        self.client = client
        self.stage = stage  # runs the feeder's writes through the run's commit script
        self.keys = stage.keys
        self.source = prompts.from_settings(settings)
        # Sources are seeded: drawing `fed` prompts and dropping them puts this one where the
        # run left off (itertools' "consume" recipe).
        next(itertools.islice(self.source, fed, fed), None)
        self.fed = fed

    @staticmethod
    def position(client: redis_policy.Client, keys: streams.RunKeys, checkpoint_fed: int) -> int:
        """Prompts fed so far: Redis's count, else (a run from before it was kept) the checkpoint's."""
        value = client.get(keys.fed)
        return int(value) if value is not None else checkpoint_fed

    def top_up(self, version: int) -> int:
        s = self.settings
        stream = self.keys.stream("prompts")
        streams.trim_acknowledged(self.client, stream)
        missing = s.prompt_buffer - streams.waiting(self.client, stream, limit=s.prompt_buffer)
        if missing <= 0:
            return 0
        ops = streams.Ops()
        for n, p in zip(range(self.fed, self.fed + missing), itertools.islice(self.source, missing)):
            task = rollout_pb2.PromptTask(
                # The generator seeds the group by what follows "<run>-" (generator.task_seed),
                # so the samples do not depend on the run's name.
                task_id=f"{self.keys.run}-{n:08d}",
                messages=[rollout_pb2.ChatMessage(role=r, content=c) for r, c in p.messages],
                answer=p.answer,
                group_size=s.group_size,
                sampling=rollout_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens),
                fed_at_version=version,
                task_kind=p.task_kind,
                metadata_json=p.metadata_json,
            )
            ops.xadd(stream, codec.encode(task))
        ops.set(self.keys.fed, self.fed + missing)
        self.stage.apply(ops)
        self.fed += missing
        return missing
