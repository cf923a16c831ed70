"""The trainer's own metrics (docs/observability.md); the pipeline's streams, as the trainer
sees them, come from rollstream.core.dashboard.PipelineView."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollstream.v1 import rollout_pb2


@dataclass(frozen=True)
class Metrics:
    steps: Counter
    policy_version: Gauge
    groups: Counter
    tokens: Counter
    zero_variance_groups: Counter
    reward_mean: Gauge
    reward_std: Gauge
    loss: Gauge
    kl: Gauge
    clip_fraction: Gauge
    entropy: Gauge
    grad_norm: Gauge
    staleness: Histogram
    step_seconds: Histogram
    phase_seconds: Histogram
    delta_bytes: Histogram
    delta_dense_ratio: Gauge
    deltas_skipped: Counter
    reanchors: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> "Metrics":
        p = "rollstream_trainer_"
        mib = 1 << 20
        return cls(
            steps=Counter(p + "steps", "optimizer steps committed", registry=registry),
            policy_version=Gauge(p + "policy_version", "current policy version", registry=registry),
            groups=Counter(
                p + "groups",
                "groups consumed from ready, by outcome (trained, stale, duplicate, evaluated)",
                ["outcome"],
                registry=registry,
            ),
            tokens=Counter(p + "tokens", "completion tokens trained", registry=registry),
            zero_variance_groups=Counter(
                p + "zero_variance_groups",
                "trained groups whose rewards were all equal (no gradient; dapo drops them)",
                registry=registry,
            ),
            reward_mean=Gauge(p + "reward_mean", "mean reward of the last step's completions", registry=registry),
            reward_std=Gauge(p + "reward_std", "standard deviation of the last step's rewards", registry=registry),
            loss=Gauge(p + "loss", "loss of the last step", registry=registry),
            kl=Gauge(p + "kl", "mean KL to the reference (k3) of the last step", registry=registry),
            clip_fraction=Gauge(
                p + "clip_fraction",
                "fraction of the last step's tokens whose policy gradient the clip removed",
                registry=registry,
            ),
            entropy=Gauge(p + "entropy", "mean token entropy of the last step", registry=registry),
            grad_norm=Gauge(p + "grad_norm", "gradient norm of the last step (before clipping)", registry=registry),
            staleness=Histogram(
                p + "group_staleness_versions",
                "versions between the policy that sampled a trained group and the one it updates",
                buckets=(0, 1, 2, 3, 4, 6, 8, 16),
                registry=registry,
            ),
            step_seconds=Histogram(
                p + "step_seconds",
                "wall time of one step (forward, backward, optimizer, delta encode)",
                buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
                registry=registry,
            ),
            phase_seconds=Histogram(
                p + "step_phase_seconds",
                "wall time of one phase of a step (forward, backward, optimizer, delta_encode, push, commit)",
                ["phase"],
                buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                registry=registry,
            ),
            delta_bytes=Histogram(
                p + "delta_bytes",
                "size of each published weight payload (delta or anchor)",
                buckets=(64 << 10, 256 << 10, mib, 4 * mib, 16 * mib, 64 * mib, 256 * mib, 1 << 30, 4 << 30, 16 << 30),
                registry=registry,
            ),
            delta_dense_ratio=Gauge(
                p + "delta_dense_ratio", "last payload's size / the dense bf16 weights'", registry=registry
            ),
            deltas_skipped=Counter(
                p + "deltas_skipped",
                "versions published without a delta: nobody would read it (publisher.Readers)",
                registry=registry,
            ),
            reanchors=Counter(
                p + "reanchors",
                "anchors written because a reader appeared after deltas were skipped",
                registry=registry,
            ),
        )

    def observe_step(
        self, m: "rollout_pb2.StepMetrics", stalenesses: list[int], nbytes: int, fraction: float, skipped: bool = False
    ) -> None:
        self.steps.inc()
        self.policy_version.set(m.version)
        self.groups.labels(outcome="trained").inc(m.groups)
        self.tokens.inc(m.tokens)
        self.zero_variance_groups.inc(m.zero_variance_groups)
        for gauge, value in ((self.reward_mean, m.reward_mean), (self.reward_std, m.reward_std), (self.loss, m.loss), (self.kl, m.kl),
                             (self.clip_fraction, m.clip_fraction), (self.entropy, m.entropy), (self.grad_norm, m.grad_norm)):  # fmt: skip
            gauge.set(value)
        for s in stalenesses:
            self.staleness.observe(s)
        self.step_seconds.observe(m.step_seconds)
        if skipped:  # no payload: counted, not observed as a size
            self.deltas_skipped.inc()
            return
        self.delta_bytes.observe(nbytes)
        self.delta_dense_ratio.set(fraction)

    def observe_eval(self, m: "rollout_pb2.EvalMetrics") -> None:
        # The round's figures are gauges of the pipeline view (core/dashboard.py), read from the evals stream.
        self.groups.labels(outcome="evaluated").inc(m.prompts)
