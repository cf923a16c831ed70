"""The demo's sampling workload for benchmarks: arithmetic prompts in the model's chat
template, one SampleRequest per group with the demo's settings (temperature 1, top-p 1)."""

from __future__ import annotations

from rollstream.generator.backends import SampleRequest, TransformersBackend
from rollstream.trainer import prompts


def arithmetic_requests(
    backend: TransformersBackend, groups: int, group_size: int, max_new_tokens: int
) -> tuple[list[prompts.Prompt], list[SampleRequest]]:
    """`groups` tasks from the seeded arithmetic source and their sampling requests (seeded per group)."""
    source = prompts.arithmetic(seed=0)
    tasks = [next(source) for _ in range(groups)]
    requests = [
        SampleRequest(backend.encode_chat(t.messages), group_size, 1.0, 1.0, 0, max_new_tokens, seed=i)
        for i, t in enumerate(tasks)
    ]
    return tasks, requests
