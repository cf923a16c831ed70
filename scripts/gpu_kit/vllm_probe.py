"""Kit 3's first check (checks.py `vllm_import`): what the installed vLLM is and what it will ask for.

    python scripts/gpu_kit/vllm_probe.py --device cuda|cpu --kit KIT       (run by checks.py)

Prints one JSON object:
  import_s, vllm, vllm_from, torch, torch_cuda: `from vllm import LLM` from the kit's install;
  left_out: the files of the vLLM wheel the kit does not carry (build.py's PRUNE), whether
    each is installed (a fallback kit puts them back) and the fallback kit that carries it;
  kernels: each compiled module of vLLM loaded after torch, `ok` or why not (on the CPU
    the finding is which CUDA library it needs first: libcuda.so.1);
  flash_attn: FA2 and FA3 available or why not, and (CUDA) the version the engine asks for;
  engine (CUDA): a tiny random-weight Qwen2 (benchmarks/shapes.py) in bf16, eager, generating
    8 greedy tokens; the lines it printed naming its attention backend, FlashAttention, or a
    library or symbol it could not find (all it printed is in the check's log);
  asked_for_missing: every left-out file the engine asked for (an error or a log line naming
    it, or FA2 chosen while absent), with the fallback kit to carry: then this exits 1.
Exits 1 too if the import or the engine fails.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

# vLLM's compiled modules (FlashAttention's two are in flash_attn below: their package refuses
# to import when neither loads).
KERNELS = ["vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch", "vllm._flashmla_C", "vllm.cumem_allocator"]


def said_to_stderr(text: str) -> list[str]:
    """The lines of what vLLM printed that say which backend or kernel it takes, or failed to."""
    words = (
        "attention backend",
        "attn_backend",
        "flash",
        "failed to import",
        "not found",
        "undefined symbol",
        "cannot open shared",
    )
    return list(dict.fromkeys(line[:300] for line in text.splitlines() if any(w in line.lower() for w in words)))


def engine() -> dict[str, object]:
    """A tiny engine generating: seconds to start, tokens, or the error; and its log lines that
    name a backend or kernel. What it prints is caught at file descriptor 2 (vLLM configures
    its logging itself, differently across releases) and passed on to stderr after."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import shapes
    from vllm import LLM, SamplingParams

    out: dict[str, object]
    with tempfile.TemporaryDirectory(prefix="rs-vllm-probe-") as tmp, tempfile.TemporaryFile() as caught:
        folder = shapes.save_model_folder("tiny", str(Path(tmp) / "tiny"))
        start = time.perf_counter()
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            llm = LLM(
                model=folder,
                dtype="bfloat16",
                enforce_eager=True,
                gpu_memory_utilization=0.15,
                max_model_len=256,
                seed=0,
            )
            started = time.perf_counter() - start
            generated = llm.generate(
                [{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False
            )
            out = {"ok": True, "start_s": round(started, 1), "tokens": list(generated[0].outputs[0].token_ids)}
        except Exception:  # noqa: BLE001  (what the engine asked for and did not find is the finding)
            out = {"ok": False, "error": traceback.format_exc(limit=6)[-3000:]}
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        text = caught.read().decode(errors="replace")
    sys.stderr.write(text)
    return {**out, "log": said_to_stderr(text)}


def asked_for_missing(left_out: dict[str, dict], said: str, fa_version: object) -> list[str]:
    """Each left-out file, not put back, that the engine asked for: FA2's when it chose FA2, any
    named in what the engine said (its error, its log lines) by its module (_vllm_fa2_C), its
    ops' namespace (torch.ops._moe_C) or itself (vllm-rs); each with the fallback kit to carry."""
    asked = [
        m
        for m in left_out
        if (fa_version == 2 and m.endswith("_vllm_fa2_C.abi3.so"))
        or Path(m).name.split(".")[0].removesuffix("_stable_libtorch") in said
    ]
    return [
        f"{m}: the engine asked for it and the kit left it out (build.py PRUNE): carry the fallback kit {left_out[m]['fallback']} "
        f"(its calls, in order), which puts it back and runs these checks again"
        for m in asked
        if not left_out[m]["installed"]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument(
        "--kit", type=Path, required=True, help="the kit's folder (its manifest.json names what it left out)"
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its log lines are ours
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for the JSON
    manifest = json.loads((args.kit / "manifest.json").read_text())
    out: dict[str, object] = {"device": args.device}
    start = time.perf_counter()
    try:
        from vllm import LLM  # noqa: F401  (the import itself is the check)
    except Exception:  # noqa: BLE001  (however the import fails, its traceback is the finding)
        out["import_error"] = traceback.format_exc(limit=8)[-3000:]
        print(json.dumps(out, indent=1))
        sys.exit(1)
    import torch

    import vllm

    package = Path(vllm.__file__).parent
    out |= {
        "import_s": round(time.perf_counter() - start, 1),
        "vllm": vllm.__version__,
        "vllm_from": str(package),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    left_out = {
        m: {**info, "installed": (package.parent / m).exists()} for m, info in manifest.get("pruned", {}).items()
    }
    out["left_out"] = left_out
    kernels = {}
    for module in KERNELS:
        try:
            importlib.import_module(module)
            kernels[module] = "ok"
        except ImportError as e:
            kernels[module] = str(e)[:300]
    out["kernels"] = kernels
    flash: dict[str, object] = {}
    ran: dict[str, object] = {}  # the tiny engine's run (CUDA only)
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fa
    except (
        ImportError
    ) as e:  # neither FA2 nor FA3 loads (the CPU): the interface module was imported before the package refused
        flash["package"] = str(e)
        fa = sys.modules["vllm.vllm_flash_attn.flash_attn_interface"]
    flash |= {"fa2": fa.FA2_UNAVAILABLE_REASON or "ok", "fa3": fa.FA3_UNAVAILABLE_REASON or "ok"}
    if args.device == "cuda":
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

        flash["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        flash["engine_asks_for"] = get_flash_attn_version(head_size=64)
        out["engine"] = ran = engine()
    out["flash_attn"] = flash
    out["asked_for_missing"] = asked_for_missing(
        left_out, json.dumps(out.get("engine", {})), flash.get("engine_asks_for")
    )
    print(json.dumps(out, indent=1))
    failed = bool(out["asked_for_missing"]) or (args.device == "cuda" and not ran["ok"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
