"""docs/custom-reward.md's commit script is the one both examples run (they are tested
against real Redis; the doc's copy must not drift from them)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _code(text: str) -> list[str]:
    """The script's lines without comments and blank lines, stripped."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("--")]


def test_the_doc_script_is_the_examples_script() -> None:
    doc = (ROOT / "docs" / "custom-reward.md").read_text()
    blocks = re.findall(r"```lua\n(.*?)```", doc, re.DOTALL)
    assert len(blocks) == 1, "one commit script in the doc"
    script = _code(blocks[0])
    python = re.search(
        r'COMMIT = """\n(.*?)"""', (ROOT / "examples" / "custom_reward" / "parity_reward.py").read_text(), re.DOTALL
    )
    node = re.search(
        r"const COMMIT = `\n(.*?)`;", (ROOT / "examples" / "custom_reward_node" / "reward.js").read_text(), re.DOTALL
    )
    assert python is not None and node is not None
    assert _code(python.group(1)) == script
    assert _code(node.group(1)) == script
