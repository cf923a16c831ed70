"""rollstream-core: what every rollstream service shares.

config (typed settings), codec (stream entries), streams (the Redis rollout buffer),
redis_server (embedded redis-server), deltas + safetensors_io + weight_transfer (weight
sync), grpc_utils, http_side (health/metrics), tasks (synthetic verifiable tasks), cli.
"""

__version__ = "0.1.0"
