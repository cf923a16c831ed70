"""What the tests share: one `wait_for`, the tiny test model, and small Redis/gRPC helpers.

- `wait_for(condition, timeout_s, what)` -- poll until `condition()` is truthy; fail saying
  what was awaited (and why, when a watched process died first). Every wait in the tests
  goes through it, instead of a settle `time.sleep`.
- `build_tiny_model(path)` -- a tiny random Llama with a locally trained tokenizer, for fast
  tests that still exercise the real transformers code paths (the `tiny_model_dir` fixture).
- `write`, `write_many`, `groups_in` -- put messages on a run's streams, read groups back.
- `wait_healthy(address)` -- until a gRPC server reports SERVING.
- `process_tree(pid)`, `tcp_sockets(pids)` -- the TCP sockets a run's processes hold.

Imported as `helpers` (tests/ is on sys.path: pytest puts conftest.py's folder there).
Process supervision is tests/procs.py, the Redis Cluster tests/cluster.py, synthetic
groups tests/synthetic.py.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import grpc
import redis
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollstream.core import validation
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.grpc_utils import channel
from rollstream.core.run_keys import RunKeys
from rollstream.v1 import rollout_pb2
from synthetic import Decode, record_tasks

T = TypeVar("T")
# wait_for never gives up sooner than this (ROLLSTREAM_TEST_MIN_WAIT_S overrides; see wait_for).
MIN_WAIT_S = float(os.environ.get("ROLLSTREAM_TEST_MIN_WAIT_S", "300"))

# The custom reward example (examples/custom_reward), run by several tests.
CUSTOM_REWARD_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_reward"


# --- waiting ----------------------------------------------------------------------------


class Watched(Protocol):
    """A process a wait watches (procs.ServiceProc is one): waiting stops when it dies."""

    name: str
    proc: subprocess.Popen[bytes]

    def log(self) -> str: ...


@dataclass
class LoggedProc:
    """A plain subprocess to watch while waiting (procs.ServiceProc is the services' own):
    its name and the file its output goes to."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def wait_for(
    condition: Callable[[], T],
    timeout_s: float,
    what: str,
    procs: Sequence[Watched] = (),
    *,
    check: Callable[[], None] | None = None,
    details: Callable[[], str] | None = None,
    poll_s: float = 0.05,
) -> T:
    """Poll `condition` until it returns something truthy, and return that.

    Fails (AssertionError) after `timeout_s` saying `what` was awaited, with `details()` and
    the tail of each watched process's log; fails at once when one of `procs` exits before
    the condition holds (it is checked once more first: a process may write the awaited
    state and exit, a trainer done with its --steps), or when `check()` raises.
    """
    # The floor: on a loaded 2-core machine (load 10-40 is seen) a service takes tens of
    # seconds to start and a Redis call seconds, so the short waits tests state would fail
    # tests that are right. Measured beside four busy loops at load 12-16: trainer, generator
    # and reference ready after 85-95 s (25 s without them); with two suites running too,
    # past 120 s. A wait ends as soon as its condition holds: the floor costs time only in a
    # test that fails anyway.
    timeout_s = max(timeout_s, MIN_WAIT_S)
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        dead = [p for p in procs if p.proc.poll() is not None]
        if dead:
            value = condition()
            if value:
                return value
            p = dead[0]
            raise AssertionError(f"{p.name} exited ({p.proc.returncode}) while waiting for {what}:\n{p.log()[-3000:]}")
        if check is not None:
            check()
        if time.monotonic() >= deadline:
            more = [details()] if details is not None else []
            more += [f"--- {p.name}\n{p.log()[-2500:]}" for p in procs]
            raise AssertionError("\n".join([f"timed out after {timeout_s} s waiting for {what}", *more]))
        time.sleep(poll_s)


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    """The status a gRPC call ends with (OK when it returns)."""
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def still_running(proc: subprocess.Popen, name: str) -> Callable[[], None]:
    """A wait_for `check`: fail when `proc` has exited, with what it printed (when its stdout is a pipe)."""

    def check() -> None:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"{name} exited ({proc.returncode}):\n{out[-3000:] if out else ''}")

    return check


def wait_healthy(
    address: str,
    timeout_s: float = 30.0,
    service: str = "",
    creds: ClientCredentials | None = None,
    server_name: str = "",
) -> None:
    """Until the gRPC server at `address` reports SERVING for `service` ("" = the server).
    Health needs no token; `creds` matter for TLS."""
    with channel(address, creds, server_name) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        def serving() -> bool:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        wait_for(serving, timeout_s, f"{address} to report {service or 'the server'} SERVING", poll_s=0.2)


# --- streams ----------------------------------------------------------------------------


def write(client: redis.Redis, keys: RunKeys, stage: str, message: Message) -> bytes:
    """Append one message to a stage's stream, as the stage before it would; its entry id. A
    group written to `rollouts` answers a task the trainer fed: its task is recorded in the
    run's task map first (synthetic.record_tasks), as the trainer's feeder would have."""
    if stage == "rollouts" and isinstance(message, rollout_pb2.RolloutGroup):
        record_tasks(client, keys, [message])
    return client.xadd(keys.stream(stage), validation.encode(message))


def write_many(
    client: redis.Redis, keys: RunKeys, groups: Sequence[rollout_pb2.RolloutGroup], stage: str = "rollouts"
) -> None:
    """Append `groups` to a stage's stream in one round trip (to `rollouts`: their tasks recorded, as `write`)."""
    if stage == "rollouts":
        record_tasks(client, keys, groups)
    pipe = client.pipeline(transaction=False)
    for g in groups:
        pipe.xadd(keys.stream(stage), validation.encode(g))
    pipe.execute()


def write_ready(client: redis.Redis, keys: RunKeys, groups: Sequence[rollout_pb2.RolloutGroup], decode: Decode) -> None:
    """Append scored `groups` to `ready` as the reward stage would, their tasks recorded in
    the run's task map and each completion's text set to its tokens decoded (`decode`: the
    trainer's tokenizer, the `tiny_decode` fixture): what the trainer checks before it trains."""
    record_tasks(client, keys, groups, decode)
    write_many(client, keys, groups, stage="ready")


def groups_in(client: redis.Redis, stream: str) -> list[rollout_pb2.RolloutGroup]:
    """Every RolloutGroup on `stream`, oldest first."""
    return [validation.decode(fields, rollout_pb2.RolloutGroup) for _id, fields in client.xrange(stream)]


REWARD_GROUP = "reward"  # the reward service's default consumer group


def assert_scored_exactly_once(
    client: redis.Redis, keys: RunKeys, expected_ids: list[str], group: str = REWARD_GROUP
) -> None:
    """Every group in `scored` once, scored, nothing left pending on rollouts, nothing dead."""
    out = groups_in(client, keys.stream("scored"))
    assert sorted(g.group_id for g in out) == sorted(expected_ids), (
        f"{len(out)} written for {len(expected_ids)} expected"
    )
    assert client.xpending(keys.stream("rollouts"), group)["pending"] == 0
    assert client.xlen(keys.dead) == 0
    assert all(g.scored for g in out)


# --- the tiny test model ----------------------------------------------------------------

# Its special tokens. ChatML like SmolLM2, so chat code paths match the
# demo model; but pad is its own token (SmolLM2 pads with eos), so tests also cover pad != eos.
_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
_TINY_BOS, _TINY_EOS, _TINY_PAD = "<|im_start|>", "<|im_end|>", "<|pad|>"
_TINY_VOCAB_SIZE = 384  # the BPE trainer's target; the trained vocabulary is smaller (353): use len(tokenizer)
# ChatML without SmolLM2's default system prompt: short prompts keep tiny-model tests fast.
_TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tiny_corpus() -> list[str]:
    """Text the tiny tokenizer is trained on: what the tests and the demo task feed it.

    Arithmetic questions and answers (so digits, ' + ', ' = ', '?' are in the vocabulary),
    plus chat-template words. Fixed, so the tokenizer is the same on every run.
    """
    lines = [
        "system",
        "user",
        "assistant",
        "You are a helpful assistant.",
        "Answer with just the number.",
        "The answer is",
        "Sure! Let me think step by step.",
        "Hello! How can I help you today?",
        "Thank you.",
    ]
    for a in range(20):
        for b in range(20):
            lines.append(f"What is {a} + {b}? The answer is {a + b}.")
            lines.append(f"{a} + {b} = {a + b}")
            lines.append(f"{a} - {b} = {a - b}")
            lines.append(f"{a} * {b} = {a * b}")
    return lines


def _train_tiny_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """Byte-level BPE trained in-process; no files, no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits split one per token (as in SmolLM2's own tokenizer), so every number is spelled
    # from the same ten tokens and "first integer in the completion" stays easy to read.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TINY_VOCAB_SIZE,
        special_tokens=list(_TINY_SPECIALS),  # ids 0..3, in this order
        # The full byte alphabet, so any text (not just the corpus) can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=_TINY_BOS,
        eos_token=_TINY_EOS,
        pad_token=_TINY_PAD,
        unk_token=None,  # byte-level: every string is encodable
        chat_template=_TINY_CHAT_TEMPLATE,
        model_max_length=2048,
    )


def build_tiny_model(path: Path, seed: int = 0) -> Path:
    """Write a tiny random Llama causal LM + tokenizer to `path` (created if needed); return it.

    Byte-for-byte the same for the same seed and library versions. Weights are random, so
    generations are gibberish: this is for plumbing tests, not for learning curves.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, like the real model, so the KV-head code path runs
        max_position_embeddings=2048,
        tie_word_embeddings=False,  # separate lm_head: the opposite of SmolLM2, so both are tested
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    # fork_rng: seed the init without changing the caller's global torch RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def skip_folder(items: list, folder: Path, reason: str) -> None:
    """Mark every collected test under `folder` skipped with `reason` (a tier's conftest,
    where what the tier needs is missing: vllm, CUDA)."""
    import pytest

    for item in items:
        if folder in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


# --- sockets ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of a process (from /proc/net/tcp{,6}): listening, or a connection."""

    pid: int
    local: tuple[str, int]
    remote: tuple[str, int]
    listening: bool


def process_tree(root: int) -> list[int]:
    """`root` and every process below it (by /proc/<pid>/stat's parent), alive now."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parents[int(stat.parent.name)] = int(fields[1])
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += [child for child, parent in parents.items() if parent == pid]
    return tree


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # The kernel writes each 32-bit word in host byte order (little-endian here).
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words)), int(port, 16)


def tcp_sockets(pids: Sequence[int]) -> list[TcpSocket]:
    """Every TCP socket (IPv4 and IPv6) that one of `pids` holds open."""
    inodes: dict[str, int] = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*") if Path(f"/proc/{pid}/fd").exists() else []:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[9] in inodes:
                found.append(TcpSocket(inodes[f[9]], _address(f[1]), _address(f[2]), listening=f[3] == "0A"))
    return found


def dead_letters(client: redis.Redis, keys: RunKeys) -> dict[str, str]:
    """group_id -> reason, for every dead letter of the run (each holds a RolloutGroup)."""
    out = {}
    for _id, fields in client.xrange(keys.dead):
        letter = validation.decode(fields, rollout_pb2.DeadLetter)
        group = validation.decode({k.encode(): v for k, v in letter.original_fields.items()}, rollout_pb2.RolloutGroup)
        out[group.group_id] = letter.reason
    return out


def committed_step(client: redis.Redis, keys: RunKeys) -> int:
    """The last step whose commit (ack, ledger, metrics: one transaction) reached Redis. The
    trainer's own step (GetState) counts a step before its push and commit, so a test that
    reads the metrics must wait for this one."""
    return int(client.hget(keys.counters("trainer"), "step") or 0)


def assert_trained_once(client: redis.Redis, keys: RunKeys, groups: int) -> None:
    """The ledger after a run of `groups` groups, whatever crashed in it: every group trained
    exactly once, nothing left pending, nothing dead."""
    trained = client.smembers(keys.groups("trained"))
    assert len(trained) == groups
    assert int(client.hget(keys.counters("trainer"), "trained")) == len(trained)
    assert client.xlen(keys.dead) == 0
    assert client.xpending(keys.stream("ready"), "trainer")["pending"] == 0
