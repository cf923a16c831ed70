"""rollstream-core: what every rollstream service shares (the operator's tools, `up` among
them, are the launcher package's: rollstream.launcher).

config           typed settings shared by the services
cpu_runtime      process-wide C runtime settings under torch: OpenMP wait policy, malloc's mmap threshold
credentials      secrets on disk: writing and reading the files that hold credentials
dashboard        the run's dashboard on the trainer's HTTP side: /dashboard, /api/pipeline, /api/steps
deltas           weight sync payloads: anchors (all weights) and exact sparse deltas
diagnose         what holds a run up: rules over a pipeline snapshot naming the bottleneck
grpc_auth        who may call what over gRPC: a token per role; optional TLS/mTLS
grpc_utils       gRPC servers with health checking and reflection; channels sized for weights
http_side        the HTTP side server: /healthz, /readyz, Prometheus /metrics
logs             structured log lines (key=value or JSON)
metrics          what every service exports besides its own metrics: its process, its GPU memory
modeling         torch helpers for generator, reference and trainer: weights as bf16 bits, chunked log-probs
models           where models come from, without a network: the demo's SmolLM2, local folders
progress         progress bars for long work, on a terminal only
push_signing     signed pushes: the trainer's signature over a generator's nonce, the generator's proof
redis_acl        least privilege on Redis: one ACL user per service role
redis_policy     one Redis policy for every service and the CLI: timeouts, no hidden retries, outages
run_keys         a run's Redis keys, what is read across a stream's groups, the generator registry
safetensors_io   a minimal safetensors reader/writer over numpy arrays
service          what every service process does around its loop
status           a run's pipeline read from Redis, and its view (`rollstream status`, the dashboard)
steplog          the run's step log: a JSON line per trainer step
streams          the rollout buffer: Redis streams read through consumer groups
tls_files        a small private CA: one certificate per role
validation       stream entries: protobuf message name, schema and bytes, and what one must satisfy
weight_transfer  weight payloads in transit: WeightChunk streams over gRPC, the weight store's files and manifest
"""

__version__ = "0.1.0"
