"""Export with real processes: a trainer service stopped with SIGTERM (what `rollstream up`
sends on Ctrl-C), with a push to count, leaves its export_dir holding the model it served, bit for bit; a `rollstream
export` killed with kill -9 in the middle of writing leaves nothing under --out, and the next
export writes the folder (and removes the dead one's temp folder)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from safetensors.torch import load_file

from helpers import wait_for, write_ready
from procs import free_port, start_service, trainer_state
from rollstream.core import deltas, modeling, run_keys
from rollstream.core.config import load_settings
from rollstream.core.service import ServiceHost
from rollstream.trainer import export
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.trainer import Trainer
from synthetic import Decode, scored_groups


def exported_bits(folder: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for file in folder.glob("*.safetensors"):
        out.update({name: modeling.tensor_to_bits(t) for name, t in load_file(str(file)).items()})
    return out


def test_a_stopped_trainer_exports_what_it_served(
    redis_url: str,
    rclient: redis.Redis,
    keys: run_keys.RunKeys,
    tiny_model_dir: Path,
    tiny_decode: Decode,
    tmp_path: Path,
) -> None:
    out = tmp_path / "model"
    trainer = start_service(
        "trainer",
        tmp_path,
        "--redis-url",
        redis_url,
        "--run",
        keys.run,
        "--model",
        str(tiny_model_dir),
        "--threads",
        "1",
        "--consumer",
        "trainer-0",
        "--groups-per-step",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "6",
        "--prompt-buffer",
        "2",
        "--lr",
        "1e-2",
        "--max-staleness",
        "100",
        "--block-ms",
        "100",
        "--export-dir",
        str(out),  # --steps 0: until stopped
        # A generator that is not there: each step's push has an outcome, which the stop
        # counts in Redis before the export (a stopped service's Redis calls raise Stopped).
        "--generators",
        f"127.0.0.1:{free_port()}",
    ).wait_ready()
    try:
        write_ready(rclient, keys, scored_groups(1, 2, "s", group_size=2), tiny_decode)
        wait_for(lambda: trainer_state(trainer.grpc_address).step == 1, 120, "step 1", [trainer])
        served = trainer_state(trainer.grpc_address, sha=True)
        assert served.version == 1
        assert trainer.stop() == 0
    finally:
        trainer.kill()
    record = json.loads((out / export.MARKER).read_text())
    assert (record["kind"], record["step"], record["version"], record["dtype"]) == ("full", 1, 1, "bfloat16")
    assert deltas.weights_sha256(exported_bits(out)) == served.weights_sha256
    assert any("exported" in line and str(out) in line for line in trainer.log().splitlines())


def bigger_checkpoint(tiny_model_dir: Path, root: Path) -> Path:
    """A checkpoint of a model large enough that writing its fp32 export takes a while (16M
    parameters, 64 MB): the tiny model's tokenizer, a wider, deeper Llama."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = root / "bigger-model"
    shutil.copytree(tiny_model_dir, folder)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads = 512, 2048, 4, 8
    config.num_key_value_heads, config.head_dim = 4, 64
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    settings = load_settings(TrainerSettings, [], model=str(folder), max_new_tokens=6)
    trainer = Trainer(settings, ServiceHost("trainer", settings))
    try:
        return trainer.save_checkpoint(root / "checkpoints" / "step-00000000")
    finally:
        trainer.close()


def export_cmd(run: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rollstream.launcher.cli",
        "export",
        str(run),
        "--dtype",
        "float32",
        "--out",
        str(out),
    ]


@pytest.mark.usefixtures("one_thread")
def test_kill_9_mid_export_leaves_no_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    bigger_checkpoint(tiny_model_dir, tmp_path)
    out = tmp_path / "model"
    # kill -9 as soon as the temp folder holds a file (config.json: the weights come next). A
    # kill that comes after the rename proves nothing: then again (the export is not timed).
    for _attempt in range(3):
        proc = subprocess.Popen(export_cmd(tmp_path, out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            temp = tmp_path / f".model.export-tmp-{proc.pid}"
            wait_for(
                lambda: (temp.is_dir() and any(temp.iterdir())) or proc.poll() is not None,
                300,
                "the export's temp folder",
                poll_s=0.002,
            )
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        if temp.is_dir():  # killed before the rename: mid-write
            break
        assert proc.returncode == -signal.SIGKILL or proc.returncode == 0, proc.stdout.read() if proc.stdout else ""
        shutil.rmtree(out, ignore_errors=True)
    else:
        pytest.fail("three exports finished before the kill landed: the model is too small to catch one mid-write")
    assert not out.exists(), f"a killed export left {sorted(p.name for p in out.iterdir())} under --out"
    assert proc.returncode == -signal.SIGKILL
    # The next export writes the whole folder and removes the killed one's temp folder.
    done = subprocess.run(export_cmd(tmp_path, out), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((out / export.MARKER).read_text())["dtype"] == "float32"
    assert not temp.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).dtype == torch.float32
