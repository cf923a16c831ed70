"""SFT data: from a dataset on disk to the packed rows an SFT step trains on.

The same model, data and settings give the tokens, labels and packing that TRL 1.16's
SFTTrainer gives (its `_prepare_dataset` and `pack_dataset`; benchmarks/trl_sft_data.py
prints TRL's side for a comparison):

  1. load        a JSONL file, or a `datasets` folder written by save_to_disk (never the hub)
  2. format      decided by the first row, as TRL does: conversational (`messages`: [{role,
                 content}]) or prompt/completion (two strings, or two lists of messages)
  3. tokenize    with the model's tokenizer and chat template; labels are the token ids with
                 -100 where no loss is taken: the assistant's turns of `messages`, the
                 completion of prompt/completion, or every token with `all_tokens`
  4. validate    every row before anything trains: a missing field, an empty assistant turn,
                 a role outside the template, a row longer than `max_length` (unless
                 `truncate`: then cut to its first max_length tokens, as TRL does) are all
                 reported at once, each with its row number (0-based, as `datasets` indexes
                 rows; a JSONL file's line too) and field, in one SftDataError
  5. pack        best-fit decreasing into rows of at most max_length tokens (TRL's default
                 "bfd"): no example is split; `packed_batch` turns rows into the modeling.Batch
                 a forward takes, positions restarting and attention block-diagonal per example

Where this differs from TRL, on purpose: loss on the assistant's tokens is the default for
`messages` (TRL's assistant_only_loss is off by default, and refuses a chat template
without `{% generation %}` markers; here such a template's assistant tokens are found by
rendering the conversation turn by turn); and a row longer than max_length is refused
unless `truncate` is set (TRL truncates silently).
"""

from __future__ import annotations

import bisect
import json
import re
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollstream.core import modeling

IGNORE = -100  # a label that takes no loss (transformers' and TRL's ignore index)
ROLES = ("system", "user", "assistant", "tool")  # the roles of TRL's conversational format
# TRL packs inside each batch `datasets.map(batched=True)` hands it: 1,000 rows by default.
# Packing the same slices keeps rows identical to TRL's on datasets of more than 1,000 rows.
PACK_SLICE = 1000
_MAX_LISTED = 20  # problems spelled out in one error; the count says how many more


@dataclass(frozen=True)
class SftDataConfig:
    max_length: int = 1024  # tokens of a packed row, and the most an example may have (TRL's max_length)
    packing: bool = True  # TRL's default is False; packing is what makes short examples cheap
    truncate: bool = False  # cut an over-long example to its first max_length tokens instead of refusing it
    all_tokens: bool = False  # loss on every token, not only the assistant's / the completion's
    split: str = "train"  # the split of a saved DatasetDict


@dataclass(frozen=True)
class Problem:
    row: int
    field: str
    message: str
    line: int | None = None  # the row's line in a JSONL file (1-based; blank lines are not rows)

    def __str__(self) -> str:
        at = f" (line {self.line})" if self.line is not None else ""
        return f"row {self.row}{at}, {self.field}: {self.message}"


class SftDataError(ValueError):
    """The dataset has rows that cannot be trained on; `problems` names each row and field."""

    def __init__(self, problems: Sequence[Problem], source: str) -> None:
        self.problems = list(problems)
        listed = "\n  ".join(str(p) for p in self.problems[:_MAX_LISTED])
        more = len(self.problems) - _MAX_LISTED
        tail = f"\n  ... and {more} more" if more > 0 else ""
        super().__init__(f"{source}: {len(self.problems)} bad row(s), nothing trained:\n  {listed}{tail}")


@dataclass(frozen=True)
class Example:
    """One tokenized dataset row."""

    row: int  # its index in the dataset
    input_ids: list[int]
    labels: list[int]  # input_ids, with IGNORE where no loss is taken


@dataclass(frozen=True)
class PackedRow:
    """Examples laid end to end: what a step trains on, as TRL's packed dataset has it."""

    input_ids: list[int]
    labels: list[int]
    seq_lengths: list[int]  # each example's length, in order (TRL's "seq_lengths")
    rows: list[int]  # each example's dataset row

    @property
    def position_ids(self) -> list[int]:
        """Positions restarting at 0 at each example (TRL's collator, padding-free)."""
        return [p for n in self.seq_lengths for p in range(n)]

    @property
    def loss_tokens(self) -> int:
        """Tokens that take loss: labelled, and not an example's first (nothing predicts it):
        packed_batch's targets, and the tokens TRL's loss counts."""
        starts = {sum(self.seq_lengths[:k]) for k in range(len(self.seq_lengths))}
        return sum(1 for t, label in enumerate(self.labels) if label != IGNORE and t not in starts)


@dataclass(frozen=True)
class SftData:
    rows: list[PackedRow]
    examples: int
    truncated: int  # examples cut to max_length (only with `truncate`)
    dropped: int  # examples left without a loss token by truncation, dropped as TRL drops them (no packing)

    @property
    def loss_tokens(self) -> int:
        return sum(r.loss_tokens for r in self.rows)


def _load_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """A JSONL file's rows (one JSON object a line; blank lines skipped), and the line each came from."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such dataset file or folder")
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise SftDataError([Problem(len(rows), f"line {line_no}", f"not JSON: {e}")], str(path)) from None
            if not isinstance(value, dict):
                problem = Problem(len(rows), f"line {line_no}", f"a JSON object expected, got {type(value).__name__}")
                raise SftDataError([problem], str(path))
            rows.append(value)
            lines.append(line_no)
    return rows, lines


def _load_saved(path: Path, split: str) -> list[dict[str, Any]]:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"{path}: no split {split!r} (it has {sorted(loaded)})")
        loaded = loaded[split]
    if not isinstance(loaded, datasets.Dataset):
        raise ValueError(f"{path}: a saved Dataset or DatasetDict expected, got {type(loaded).__name__}")
    return loaded.to_list()


def read_rows(path: Path, split: str) -> tuple[list[dict[str, Any]], list[int]]:
    """A dataset's rows, and for a JSONL file each row's line (a saved folder: none)."""
    return (_load_saved(path, split), []) if path.is_dir() else _load_jsonl(path)


def prepare(path: str | Path, tokenizer: Any, config: SftDataConfig) -> SftData:
    """Load (a JSONL file, or a folder of `datasets`' save_to_disk: its `split` if a
    DatasetDict; local only), tokenize, validate every row before anything trains, and pack."""
    path = Path(path)
    rows, lines = read_rows(path, config.split)
    try:
        return prepare_rows(rows, tokenizer, config, source=str(path))
    except SftDataError as e:  # name each bad row's line too: what an editor shows
        located = [Problem(p.row, p.field, p.message, lines[p.row] if p.row < len(lines) else None) for p in e.problems]
        raise SftDataError(located, str(path)) from None


def prepare_rows(
    rows: Sequence[Mapping[str, Any]], tokenizer: Any, config: SftDataConfig, source: str = "dataset"
) -> SftData:
    if config.max_length < 2:
        raise ValueError(f"max_length {config.max_length}: at least 2 tokens (one to predict from, one to predict)")
    if not rows:
        raise SftDataError([Problem(0, "-", "the dataset has no rows")], source)
    kind = _format_of(rows[0])
    if kind is None:
        fields = sorted(rows[0])
        raise SftDataError(
            [Problem(0, "-", f"neither 'messages' nor 'prompt'+'completion' (fields: {fields})")], source
        )
    if kind == "messages" and not tokenizer.chat_template:
        raise ValueError("a conversational dataset needs a tokenizer with a chat template; this one has none")
    if kind == "prompt_completion" and tokenizer.eos_token is None:
        raise ValueError("a prompt/completion dataset needs a tokenizer with an EOS token (ended completions)")
    marked = _has_generation_markers(tokenizer.chat_template)
    examples: list[Example] = []
    problems: list[Problem] = []
    for i, row in enumerate(rows):
        try:
            ids, labels = _tokenize_row(row, kind, tokenizer, config.all_tokens, marked)
        except _RowError as e:
            problems.append(Problem(i, e.field, e.message))
            continue
        problems += _length_problems(i, ids, labels, config)
        examples.append(Example(i, ids, labels))
    if problems:
        raise SftDataError(problems, source)
    return _finish(examples, config)


def _finish(examples: list[Example], config: SftDataConfig) -> SftData:
    """Truncate (when asked) and pack: TRL's order of these steps, for either setting of packing."""
    n = config.max_length
    truncated = sum(1 for e in examples if len(e.input_ids) > n)
    cut = [Example(e.row, e.input_ids[:n], e.labels[:n]) for e in examples]  # TRL's keep_start
    if config.packing:
        # TRL keeps an example that truncation left without loss tokens when it packs: it
        # still fills its rows; it only drops such examples unpacked.
        return SftData(pack_bfd(cut, n), len(examples), truncated, 0)
    kept = [e for e in cut if any(label != IGNORE for label in e.labels)]
    rows = [PackedRow(e.input_ids, e.labels, [len(e.input_ids)], [e.row]) for e in kept]
    return SftData(rows, len(examples), truncated, len(cut) - len(kept))


def _length_problems(i: int, ids: list[int], labels: list[int], config: SftDataConfig) -> list[Problem]:
    problems = []
    if len(ids) > config.max_length and not config.truncate:
        problems.append(
            Problem(i, "length", f"{len(ids)} tokens, longer than max_length {config.max_length} (or set truncate)")
        )
    # An example's first token is predicted from nothing, so it never takes loss.
    if not any(label != IGNORE for label in labels[1:]):
        problems.append(Problem(i, "labels", "no token takes loss (nothing to learn from this row)"))
    return problems


# --- tokenizing one row ------------------------------------------------------------------


class _RowError(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def _format_of(row: Mapping[str, Any]) -> str | None:
    if "messages" in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    return None


def _has_generation_markers(template: Any) -> bool:
    """Whether the chat template marks the assistant's tokens (`{% generation %}`), so that
    transformers' return_assistant_tokens_mask finds them (TRL's has_generation_markers)."""
    text = template.get("default", "") if isinstance(template, dict) else (template or "")
    return re.search(r"\{%-?\s*generation\s*-?%\}", text) is not None  # {% generation %}, any trim variant


def _tokenize_row(
    row: Mapping[str, Any], kind: str, tokenizer: Any, all_tokens: bool, marked: bool
) -> tuple[list[int], list[int]]:
    if kind == "messages":
        messages = _messages(row, "messages", need_assistant=not all_tokens)
        if all_tokens:
            ids = _render(tokenizer, messages, "messages", whole=True)
            return ids, list(ids)
        if marked:
            return _marked_assistant_labels(tokenizer, messages)
        return _turn_by_turn_assistant_labels(tokenizer, messages)
    return _prompt_completion(row, tokenizer, all_tokens)


def _messages(row: Mapping[str, Any], name: str, need_assistant: bool) -> list[dict[str, Any]]:
    """The row's list of messages, checked: each a {role, content} with a known role and a
    string content, an assistant's never empty."""
    value = row.get(name)
    if value is None:
        raise _RowError(name, "missing")
    if not isinstance(value, list) or not value:
        raise _RowError(name, "a non-empty list of {role, content} messages expected")
    for j, m in enumerate(value):
        where = f"{name}[{j}]"
        if not isinstance(m, dict):
            raise _RowError(where, f"a {{role, content}} object expected, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role is None:
            raise _RowError(f"{where}.role", "missing")
        if role not in ROLES:
            raise _RowError(f"{where}.role", f"{role!r} is not a role of the chat template (one of {', '.join(ROLES)})")
        if content is None:
            raise _RowError(f"{where}.content", "missing")
        if not isinstance(content, str):
            raise _RowError(f"{where}.content", f"a string expected, got {type(content).__name__}")
        if role == "assistant" and not content.strip():
            raise _RowError(f"{where}.content", "empty assistant turn")
    if need_assistant and not any(m["role"] == "assistant" for m in value):
        raise _RowError(name, "no assistant turn to take loss on")
    return value


def _render(tokenizer: Any, messages: list[dict[str, Any]], name: str, whole: bool = False, **kwargs: Any) -> list[int]:
    return list(_render_dict(tokenizer, messages, name, whole, **kwargs)["input_ids"])


def _render_dict(
    tokenizer: Any, messages: list[dict[str, Any]], name: str, whole: bool, **kwargs: Any
) -> Mapping[str, Any]:
    """The chat template applied as TRL applies it (data_utils._tokenize); a template that
    refuses the conversation (a role it does not take, turns out of order) names the row."""
    from jinja2 import TemplateError

    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    except TemplateError as e:
        raise _RowError(name, f"the chat template refuses it: {e}") from None
    if whole:  # the row's whole conversation: checked once, not at every prefix of it
        _check_rendered(tokenizer, messages, name)
    return out


def _check_rendered(tokenizer: Any, messages: list[dict[str, Any]], name: str) -> None:
    """A template that names the roles it renders drops the others without a word: each
    non-assistant message's text must be in the rendering. (An assistant's may be rewritten,
    e.g. reasoning left out, so it is not checked.)"""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    for j, m in enumerate(messages):
        if m["role"] != "assistant" and m["content"] and m["content"] not in text:
            raise _RowError(name, f"message {j}: role {m['role']!r} is not rendered by the chat template")


def _marked_assistant_labels(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """The template's `{% generation %}` spans take loss (TRL's tokenize_fn with
    assistant_only_loss, then build_labels)."""
    out = _render_dict(tokenizer, messages, "messages", True, return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    return ids, [t if bit else IGNORE for t, bit in zip(ids, mask, strict=True)]


def _turn_by_turn_assistant_labels(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """A template without generation markers: assistant turn j's tokens are those that
    rendering messages[:j + 1] adds to messages[:j] with the generation prompt (its header),
    so the turn's text and end-of-turn tokens take loss, as a marked ChatML template has it.
    Needs each rendering to be a prefix of the next; a template that rewrites earlier turns
    (reasoning dropped from all but the last) is refused and needs markers."""
    ids = _render(tokenizer, messages, "messages", whole=True)
    labels = [IGNORE] * len(ids)
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if j == 0:
            raise _RowError("messages[0].role", "a conversation cannot open with the assistant's turn")
        head = _render(tokenizer, messages[:j], "messages", add_generation_prompt=True)
        turn = _render(tokenizer, messages[: j + 1], "messages")
        if turn[: len(head)] != head or ids[: len(turn)] != turn:
            raise _RowError(
                f"messages[{j}]",
                "the chat template renders earlier turns differently as the conversation grows, so the "
                "assistant's tokens cannot be found: use a template with {% generation %} markers",
            )
        labels[len(head) : len(turn)] = ids[len(head) : len(turn)]
    return ids, labels


def _prompt_completion(row: Mapping[str, Any], tokenizer: Any, all_tokens: bool) -> tuple[list[int], list[int]]:
    """TRL's prompt-completion tokenize_fn: prompt and prompt+completion tokenized apart, the
    completion starting where they diverge (data_utils.common_prefix_length); plain text
    gets the EOS token appended to the completion, as TRL's add_eos does."""
    prompt, completion = row.get("prompt"), row.get("completion")
    if prompt is None:
        raise _RowError("prompt", "missing")
    if completion is None:
        raise _RowError("completion", "missing")
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion.strip():
            raise _RowError("completion", "empty completion")
        if not completion.endswith(tokenizer.eos_token):
            completion += tokenizer.eos_token
        prompt_ids = list(tokenizer(text=prompt)["input_ids"])
        ids = list(tokenizer(text=prompt + completion)["input_ids"])
    elif isinstance(prompt, list) and isinstance(completion, list):
        prompt_msgs = _messages(row, "prompt", need_assistant=False)
        completion_msgs = _messages(row, "completion", need_assistant=False)
        prompt_ids = _render(tokenizer, prompt_msgs, "prompt", add_generation_prompt=True)
        ids = _render(tokenizer, prompt_msgs + completion_msgs, "completion", whole=True)
    else:
        kinds = f"{type(prompt).__name__} and {type(completion).__name__}"
        raise _RowError("completion", f"prompt and completion must both be strings or both message lists, got {kinds}")
    if all_tokens:
        return ids, list(ids)
    start = _common_prefix(prompt_ids, ids)
    return ids, [IGNORE] * start + ids[start:]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# --- packing ------------------------------------------------------------------------------


def pack_bfd(examples: Sequence[Example], max_length: int) -> list[PackedRow]:
    """Best-fit decreasing, as TRL's `_pack_bfd` ("bfd", overflow truncated: callers have
    cut or refused longer examples) packs each slice of PACK_SLICE rows: longest first (ties
    in dataset order), each into the open row with the least room that still fits it (of
    rows with equal room, the one that got there first), else into a new row. Rows come out
    in the order they were opened, their examples in the order they went in."""
    rows: list[PackedRow] = []
    for start in range(0, len(examples), PACK_SLICE):
        rows += _pack_slice(examples[start : start + PACK_SLICE], max_length)
    return rows


def _pack_slice(examples: Sequence[Example], max_length: int) -> list[PackedRow]:
    live = [e for e in examples if e.input_ids]  # TRL drops empty sequences
    order = sorted(range(len(live)), key=lambda k: -len(live[k].input_ids))  # stable: ties keep dataset order
    bins: list[list[int]] = []
    by_room: dict[int, deque[int]] = defaultdict(deque)  # room left -> bins with that much, first come first
    rooms: list[int] = []  # the room values some bin has, sorted
    for k in order:
        n = len(live[k].input_ids)
        at = bisect.bisect_left(rooms, n)
        if at < len(rooms):
            room = rooms[at]
            b = by_room[room].popleft()
            if not by_room[room]:
                rooms.pop(at)
        else:
            room, b = max_length, len(bins)
            bins.append([])
        bins[b].append(k)
        left = room - n
        if left > 0:
            if not by_room[left]:
                bisect.insort(rooms, left)
            by_room[left].append(b)
    return [_row([live[k] for k in b]) for b in bins]


def _row(examples: Sequence[Example]) -> PackedRow:
    ids = [t for e in examples for t in e.input_ids]
    labels = [label for e in examples for label in e.labels]
    return PackedRow(ids, labels, [len(e.input_ids) for e in examples], [e.row for e in examples])


# --- to the model -------------------------------------------------------------------------


def packed_batch(rows: Sequence[PackedRow], pad_id: int, device: str | torch.device = "cpu") -> modeling.Batch:
    """Rows as one modeling.Batch: right-padded ids, positions restarting at each example and
    no attention mask, and as targets every labelled token but an example's first, each
    predicted from the position before it in its own example: what TRL's padding-free
    collator and loss take. `lengths` holds each example's target count, in row order (0 for
    one truncation left unlabelled).

    Attention stays within each example without a [B, 1, T, T] mask of ours: with
    attention_mask None, transformers' masking utils cut each row where its positions stop
    counting up by one (find_packed_sequence_indices), and a row's padding restarts at 0, a
    segment no example sees. Where every row is one example and no padding (the long-row
    case) that is plain causal attention: no mask at all, SDPA's is_causal kernels (flash on
    a GPU); otherwise `rollstream sft`'s model attends each run on its own (packed_attention.py:
    no mask at all), and a model on transformers' SDPA gets the block-diagonal mask it builds
    from the positions (bool, a quarter of an fp32 mask)."""
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    b_rows: list[int] = []
    cols: list[int] = []
    targets: list[int] = []
    lengths: list[int] = []
    for b, r in enumerate(rows):
        ids[b, : len(r.input_ids)] = torch.tensor(r.input_ids, dtype=torch.long)
        positions[b, len(r.input_ids) :] = torch.arange(width - len(r.input_ids))  # padding: its own segment
        at = 0
        for n in r.seq_lengths:
            positions[b, at : at + n] = torch.arange(n)
            picked = [t for t in range(at + 1, at + n) if r.labels[t] != IGNORE]
            b_rows += [b] * len(picked)
            cols += [t - 1 for t in picked]
            targets += [r.input_ids[t] for t in picked]
            lengths.append(len(picked))
            at += n
    return modeling.Batch(
        input_ids=ids.to(device),
        attention_mask=None,
        rows=torch.tensor(b_rows, dtype=torch.long, device=device),
        cols=torch.tensor(cols, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        lengths=lengths,
        position_ids=positions.to(device),
    )
