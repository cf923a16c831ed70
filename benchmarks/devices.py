"""`--device` for the benchmarks: cpu (the default) or cuda, checked up front, and what the
JSON output records about it."""

from __future__ import annotations

import argparse
import sys

import torch

CHOICES = ("cpu", "cuda")


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=CHOICES,
        default="cpu",
        help="compute device (cpu: the default; cuda needs a GPU torch can see)",
    )


def resolve(name: str) -> torch.device:
    """The torch device for `--device`; exits with a clear message when cuda is asked for
    and torch cannot use it."""
    if name == "cuda" and not torch.cuda.is_available():
        reason = (
            "this torch was built without CUDA"
            if torch.version.cuda is None
            else "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES?)"
        )
        sys.exit(
            f"--device cuda: torch {torch.__version__} cannot use CUDA here: {reason}. Run with --device cpu, or on a machine with a GPU."
        )
    return torch.device(name)


def info(device: torch.device) -> dict[str, str | None]:
    """Keys added to every benchmark's JSON: the device, its name, torch's version."""
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
    }
