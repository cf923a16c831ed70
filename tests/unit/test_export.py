"""Export (trainer/export.py, `rollstream export`), in process on the tiny model trained a few
steps: the bfloat16 export is the trainer's served bits and the float32 one its fp32 masters,
bit for bit, from the live trainer and from its checkpoint, for full fine-tuning (split and
fp32 master layouts) and LoRA (the adapter folder loads with peft and merges to the served
bits; --merge writes them); transformers loads the folder and generates, the tokenizer comes
with its chat template; a trainer started from the export continues from exactly its bits;
bad input fails naming the cause, and an existing folder that is not an export is never touched."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rollstream.core import modeling
from rollstream.core.config import load_settings
from rollstream.core.service import ServiceHost
from rollstream.launcher import cli
from rollstream.trainer import export
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.trainer import Trainer
from synthetic import scored_groups  # tests/synthetic.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

STEPS = 2
FULL = {"split": {}, "fp32-layout": {"master_layout": "fp32", "moments_dtype": "float32"}}
LORA = {"lora_rank": 4, "lora_alpha": 8.0}


def make_trainer(model_dir: Path, **overrides: object) -> Trainer:
    values = {"model": str(model_dir), "lr": 2e-2, "max_new_tokens": 6, **overrides}
    settings = load_settings(TrainerSettings, [], **values)
    return Trainer(settings, ServiceHost("trainer", settings))


class Run:
    """A trainer trained STEPS steps, checkpointed at the end, and what it served then."""

    def __init__(self, model_dir: Path, root: Path, **overrides: object):
        self.model_dir = model_dir
        self.trainer = make_trainer(model_dir, **overrides)
        for step in range(1, STEPS + 1):
            self.trainer.train_step(scored_groups(100 + step, 2))
        self.served = {n: b.copy() for n, b in self.trainer.publisher.bits().items()}
        self.masters = {n: m.clone() for n, m in self.trainer.optimizer.master.items()}
        self.checkpoints = root / "checkpoints"
        self.checkpoint = self.trainer.save_checkpoint(self.checkpoints / "step-00000002")
        self.root = root


def trained(model_dir: Path, root: Path, **overrides: object) -> Iterator[Run]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # module-scoped: one_thread is not there yet
    r = Run(model_dir, root, **overrides)
    torch.set_num_threads(before)
    assert any(
        not np.array_equal(r.served[n], b) for n, b in modeling.model_bits(modeling.load_model(model_dir)[0]).items()
    )  # it moved
    yield r
    r.trainer.close()


@pytest.fixture(scope="module", params=list(FULL))
def run(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Run]:
    """Full fine-tuning, in the split and the fp32 master layout."""
    yield from trained(tiny_model_dir, tmp_path_factory.mktemp(request.param), **FULL[request.param])


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    yield from trained(tiny_model_dir, tmp_path_factory.mktemp("lora"), **LORA)


def weights_of(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported folder, read with safetensors' own reader (all shards)."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def peft_name(name: str) -> str:
    """An adapter's name in the trainer (peft's module path) as peft saves it (no adapter name)."""
    return name.replace(".default.", ".")


def bits(t: torch.Tensor) -> np.ndarray:
    return modeling.tensor_to_bits(t) if t.dtype == torch.bfloat16 else t.numpy()


def both_exports(r: Run, out: Path, dtype: export.Dtype, merge: bool = False) -> list[Path]:
    """The same step exported from the live trainer and from its checkpoint."""
    live = export.export(export.from_trainer(r.trainer), out / f"live-{dtype}-{merge}", dtype, merge=merge)
    saved = export.export(export.from_checkpoint(r.checkpoint), out / f"ckpt-{dtype}-{merge}", dtype, merge=merge)
    return [live, saved]


def test_full_weights_are_served_bits_and_masters(run: Run, tmp_path: Path) -> None:
    for folder in both_exports(run, tmp_path, "bfloat16"):
        got = weights_of(folder)
        assert got.keys() == run.served.keys()
        for name, served in run.served.items():
            assert got[name].dtype == torch.bfloat16 and np.array_equal(bits(got[name]), served), name
        assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
        record = json.loads((folder / export.MARKER).read_text())
        assert (record["kind"], record["step"], record["version"], record["dtype"]) == (
            "full",
            STEPS,
            STEPS,
            "bfloat16",
        )
    for folder in both_exports(run, tmp_path, "float32"):
        got = weights_of(folder)
        assert got.keys() == run.masters.keys()
        for name, master in run.masters.items():
            assert got[name].dtype == torch.float32 and torch.equal(got[name], master), name
        assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"


def test_lora_adapter_and_merge(lora_run: Run, tmp_path: Path) -> None:
    from peft import PeftModel

    run = lora_run
    adapter_bits = run.trainer.optimizer.published_bits()
    for folder in both_exports(run, tmp_path, "bfloat16"):
        assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= {
            p.name for p in folder.iterdir()
        }
        assert not (folder / "config.json").exists()  # an adapter, not a model
        saved = load_file(str(folder / "adapter_model.safetensors"))
        assert saved.keys() == {peft_name(n) for n in adapter_bits}
        for name, served in adapter_bits.items():
            assert saved[peft_name(name)].dtype == torch.bfloat16 and np.array_equal(
                bits(saved[peft_name(name)]), served
            ), name
        # peft loads it onto the base the trainer trained on (its bf16 rounding), and its own
        # merge, in fp32, rounds to the served bits.
        base, _ = modeling.load_model(run.model_dir)
        modeling.load_bits_(base, modeling.model_bits(base))
        merged = PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
        got = modeling.model_bits(merged)
        for name, served in run.served.items():
            assert np.array_equal(got[name], served), name
    for folder in both_exports(run, tmp_path, "float32"):
        saved = load_file(str(folder / "adapter_model.safetensors"))
        for name, master in run.masters.items():
            assert torch.equal(saved[peft_name(name)], master), name
    for folder in both_exports(run, tmp_path, "bfloat16", merge=True):
        got = weights_of(folder)
        assert got.keys() == run.served.keys()
        for name, served in run.served.items():
            assert np.array_equal(bits(got[name]), served), name
        assert json.loads((folder / export.MARKER).read_text())["kind"] == "lora-merged"
    # fp32 merged: the base as the base model has it, the adapters' masters merged by peft.
    adapter = export.export(export.from_trainer(run.trainer), tmp_path / "adapter32", "float32")
    base32, _ = modeling.load_model(run.model_dir)
    want = PeftModel.from_pretrained(base32, str(adapter)).merge_and_unload().state_dict()
    for folder in both_exports(run, tmp_path, "float32", merge=True):
        got = weights_of(folder)
        for name, value in got.items():
            assert torch.equal(value, want[name]), name


@pytest.mark.parametrize("kind", ["full", "lora-merged"])
def test_transformers_loads_and_generates(kind: str, run: Run, lora_run: Run, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merge = kind == "lora-merged"
    run = lora_run if merge else run
    folder = export.export(export.from_trainer(run.trainer), tmp_path / "model", merge=merge)
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(folder), local_files_only=True
    )  # Any: generate's typing wants a GenerativePreTrainedModel
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert model.dtype == torch.bfloat16
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    assert isinstance(text, str) and text.endswith("<|im_start|>assistant\n")  # the chat template came along
    inputs = tokenizer(text, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert (
        isinstance(out, torch.Tensor)
        and inputs["input_ids"].shape[1] < out.shape[1] <= inputs["input_ids"].shape[1] + 4
    )
    assert (folder / "generation_config.json").is_file()


def test_sharded_past_max_shard_size(run: Run, tmp_path: Path) -> None:
    folder = export.export(export.from_checkpoint(run.checkpoint), tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(run.served)
    got = weights_of(folder)
    for name, served in run.served.items():
        assert np.array_equal(bits(got[name]), served), name
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    assert modeling.model_bits(loaded).keys() >= run.served.keys()


@pytest.mark.parametrize("kind", ["full", "lora-merged"])
def test_a_trainer_continues_from_the_export(kind: str, run: Run, lora_run: Run, tmp_path: Path) -> None:
    merge = kind == "lora-merged"  # an adapter folder is not a model: --merge makes one
    run = lora_run if merge else run
    folder = export.export(export.from_trainer(run.trainer), tmp_path / "model", merge=merge)
    resumed = make_trainer(folder)
    try:
        for name, served in run.served.items():
            assert np.array_equal(resumed.publisher.bits()[name], served), name  # its version 0 is the export
        metrics, _, _ = resumed.train_step(scored_groups(200, 2))
        assert metrics.version == 1 and np.isfinite(metrics.loss)
        assert any(not np.array_equal(resumed.publisher.bits()[n], b) for n, b in run.served.items())
    finally:
        resumed.close()


@pytest.mark.parametrize("kind", ["full", "lora-merged"])
def test_cli_exports_the_latest_or_the_step_asked(
    kind: str, run: Run, lora_run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    merge = ["--merge"] if kind == "lora-merged" else []
    run = lora_run if merge else run
    out = tmp_path / "model"
    # The run folder (its checkpoints/), the checkpoint_dir and the checkpoint folder itself.
    for where in (run.root, run.checkpoints, run.checkpoint):
        assert cli.main_code(["export", str(where), "--out", str(out), *merge]) == 0
        assert str(out) in capsys.readouterr().out
        got = weights_of(out)
        assert all(np.array_equal(bits(got[n]), b) for n, b in run.served.items())
    assert (
        cli.main_code(["export", str(run.root), "--step", str(STEPS), "--dtype", "float32", "--out", str(out), *merge])
        == 0
    )
    assert json.loads((out / export.MARKER).read_text())["dtype"] == "float32"


def test_bad_input_names_the_cause(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model"

    def fails(*argv: str) -> str:
        assert cli.main_code(["export", *argv]) == 2
        captured = capsys.readouterr()
        assert not out.exists()
        return captured.err

    (tmp_path / "empty").mkdir()
    assert "is not a run" in fails(str(tmp_path / "empty"), "--out", str(out))
    assert "no such folder" in fails(str(tmp_path / "nowhere"), "--out", str(out))
    err = fails(str(run.root), "--step", "7", "--out", str(out))
    assert "no checkpoint of step 7" in err and f"the steps there are: {STEPS}" in err
    assert "merge is for LoRA runs" in fails(str(run.root), "--merge", "--out", str(out))
    # A torn checkpoint: its optimizer state cut short.
    torn_root = tmp_path / "torn"
    shutil.copytree(run.checkpoints, torn_root / "checkpoints")
    opt = torn_root / "checkpoints" / "step-00000002" / "optimizer.safetensors"
    with open(opt, "r+b") as f:
        f.truncate(opt.stat().st_size // 2)
    err = fails(str(torn_root), "--out", str(out))
    assert "no checkpoint" in err and "is whole" in err and "torn" in err
    assert "torn" in fails(str(torn_root), "--step", str(STEPS), "--out", str(out))
    assert "torn" in fails(str(torn_root / "checkpoints" / "step-00000002"), "--out", str(out))
    # An output folder that is not an export (here: the base model itself) is never touched.
    before = sorted(p.name for p in run.model_dir.iterdir())
    assert cli.main_code(["export", str(run.root), "--out", str(run.model_dir)]) == 2
    assert "is not an export" in capsys.readouterr().err
    assert sorted(p.name for p in run.model_dir.iterdir()) == before
    # An earlier export is replaced; an empty folder is taken.
    out.mkdir()
    assert cli.main_code(["export", str(run.root), "--out", str(out)]) == 0
    assert cli.main_code(["export", str(run.root), "--dtype", "float32", "--out", str(out)]) == 0
    assert json.loads((out / export.MARKER).read_text())["dtype"] == "float32"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folder left
