"""Trainer settings (one typed place; TOML, ROLLSTREAM_* env, flags: rollstream.core.config)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from rollstream.core import cpu_runtime
from rollstream.core.config import ENV_PREFIX, NAME_PATTERN, SettingsBase, TorchSettings
from rollstream.trainer.trackers import missing_extras

if TYPE_CHECKING:
    import torch

    from rollstream.trainer.optimizer import HostAdamW


def split_list(v: object) -> object:
    """A list field's value: flags and the environment give "a:1,b:2" or "0.9,0.999" (or
    JSON); TOML gives a list, passed on as it is."""
    if isinstance(v, str):
        return json.loads(v) if v.lstrip().startswith("[") else [a.strip() for a in v.split(",") if a.strip()]
    return v


class HostOptimizerSettings(BaseModel):
    """The host optimizer's settings (trainer/optimizer.py HostAdamW), one definition for the
    trainers that use it: GRPO's (TrainerSettings) and SFT's (SftSettings). The defaults are
    TRL's too (learning rate, betas, no decay, the clip: docs/design-notes.md, "SFT (issue 46)").
    No model_config here: the settings classes' own is the one in force."""

    lr: float = Field(2e-5, gt=0, description="AdamW's learning rate")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's betas, comma-separated")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    max_grad_norm: float = Field(1.0, ge=0, description="0 disables clipping")
    # Memory (see rollstream/trainer/optimizer.py)
    bucket_mb: float = Field(32.0, gt=0, description="optimizer step bucket size, MB of fp32 masters")
    moments_dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16", description="AdamW moments in host memory (bfloat16: 4 bytes a parameter less)"
    )
    master_layout: Literal["split", "fp32"] = Field(
        "split",
        description="fp32 masters in host memory: split = their served bf16 bits plus a 16-bit remainder, exact, 4 bytes a parameter "
        "(8 in all with bfloat16 moments); fp32 = an fp32 vector plus the served bits twice, 8 bytes",
    )
    grad_offload: bool = Field(False, description="move gradients to host memory as backward produces them")

    @field_validator("betas", mode="before")
    @classmethod
    def _split_betas(cls, v: object) -> object:
        return split_list(v)

    def host_adamw(
        self,
        params: Mapping[str, torch.nn.Parameter],
        in_model: bool = False,
        reduce: Callable[[float], float] | None = None,
    ) -> HostAdamW:
        """The optimizer of `params` these settings describe (AdamW's eps: HostAdamW's, TRL's 1e-8).
        `in_model`, `reduce` (N ranks: the sum of squares over them): HostAdamW's (in_model: the
        fp32 layout then, whatever master_layout says)."""
        from rollstream.trainer.optimizer import HostAdamW

        return HostAdamW(
            params,
            lr=self.lr,
            betas=self.betas,
            weight_decay=self.weight_decay,
            bucket_mb=self.bucket_mb,
            moments_dtype=self.moments_dtype,
            master_layout="fp32" if in_model else self.master_layout,
            grad_offload=self.grad_offload,
            in_model=in_model,
            reduce=reduce,
        )


class TrainerSettings(HostOptimizerSettings, TorchSettings):
    """rollstream trainer: GRPO on the ready stream, weights pushed to the generators."""

    # model, threads: TorchSettings. dtype and device are redeclared (same defaults, same
    # allowed values) for what they mean here: the optimizer's fp32 masters and moments
    # stay on the CPU whatever these say.
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="compute dtype of forward/backward")
    device: str = Field("cpu", description="compute device; the optimizer state always lives on the CPU")
    steps: int = Field(0, ge=0, description="stop after this many optimizer steps (0: run until stopped)")
    seed: int = Field(0)
    linger: bool = Field(False, description="after the last step keep serving gRPC (weights, state) until stopped")
    # Data
    task: Literal["arithmetic", "countdown", "jsonl", "dataset"] = Field(
        "arithmetic",
        description="built-in synthetic task (arithmetic, countdown), prompts from a JSONL/Parquet file (jsonl), or a save_to_disk folder (dataset)",
    )
    dataset_path: str = Field(
        "", description="JSONL/Parquet file (task = jsonl) or datasets.save_to_disk folder (task = dataset)"
    )
    prompt_field: str = Field("prompt")
    answer_field: str = Field("answer")
    metadata_field: str = Field(
        "", description="optional column with task metadata for the reward recipe (an object or JSON text)"
    )
    task_kind: str = Field("arithmetic", description="reward recipe name written into each task (jsonl, dataset)")
    max_operand: int = Field(9, ge=1, description="arithmetic: operands are 0..max_operand")
    # Sampling (sent with each task). Defaults: the GPU profile's (its compose.yaml and k8s/ repeat none).
    group_size: int = Field(8, ge=2)
    temperature: float = Field(1.0, gt=0, description="sampling temperature, and the reference's (`up` passes it on)")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(16, ge=1)
    # GRPO
    groups_per_step: int = Field(8, ge=1)
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo"] = Field(
        "grpo", description="policy loss (formulas in rollstream/trainer/grpo.py)"
    )
    clip_eps_low: float = Field(0.2, gt=0, lt=1, description="ratio clipped below at 1 - clip_eps_low")
    clip_eps_high: float = Field(
        0.2, gt=0, description="ratio clipped above at 1 + clip_eps_high (DAPO's clip-higher: 0.28; GSPO: ~4e-4)"
    )
    tis_cap: float = Field(
        0.0, ge=0, description="truncated importance sampling: weight min(pi_trainer / pi_behaviour, cap); 0 disables"
    )
    beta: float = Field(0.0, ge=0, description="KL (k3) weight; > 0 needs reference log-probs (see kl_reference)")
    kl_reference: Literal["service", "lora_base"] = Field(
        "service",
        description="where pi_ref comes from when beta > 0: the reference service (groups carry ref_logprobs), or, with LoRA, "
        "the trainer's own frozen base with the adapters switched off (lora_base: no reference service to deploy)",
    )
    max_staleness: int = Field(1, ge=0, description="drop groups sampled more than this many versions ago")
    max_abs_reward: float = Field(
        1e4, gt=0, description="dead-letter groups with a reward of larger magnitude (a scorer gone wrong)"
    )
    prompt_buffer: int = Field(16, ge=1, description="tasks kept waiting in the prompts stream")
    token_budget: int = Field(4096, ge=16, description="padded tokens per micro-batch")
    share_prompts: bool = Field(
        True,
        description="a group's prompt through the model once per micro-batch, its completions after it under a mask "
        "(the same log-probs up to float rounding; fewer tokens when prompts are long beside completions)",
    )
    chunk_tokens: int = Field(1024, ge=1, description="LM-head chunk when computing log-probs")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in backward")
    # LoRA (peft); the published weights are the merged ones
    lora_rank: int = Field(0, ge=0, description="LoRA rank (0: full fine-tuning)")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA alpha (scale = alpha / rank)")
    # NoDecode: the environment gives "q_proj,v_proj" (or a JSON list), not only JSON. A plain
    # default, not a factory: pydantic copies it per instance, and --help can show it.
    lora_target_modules: Annotated[list[str], NoDecode] = Field(
        ["all-linear"], description="module names, comma-separated, or all-linear"
    )
    # Checkpoints
    checkpoint_dir: str = Field(
        "",
        description="where checkpoints go: the trainer's own as step-NNNNNNNN folders (resumed from, pruned), "
        "SaveCheckpoint's under any other name (kept)",
    )
    checkpoint_every: int = Field(
        0,
        ge=0,
        description="save a checkpoint every N steps, and at the last step (0: only on request and at the last step)",
    )
    # A resume needs the latest checkpoint and the trained log after it; the spare is what a
    # torn latest falls back to, losing nothing (the log reaches back to it). Each one is the
    # optimizer state: 12 bytes a trained parameter (8 with bfloat16 moments).
    keep_checkpoints: int = Field(
        2,
        ge=0,
        description="the trainer's checkpoints kept, highest recorded step first: 2 = the latest + a spare in case it is torn, "
        "1 = the latest only, 0 = all",
    )
    resume: str = Field(
        "",
        description="checkpoint folder to resume from, 'latest' (in checkpoint_dir), or 'auto' (latest if there is one, else start)",
    )
    # The trained model (trainer/export.py)
    export_dir: str = Field(
        "",
        description="when training ends (after its last step, or on a stop), write the model here as a Hugging Face folder: config, "
        "generation config, tokenizer and chat template, safetensors (LoRA: a PEFT adapter folder); `rollstream up` sets WORKDIR/model; empty: none",
    )
    export_dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16",
        description="the exported weights: bfloat16 = the served weights bit for bit, float32 = the optimizer's masters",
    )
    # Held-out evaluation (trainer/evaluation.py): rounds of eval tasks through the same streams,
    # scored by the same reward service, never trained on.
    eval_prompts: int = Field(
        0, ge=0, le=100_000, description="prompts per held-out evaluation round (0: no evaluation)"
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="a round every N steps, besides the one before the first step and the one after the last (0: only those two)",
    )
    eval_samples: int = Field(
        1,
        ge=1,
        le=64,
        description="completions per eval prompt: 1 = greedy; more = sampled at `temperature`, reported as pass@k",
    )
    eval_dataset_path: str = Field(
        "",
        description="eval prompts from this JSONL/Parquet file or datasets.save_to_disk folder (the training task's fields); "
        "empty: the training task's own generator with eval_seed (arithmetic, countdown)",
    )
    eval_seed: int = Field(
        1_000_003,
        description="seed of the built-in task's held-out prompts (another seed than the training one: other prompts)",
    )
    eval_only: bool = Field(
        False,
        description="train nothing: one held-out round of the model as it is, reported, then stop (`rollstream eval`)",
    )
    eval_timeout_s: float = Field(
        600.0,
        gt=0,
        description="how long a round waits for its groups (some may have died upstream); then it is reported with what came in",
    )
    # Trackers (trainer/trackers.py): TRL's `report_to`
    report_to: Annotated[list[Literal["tensorboard", "mlflow", "wandb"]], NoDecode] = Field(
        [],
        description="where each step's and each eval round's metrics and the run configuration also go: tensorboard, mlflow (a local file store), "
        "wandb (offline: no network), comma-separated; each needs its extra (pip install 'rollstream-trainer[tensorboard]')",
    )
    tracker_dir: str = Field(
        "",
        description="the trackers' folder (tensorboard events, mlflow's file store, wandb's offline runs); `rollstream up` sets WORKDIR/trackers",
    )
    # Observability
    metrics_file: str = Field(
        "",
        description="append one JSON line per step here (StepMetrics + phase times; `rollstream plot` reads it); empty: none. "
        "`rollstream up` sets WORKDIR/steps.jsonl",
    )
    dashboard: bool = Field(
        True,
        description="serve the run's dashboard on the HTTP side (/dashboard, /api/pipeline, /api/steps) and the pipeline gauges on /metrics",
    )
    # The dashboard reads every stage's stream, which the trainer's own Redis user may not.
    redis_observer_password_file: str = Field(
        "",
        description="the read-only `observer` Redis user's password file, for the dashboard's look at every stage "
        "(empty: the trainer's own connection; with ACLs it then sees only its own keys)",
    )
    # Weight sync
    # NoDecode: the environment gives "a:1,b:2" (or a JSON list), not only JSON.
    generators: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="generator gRPC addresses, comma-separated (empty, with no generators_dns: the Redis registry)",
    )
    generators_dns: str = Field(
        "",
        description="host:port whose every A/AAAA record is a generator, resolved at each push (a Kubernetes headless Service, "
        "e.g. gen-headless.ns.svc:50051); added to `generators`",
    )
    anchor_interval: int = Field(20, ge=1, description="publish a full anchor every N versions")
    # The anchor is read only when a generator catches up, yet as large as the bf16 weights
    # (257 MB at 135M, 14 GB at 7B): a file keeps it out of the trainer's resident memory.
    anchor_dir: str = Field(
        "",
        description="keep the latest anchor (served to generators catching up) in a file in this directory; empty: in memory",
    )
    # The encoder is the host's costliest work a step (at 1.5B on an H200's host: 20 thread-seconds
    # for a 5.8 % delta against 0.72 s of AdamW), and the cores sit idle through forward and
    # backward on a GPU: half of them by default (docs/benchmarks.md, "GPU: the third run").
    delta_encode_threads: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = Field(
        "auto",
        description="threads that encode the weight delta tensor by tensor during the optimizer step (0: after the step, on the trainer's thread; "
        "auto: half the trainer's torch threads, or of its cores (its CPU affinity capped by a container's CPU quota), at least 1: 1 on 2 cores, 8 on 16)",
    )
    push_timeout_s: float = Field(120.0, gt=0)
    push_nonce_timeout_s: float = Field(
        3.0,
        gt=0,
        description="how long a generator has to answer PushNonce before it is left out of that push (and backed off a while): one stranger costs this, not push_timeout_s",
    )
    # A healthy receiver takes a 4 MiB chunk in milliseconds (tens on a loaded 2-core box), and
    # an apply that is not waiting for a batch answers in under a second (docs/design-notes.md).
    push_stall_s: float = Field(
        5.0,
        gt=0,
        description="a generator that takes no chunk of a push for this long is cut and left out a while; one that has every chunk "
        "is waited for this long (per level of a relay tree), then the push ends without its answer and the next step goes on",
    )
    # Past ~16 generators the trainer's egress, not the receivers, bounds a push (docs/deploy.md,
    # "Scaling out"): down a relay tree it sends each payload push_fanout times, whatever N.
    push_fanout: int = Field(
        0,
        ge=0,
        le=64,
        description="push down a relay tree: the trainer sends each payload to this many generators, each forwards it to as many more (0: to every generator itself)",
    )
    group: str = Field("trainer", description="consumer group on the ready stream")

    @field_validator("generators", "lora_target_modules", "report_to", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        return split_list(v)

    @model_validator(mode="after")
    def _check(self) -> "TrainerSettings":
        if self.task in ("jsonl", "dataset") and not self.dataset_path:
            raise ValueError(f"dataset_path is required when task = {self.task!r}")
        if (self.checkpoint_every or self.resume in ("latest", "auto")) and not self.checkpoint_dir:
            raise ValueError("checkpoint_dir is required with checkpoint_every > 0 or resume = 'latest' / 'auto'")
        if self.lora_rank and not self.lora_target_modules:
            raise ValueError("lora_target_modules is empty")
        if self.eval_only and not self.eval_prompts:
            raise ValueError("eval_only needs eval_prompts > 0 (how many held-out prompts to evaluate)")
        if self.eval_prompts and self.task in ("jsonl", "dataset") and not self.eval_dataset_path:
            raise ValueError(
                f"eval_dataset_path is required for held-out evaluation (eval_prompts > 0) with task = {self.task!r}"
            )
        if self.eval_dataset_path and not Path(self.eval_dataset_path).exists():
            raise ValueError(f"eval_dataset_path {self.eval_dataset_path!r}: no such file or folder")
        if self.report_to and not self.tracker_dir:
            raise ValueError("tracker_dir is required with report_to")
        if self.report_to and (missing := missing_extras(self.report_to)):
            raise ValueError(missing)  # at start, before the model loads, not at the first step
        if self.kl_reference == "lora_base" and not self.lora_rank:
            raise ValueError(
                "kl_reference = 'lora_base' needs LoRA training (lora_rank > 0): the reference is the base under the adapters"
            )
        return self

    @property
    def reference_service(self) -> bool:
        """Whether the KL needs the reference service (beta > 0, pi_ref not the LoRA base)."""
        return self.beta > 0 and self.kl_reference == "service"

    def encode_threads(self) -> int:
        """delta_encode_threads, with auto resolved on this machine (torch threads when set,
        else the cores this process may keep busy: its affinity, capped by a container's CPU
        quota)."""
        if self.delta_encode_threads != "auto":
            return self.delta_encode_threads
        return auto_encode_threads(self.threads)


def auto_encode_threads(threads: int = 0) -> int:
    """delta_encode_threads = auto for a process of `threads` torch threads (0: as many as
    the cores it may keep busy, cpu_runtime.usable_cores): half, at least 1."""
    return max(1, (threads or cpu_runtime.usable_cores()) // 2)


class SftSettings(HostOptimizerSettings, SettingsBase):
    """rollstream sft: supervised fine-tuning of a model on a dataset, on the trainer's engine
    (trainer/sft.py). Defaults are TRL 1.16 SFTConfig's where it has one (docs/design-notes.md,
    "SFT (issue 46)"), except where said: packing on, loss on the assistant's tokens only.
    Each field is a flag, --field or --sft.field; the [sft] table of --config FILE or --profile
    NAME|PATH (a `rollstream up` profile) and ROLLSTREAM_SFT_* variables set them too."""

    # Its own environment prefix: ROLLSTREAM_LR is the GRPO trainer's, ROLLSTREAM_SFT_LR this one's.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX + "SFT_", cli_prog_name="rollstream sft")

    model: str = Field(description="the model to fine-tune: a local Hugging Face folder, or smollm2-135m")
    dataset: str = Field(
        description="a JSONL file or a datasets.save_to_disk folder: `messages` (conversations) or `prompt` + `completion` rows"
    )
    out: str = Field(
        description="the fine-tuned model's folder (new, empty, or an earlier export), what `rollstream up --model OUT` starts GRPO from"
    )
    workdir: str = Field("", description="checkpoints/, steps.jsonl and trackers/ (empty: runs/<run>)")
    run: str = Field(
        "sft",
        pattern=NAME_PATTERN,
        description="the run's name: the default workdir, the step log's and trackers' name",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="compute dtype: float32 computes on the fp32 masters after each update (TRL's fp32 run), "
        "bfloat16 on their bf16 rounding (half the device memory; TRL's bf16 autocast)",
    )
    device: str = Field("cpu", description="compute device; the optimizer state always lives on the CPU")
    threads: int = Field(0, ge=0, description="torch threads (0: torch's default)")
    seed: int = Field(42, description="the order of the packed rows, epoch by epoch (TRL's seed: 42)")
    # What a step is. TRL's per_device_train_batch_size (8) x gradient_accumulation_steps (1).
    batch_rows: int = Field(8, ge=1, description="packed rows a step (the last step of an epoch takes what is left)")
    epochs: int = Field(3, ge=1, description="passes over the dataset (TRL's num_train_epochs: 3)")
    max_steps: int = Field(
        0, ge=0, description="stop after this many steps, before the epochs are done (0: the epochs decide)"
    )
    lr_scheduler: Literal["linear", "constant"] = Field(
        "linear", description="the learning rate after warmup: linear to 0 at the last step (TRL's), or constant"
    )
    warmup_steps: int = Field(0, ge=0, description="steps of linear warmup from 0 (TRL's: 0)")
    # The data (trainer/sft_data.py).
    max_length: int = Field(
        1024, ge=2, description="tokens of a packed row, and the most an example may have (TRL's max_length)"
    )
    packing: bool = Field(True, description="pack examples into rows of max_length (TRL's default: off)")
    truncate: bool = Field(
        False, description="cut an example longer than max_length to its start instead of refusing the dataset"
    )
    all_tokens: bool = Field(
        False,
        description="loss on every token, not only the assistant's turns / the completion (TRL's default for messages)",
    )
    split: str = Field("train", description="the split of a saved DatasetDict")
    # The engine (the same pieces as GRPO's step).
    token_budget: int = Field(4096, ge=16, description="padded tokens per micro-batch")
    chunk_tokens: int = Field(1024, ge=1, description="LM-head rows at a time (the logits are never whole)")
    activation_checkpointing: bool = Field(
        True, description="recompute each decoder layer's activations in backward (TRL's gradient_checkpointing: on)"
    )
    activation_checkpointing_every: int = Field(
        1,
        ge=1,
        description="with activation_checkpointing, recompute only every k-th decoder layer: faster, "
        "the other layers' activations kept (docs/benchmarks.md, 'SFT step time')",
    )
    # Held-out loss.
    eval_fraction: float = Field(
        0.0, ge=0, lt=1, description="hold out this fraction of the packed rows (whole examples), never trained on"
    )
    eval_dataset: str = Field("", description="held-out examples from this JSONL file or save_to_disk folder instead")
    eval_every: int = Field(
        0, ge=0, description="a held-out loss every N steps, and after the last (0: after the last only)"
    )
    # Held-out score (trainer/sft_eval.py): greedy completions of held-out rows that have an
    # answer, scored by the reward service's recipes. Field names and task_kind as [trainer]'s.
    answer_field: str = Field("answer", description="the field of a row holding its reference answer (empty: none)")
    metadata_field: str = Field("", description="the field of a row holding the recipe's metadata (empty: none)")
    task_kind: str = Field(
        "arithmetic", min_length=1, description="the reward recipe the held-out answers are scored with"
    )
    eval_prompts: int = Field(
        64,
        ge=0,
        description="held-out rows with an answer completed and scored, the first N (0: the held-out loss only)",
    )
    eval_max_new_tokens: int = Field(256, ge=1, description="tokens a held-out completion may have (greedy)")
    eval_batch_size: int = Field(16, ge=1, description="held-out prompts generated together")
    # Checkpoints and the model.
    checkpoint_every: int = Field(
        500, ge=0, description="a checkpoint every N steps, and at the last (TRL's save_steps: 500)"
    )
    keep_checkpoints: int = Field(
        2, ge=0, description="checkpoints kept, latest first: 2 = the latest + a spare in case it is torn, 0 = all"
    )
    resume: str = Field(
        "", description="a checkpoint folder, or latest (the workdir's newest): the same bits as a run never stopped"
    )
    export_dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16",
        description="the out folder's weights: bfloat16 = the trained bf16 weights bit for bit, float32 = the masters",
    )
    report_to: Annotated[list[Literal["tensorboard", "mlflow", "wandb"]], NoDecode] = Field(
        [], description="trackers also given each step's metrics: tensorboard, mlflow, wandb (offline), comma-separated"
    )
    tracker_dir: str = Field("", description="the trackers' folder (empty: WORKDIR/trackers)")

    @field_validator("report_to", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        return split_list(v)

    @model_validator(mode="after")
    def _check(self) -> "SftSettings":
        for name in ("dataset", "eval_dataset"):
            path = getattr(self, name)
            if path and not Path(path).exists():
                raise ValueError(f"{name} {path!r}: no such file or folder")
        if self.eval_dataset and self.eval_fraction:
            raise ValueError("eval_fraction: set it or eval_dataset, not both")
        if self.report_to and (missing := missing_extras(self.report_to)):
            raise ValueError(missing)
        return self

    @property
    def folder(self) -> Path:
        return Path(self.workdir or f"runs/{self.run}")
