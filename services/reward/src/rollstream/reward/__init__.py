"""rollstream-reward: the reward stage (rs:{<run>}:rollouts -> rs:{<run>}:scored) and the
`rollstream.v1.Reward` gRPC scorer. CPU only; it must never import torch."""

__version__ = "0.1.0"
