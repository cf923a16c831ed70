"""TRL 1.16 SFTTrainer's prepared rows beside rollstream's (trainer/sft_data.py), on one dataset.

Runs in TRL's venv (`bash scripts/install_trl.sh`; rollstream's core and trainer are installed
there too), so both sides use the same tokenizer library on the same model folder:

  .venv-trl/bin/python benchmarks/trl_sft_data.py --case messages --rows 1200 --max-length 96

TRL's side is SFTTrainer's own preparation (its train_dataset after __init__: tokenize, labels,
truncation, bfd packing) and its collator (position ids; labels of each example's first token
dropped); nothing of TRL is copied. Prints one JSON object: TRL's rows (input_ids, labels,
seq_lengths, position_ids), and with --compare, whether rollstream's rows equal them and the
first difference. Cases:

  messages           conversations, loss on the assistant's tokens: both sides get a ChatML
                     template with {% generation %} markers (TRL refuses assistant-only loss on
                     a template without them); with --ours-own-template rollstream's side keeps
                     the model's unmarked template and finds the assistant's tokens turn by turn
                     (equal rows only where MARKED_CHATML is that template plus markers: the
                     tests' tiny model; SmolLM2's adds a default system message)
  messages_all       conversations, loss on every token, the model's own template (TRL's default)
  prompt_completion  plain-text prompt and completion, loss on the completion (TRL's default)
  conversational_pc  prompt and completion as message lists, loss on the completion

--data FILE.jsonl replaces the built-in dataset (deterministic arithmetic chats, lengths varied
so that best-fit packing has ties and choices to make; more than 1,000 rows exercise TRL's
slices of 1,000).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

# ChatML (the tests' tiny model and SmolLM2 speak it) with the assistant's text and end-of-turn
# tokens inside {% generation %}: the span TRL's ChatML training templates mark.
MARKED_CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CASES = ("messages", "messages_all", "prompt_completion", "conversational_pc")


def dataset(case: str, rows: int, seed: int = 0) -> list[dict[str, Any]]:
    """Arithmetic chats of one to three turns, some with a system message."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        messages: list[dict[str, str]] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": "You are a helpful assistant."})
        for _turn in range(rng.choice((1, 1, 2, 3))):
            a, b = rng.randrange(20), rng.randrange(20)
            messages.append({"role": "user", "content": f"What is {a} + {b}?"})
            answer = f"{a + b}" if rng.random() < 0.5 else f"Sure! Let me think step by step. The answer is {a + b}."
            messages.append({"role": "assistant", "content": answer})
        if case in ("messages", "messages_all"):
            out.append({"messages": messages})
        elif case == "conversational_pc":
            out.append({"prompt": messages[:-1], "completion": messages[-1:]})
        else:
            prompt = " ".join(m["content"] for m in messages[:-1])
            out.append({"prompt": prompt, "completion": " " + messages[-1]["content"]})
    return out


def trl_rows(model: str, rows: list[dict], args: argparse.Namespace, template: str | None) -> list[dict]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    if template is not None:
        tokenizer.chat_template = template
    with tempfile.TemporaryDirectory(prefix="trl-sft-data-") as out:
        config = SFTConfig(
            output_dir=out,
            max_length=args.max_length,
            packing=not args.no_packing,
            assistant_only_loss=args.case == "messages",
            report_to="none",
            use_cpu=True,
            seed=0,
        )
        trainer = SFTTrainer(
            model=AutoModelForCausalLM.from_pretrained(model, local_files_only=True),
            args=config,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tokenizer,
        )
        prepared = trainer.train_dataset.to_list()
        collate = trainer.data_collator
    result = []
    for row in prepared:
        batch = collate([row])  # one row: its positions and the labels the loss reads
        positions = batch["position_ids"][0] if "position_ids" in batch else None
        result.append(
            {
                "input_ids": row["input_ids"],
                "labels": row["labels"],
                "seq_lengths": row.get("seq_lengths", [len(row["input_ids"])]),
                "position_ids": positions.tolist() if positions is not None else list(range(len(row["input_ids"]))),
                "targets": [t for t, label in enumerate(batch["labels"][0].tolist()) if label != -100 and t > 0],
            }
        )
    return result


def our_rows(model: str, rows: list[dict], args: argparse.Namespace, template: str | None) -> list[dict]:
    from transformers import AutoTokenizer

    from rollstream.trainer import sft_data

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    if template is not None:
        tokenizer.chat_template = template
    config = sft_data.SftDataConfig(
        max_length=args.max_length,
        packing=not args.no_packing,
        truncate=args.truncate,
        all_tokens=args.case == "messages_all",
    )
    data = sft_data.prepare_rows(rows, tokenizer, config)
    result = []
    for r in data.rows:
        batch = sft_data.packed_batch([r], tokenizer.pad_token_id or 0)
        result.append(
            {
                "input_ids": r.input_ids,
                "labels": r.labels,
                "seq_lengths": r.seq_lengths,
                "position_ids": r.position_ids,
                "targets": (batch.cols + 1).tolist(),  # the position of each token a loss term predicts
            }
        )
    return result


def first_difference(trl: list[dict], ours: list[dict]) -> str | None:
    if len(trl) != len(ours):
        return f"TRL has {len(trl)} rows, rollstream {len(ours)}"
    for i, (a, b) in enumerate(zip(trl, ours, strict=True)):
        for key in a:
            if a[key] != b[key]:
                return f"row {i}, {key}: TRL {a[key]} != rollstream {b[key]}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a local model folder (default: the demo's SmolLM2-135M)")
    parser.add_argument("--case", choices=CASES, default="messages")
    parser.add_argument("--data", default=None, help="a JSONL dataset instead of the built-in one")
    parser.add_argument("--rows", type=int, default=60, help="rows of the built-in dataset")
    parser.add_argument("--max-length", type=int, default=96)
    parser.add_argument("--no-packing", action="store_true")
    parser.add_argument("--truncate", action="store_true", help="rollstream's side: truncate as TRL does")
    parser.add_argument("--compare", action="store_true", help="also prepare rollstream's rows and compare")
    parser.add_argument(
        "--ours-own-template",
        action="store_true",
        help="case messages: rollstream's side keeps the model's template (no markers: turn by turn)",
    )
    args = parser.parse_args()
    if args.model is None:
        from rollstream.core.models import default_model_dir

        args.model = str(default_model_dir())
    if args.data is not None:
        rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    else:
        rows = dataset(args.case, args.rows)
    template = MARKED_CHATML if args.case == "messages" else None
    trl = trl_rows(args.model, rows, args, template)
    import trl as trl_package

    report: dict[str, Any] = {"trl": trl_package.__version__, "case": args.case, "rows": len(trl)}
    if args.compare:
        ours = our_rows(args.model, rows, args, None if args.ours_own_template else template)
        difference = first_difference(trl, ours)
        report |= {"equal": difference is None, "first_difference": difference}
    report["trl_rows"] = trl
    json.dump(report, sys.stdout)
    print()


if __name__ == "__main__":
    main()
