"""trainer/sft_data.py: datasets to packed SFT rows, with the tests' tiny model's real tokenizer.

The labels each format gets, every refusal (row and field named, every bad row listed, nothing
returned), best-fit-decreasing packing (TRL's documented example; no example split; TRL's
slices of 1,000), packed_batch (positions restart; the mask block-diagonal and causal; each
example's log-probs those it has alone), and TRL 1.16 itself on the same data where .venv-trl
exists (benchmarks/trl_sft_data.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from rollstream.core import modeling
from rollstream.trainer import sft_data
from rollstream.trainer.sft_data import IGNORE, Example, SftDataConfig, SftDataError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import trl_sft_data  # noqa: E402 - benchmarks/ is on the path only once ROOT is known (its dataset and marked ChatML template)

TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


def chat(*turns: str) -> dict[str, Any]:
    """A conversation: user, assistant, user, ... in turn."""
    roles = ("user", "assistant")
    return {"messages": [{"role": roles[k % 2], "content": text} for k, text in enumerate(turns)]}


def labelled_text(tokenizer: Any, ids: list[int], labels: list[int]) -> str:
    return tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE])


def one(rows: list[dict[str, Any]], tokenizer: Any, **config: Any) -> sft_data.PackedRow:
    data = sft_data.prepare_rows(rows, tokenizer, SftDataConfig(packing=False, **config))
    assert len(data.rows) == 1
    return data.rows[0]


def test_messages_take_loss_on_the_assistants_turns_only(tokenizer: Any) -> None:
    row = one([chat("What is 1 + 2?", "3", "And 4 + 4?", "The answer is 8.")], tokenizer)
    assert labelled_text(tokenizer, row.input_ids, row.labels) == "3<|im_end|>\nThe answer is 8.<|im_end|>\n"
    # The template's own markers, where it has them, mark the same tokens (TRL's way).
    marked = AutoTokenizer.from_pretrained(tokenizer.name_or_path, local_files_only=True)
    marked.chat_template = trl_sft_data.MARKED_CHATML
    assert one([chat("What is 1 + 2?", "3", "And 4 + 4?", "The answer is 8.")], marked) == row


def test_all_tokens_takes_loss_on_every_token(tokenizer: Any) -> None:
    row = one([chat("What is 1 + 2?", "3")], tokenizer, all_tokens=True)
    assert row.labels == row.input_ids
    assert tokenizer.decode(row.input_ids).startswith("<|im_start|>user\nWhat is 1 + 2?")


def test_prompt_completion_takes_loss_on_the_completion_and_its_eos(tokenizer: Any) -> None:
    row = one([{"prompt": "What is 1 + 2?", "completion": " The answer is 3."}], tokenizer)
    assert labelled_text(tokenizer, row.input_ids, row.labels) == " The answer is 3.<|im_end|>"
    conversational = {
        "prompt": [{"role": "user", "content": "What is 1 + 2?"}],
        "completion": [{"role": "assistant", "content": "3"}],
    }
    row = one([conversational], tokenizer)
    assert labelled_text(tokenizer, row.input_ids, row.labels) == "3<|im_end|>\n"


def test_a_jsonl_file_and_a_saved_dataset_give_the_same_rows(tokenizer: Any, tmp_path: Path) -> None:
    import datasets

    rows = trl_sft_data.dataset("messages", 12)
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n\n" for r in rows))  # blank lines are skipped
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    config = SftDataConfig(max_length=128)
    from_file = sft_data.prepare(jsonl, tokenizer, config)
    from_folder = sft_data.prepare(tmp_path / "saved", tokenizer, config)
    assert from_file == from_folder and from_file.examples == 12
    with pytest.raises(ValueError, match="no split 'test'"):
        sft_data.prepare(tmp_path / "saved", tokenizer, SftDataConfig(split="test"))


def refused(rows: list[Any], tokenizer: Any, **config: Any) -> list[str]:
    with pytest.raises(SftDataError) as caught:
        sft_data.prepare_rows(rows, tokenizer, SftDataConfig(**config))
    return [str(p) for p in caught.value.problems]


GOOD = chat("What is 1 + 2?", "3")


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ({"text": "hello"}, "row 1, messages: missing"),
        ({"messages": []}, "row 1, messages: a non-empty list"),
        ({"messages": [{"content": "hi"}]}, "row 1, messages[0].role: missing"),
        ({"messages": [{"role": "user"}]}, "row 1, messages[0].content: missing"),
        ({"messages": [{"role": "user", "content": 7}]}, "row 1, messages[0].content: a string expected"),
        (chat("What is 1 + 2?", "  "), "row 1, messages[1].content: empty assistant turn"),
        ({"messages": [{"role": "narrator", "content": "Once"}]}, "row 1, messages[0].role: 'narrator' is not a role"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "row 1, messages: no assistant turn"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "row 1, messages[0].role: a conversation cannot open"),
        (chat("What is 1 + 2? " * 40, "3"), "row 1, length: 3"),  # "3xx tokens, longer than max_length 64"
    ],
)
def test_each_bad_conversation_is_refused_by_row_and_field(tokenizer: Any, bad: Any, expected: str) -> None:
    problems = refused([GOOD, bad], tokenizer, max_length=64)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ({"prompt": "What is 1 + 2?"}, "row 1, completion: missing"),
        ({"completion": "3"}, "row 1, prompt: missing"),
        ({"prompt": "What is 1 + 2?", "completion": ""}, "row 1, completion: empty completion"),
        (
            {"prompt": [{"role": "user", "content": "hi"}], "completion": "3"},
            "row 1, completion: prompt and completion",
        ),
        (
            {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": ""}]},
            "row 1, completion[0].content: empty assistant turn",
        ),
    ],
)
def test_each_bad_prompt_completion_is_refused_by_row_and_field(tokenizer: Any, bad: Any, expected: str) -> None:
    problems = refused([{"prompt": "What is 1 + 2?", "completion": " 3"}, bad], tokenizer)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_every_bad_row_is_named_at_once(tokenizer: Any) -> None:
    rows = [GOOD, chat("hi", ""), GOOD, chat("What is 1 + 2? " * 40, "3"), GOOD]
    problems = refused(rows, tokenizer, max_length=64)
    assert [p.split(",")[0] for p in problems] == ["row 1", "row 3"]


def test_roles_the_template_refuses_or_drops_are_refused(tokenizer: Any) -> None:
    strict = AutoTokenizer.from_pretrained(tokenizer.name_or_path, local_files_only=True)
    strict.chat_template = (  # user and assistant only, a system message refused, a tool message dropped
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% elif m['role'] in ['user', 'assistant'] %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
        "{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    system = {"messages": [{"role": "system", "content": "Be brief."}, *GOOD["messages"]]}
    tool = {"messages": [*GOOD["messages"], {"role": "tool", "content": "42"}, {"role": "assistant", "content": "4"}]}
    problems = refused([GOOD, system, tool], strict)
    assert problems[0].startswith("row 1, messages: the chat template refuses it: no system role"), problems
    assert problems[1].startswith("row 2, messages: message 2: role 'tool' is not rendered"), problems


def test_a_bad_jsonl_line_names_its_row_and_line(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n{not json\n")
    with pytest.raises(SftDataError, match="row 1, line 3: not JSON"):
        sft_data.prepare(path, tokenizer, SftDataConfig())
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(chat("hi", "")) + "\n")
    with pytest.raises(SftDataError, match=r"row 1 \(line 3\), messages\[1\].content: empty assistant turn"):
        sft_data.prepare(path, tokenizer, SftDataConfig())


def test_truncation_cuts_as_trl_does_and_drops_rows_left_without_loss(tokenizer: Any) -> None:
    long_answer = chat("What is 1 + 2?", "Sure! Let me think step by step. " * 6 + "3")
    long_prompt = chat("What is 1 + 2? " * 20, "3")
    data = sft_data.prepare_rows(
        [long_answer, long_prompt], tokenizer, SftDataConfig(max_length=32, packing=False, truncate=True)
    )
    assert (data.truncated, data.dropped) == (2, 1)  # the long prompt leaves no assistant token in 32
    assert (
        len(data.rows) == 1 and data.rows[0].input_ids == one([long_answer], tokenizer, all_tokens=True).input_ids[:32]
    )
    # Packed, TRL keeps such an example: it fills a row, takes no loss.
    packed = sft_data.prepare_rows([long_answer, long_prompt], tokenizer, SftDataConfig(max_length=32, truncate=True))
    assert [r.seq_lengths for r in packed.rows] == [[32], [32]] and packed.dropped == 0


def examples(*token_lists: list[int]) -> list[Example]:
    return [Example(i, list(ids), list(ids)) for i, ids in enumerate(token_lists)]


def test_best_fit_decreasing_packs_trls_documented_example() -> None:
    # TRL's pack_dataset docstring: [[1..5], [6, 7], [8, 9, 10], [11]] at 4 tokens, "bfd" (the
    # first truncated to 4) -> [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]], seq_lengths [[4], [3, 1], [2]].
    cut = [Example(e.row, e.input_ids[:4], e.labels[:4]) for e in examples([1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11])]
    rows = sft_data.pack_bfd(cut, 4)
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]]
    assert [r.seq_lengths for r in rows] == [[4], [3, 1], [2]] and [r.rows for r in rows] == [[0], [2, 3], [1]]
    assert [r.position_ids for r in rows] == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1]]


def test_packing_keeps_every_example_whole(tokenizer: Any) -> None:
    data = sft_data.prepare_rows(trl_sft_data.dataset("messages", 80), tokenizer, SftDataConfig(max_length=128))
    alone = sft_data.prepare_rows(
        trl_sft_data.dataset("messages", 80), tokenizer, SftDataConfig(max_length=128, packing=False)
    )
    by_row = {r.rows[0]: r for r in alone.rows}
    seen = []
    for r in data.rows:
        assert len(r.input_ids) <= 128 and sum(r.seq_lengths) == len(r.input_ids) == len(r.labels)
        at = 0
        for n, source in zip(r.seq_lengths, r.rows, strict=True):
            assert (
                r.input_ids[at : at + n] == by_row[source].input_ids and r.labels[at : at + n] == by_row[source].labels
            )
            at += n
        seen += r.rows
    assert sorted(seen) == list(range(80))
    assert len(data.rows) < 80 / 2  # short chats: several to a row
    assert data.loss_tokens == len(sft_data.packed_batch(data.rows, 3).targets) > 0


def test_packing_runs_in_trls_slices_of_a_thousand() -> None:
    rows = sft_data.pack_bfd(examples(*[[7]] * 1001), 1000)
    assert [len(r.input_ids) for r in rows] == [1000, 1]  # not one row of 1000 then 1: the slice decides
    assert rows[1].rows == [1000]


def segments(rows: list[sft_data.PackedRow], width: int) -> torch.Tensor:
    """Each position's example in its row (-2: padding), as modeling.segment_mask reads them."""
    segment = torch.full((len(rows), width), -2, dtype=torch.long)
    for b, r in enumerate(rows):
        at = 0
        for k, n in enumerate(r.seq_lengths):
            segment[b, at : at + n] = k
            at += n
    return segment


def attention_seen(model: Any, batch: modeling.Batch) -> torch.Tensor | None:
    """Which keys each query sees [B, T, T], as transformers' masking utils build it for this
    batch (None: plain causal attention, no mask)."""
    from transformers.masking_utils import create_causal_mask

    embeds = model.get_input_embeddings()(batch.input_ids)
    mask = create_causal_mask(model.config, embeds, batch.attention_mask, None, position_ids=batch.position_ids)
    assert mask is None or isinstance(mask, torch.Tensor)
    return None if mask is None else mask[:, 0]


def test_packed_batch_restarts_positions_and_blocks_attention(tiny_model_dir: Path, tokenizer: Any) -> None:
    a, b, c = [5, 6, 7], [8, 9], [10, 11, 12, 13]
    rows = [
        sft_data.PackedRow(a + b, [IGNORE, 6, 7, IGNORE, 9], [3, 2], [0, 1]),
        sft_data.PackedRow(c, [10, 11, IGNORE, 13], [4], [2]),
    ]
    batch = sft_data.packed_batch(rows, pad_id=0)
    assert batch.position_ids is not None and batch.position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [10, 11, 12, 13, 0]]
    # Targets: labelled tokens but each example's first, predicted from the position before.
    assert list(zip(batch.rows.tolist(), batch.cols.tolist(), batch.targets.tolist(), strict=True)) == [
        (0, 0, 6),
        (0, 1, 7),
        (0, 3, 9),
        (1, 0, 11),
        (1, 2, 13),
    ]
    assert batch.lengths == [2, 1, 2] and [r.loss_tokens for r in rows] == [3, 2]
    # No mask of ours: transformers cuts each row where its positions restart.
    assert batch.attention_mask is None
    model, _ = modeling.load_model(tiny_model_dir)
    seen = attention_seen(model, batch)
    assert seen is not None
    segment = [[0, 0, 0, 1, 1], [0, 0, 0, 0, -2]]
    for r in range(2):
        for q in range(5):
            for k in range(5):
                same = segment[r][q] == segment[r][k] and k <= q  # padding: a segment of its own
                assert bool(seen[r, q, k]) == same, (r, q, k)


def test_a_row_of_one_example_gets_no_mask(tiny_model_dir: Path) -> None:
    """The long-row case: one example filling its row is plain causal attention, no [T, T]
    mask anywhere (SDPA's is_causal kernels)."""
    model, _ = modeling.load_model(tiny_model_dir)
    rows = [sft_data.PackedRow(list(range(5, 5 + n)), list(range(5, 5 + n)), [n], [k]) for k, n in enumerate([9, 9])]
    assert attention_seen(model, sft_data.packed_batch(rows, pad_id=0)) is None


def test_without_the_mask_log_probs_equal_the_masks(tiny_model_dir: Path, tokenizer: Any) -> None:
    """Micro-batches of packed rows of unequal widths: the log-probs with transformers' own
    attention from the positions equal those with the block-diagonal additive mask
    (modeling.segment_mask, what packed_batch passed before and GRPO's shared batch passes)."""
    model, _ = modeling.load_model(tiny_model_dir)
    data = sft_data.prepare_rows(trl_sft_data.dataset("messages", 12), tokenizer, SftDataConfig(max_length=128))
    rows = data.rows[:4]
    assert len({len(r.input_ids) for r in rows}) > 1 and max(len(r.seq_lengths) for r in rows) >= 2
    with torch.no_grad():
        for micro in ([0], [0, 1, 2, 3], [3, 1]):
            picked = [rows[i] for i in micro]
            batch = sft_data.packed_batch(picked, 3)
            width = batch.input_ids.shape[1]
            masked = dataclasses.replace(
                batch, attention_mask=modeling.segment_mask(segments(picked, width), torch.float32)
            )
            ours, _ = modeling.completion_logprobs(model, batch)
            theirs, _ = modeling.completion_logprobs(model, masked)
            assert torch.allclose(ours, theirs, rtol=0, atol=1e-5), (micro, (ours - theirs).abs().max())


def test_a_packed_row_gives_each_example_its_log_probs_alone(tiny_model_dir: Path, tokenizer: Any) -> None:
    model, _ = modeling.load_model(tiny_model_dir)
    data = sft_data.prepare_rows(trl_sft_data.dataset("messages", 6), tokenizer, SftDataConfig(max_length=128))
    row = max(data.rows, key=lambda r: len(r.seq_lengths))
    assert len(row.seq_lengths) >= 2
    with torch.no_grad():
        packed, _ = modeling.completion_logprobs(model, sft_data.packed_batch([row], 3))
        at, alone = 0, []
        for n, source in zip(row.seq_lengths, row.rows, strict=True):
            single = sft_data.PackedRow(row.input_ids[at : at + n], row.labels[at : at + n], [n], [source])
            logps, _ = modeling.completion_logprobs(model, sft_data.packed_batch([single], 3))
            alone.append(logps)
            at += n
    assert torch.allclose(packed, torch.cat(alone), rtol=0, atol=1e-5), (packed - torch.cat(alone)).abs().max()


@pytest.mark.skipif(
    not TRL_PYTHON.exists(), reason="no .venv-trl: run `bash scripts/install_trl.sh` to compare with TRL"
)
@pytest.mark.parametrize(
    "args",
    [
        ["--case", "messages", "--rows", "1200", "--ours-own-template"],
        ["--case", "messages_all"],
        ["--case", "prompt_completion", "--truncate", "--max-length", "40"],
        ["--case", "conversational_pc", "--no-packing"],
    ],
)
def test_rows_equal_trls(tiny_model_dir: Path, args: list[str]) -> None:
    out = subprocess.run(
        [str(TRL_PYTHON), str(ROOT / "benchmarks" / "trl_sft_data.py"), "--model", str(tiny_model_dir)]
        + ["--max-length", "128", "--compare", *args],
        capture_output=True,
        text=True,
        check=False,
        # The trackers' tests leave WANDB_MODE=offline in this process (trackers.py sets it for
        # the trainer's whole process), and with it TRL's side prints a line to stdout.
        env={k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("{"), f"not the script's JSON: stdout starts {out.stdout[:500]!r}"
    report = json.loads(out.stdout)
    assert report["trl"] == "1.16.0" and report["rows"] > 0
    assert report["equal"], report["first_difference"]
