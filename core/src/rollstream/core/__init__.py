"""rollstream-core: what every rollstream service shares.

cli              the `rollstream` command: up, status, secrets
codec            stream entries: protobuf message name, schema and bytes
config           typed settings shared by the services
cpu_runtime      process-wide C runtime settings under torch: OpenMP wait policy, malloc's mmap threshold
credentials      secrets on disk: writing and reading the files that hold credentials
deltas           weight sync payloads: anchors (all weights) and exact sparse deltas
grpc_auth        who may call what over gRPC: a token per role; optional TLS/mTLS
grpc_utils       gRPC servers with health checking and reflection; channels sized for weights
http_side        the HTTP side server: /healthz, /readyz, Prometheus /metrics
logs             structured log lines (key=value or JSON)
modeling         torch helpers for generator, reference and trainer: weights as bf16 bits, chunked log-probs
models           where models come from, without a network: the demo's SmolLM2, local folders
procs            processes rollstream starts for others, which must not outlive their starter
redis_acl        least privilege on Redis: one ACL user per service role
redis_policy     one Redis policy for every service and the CLI: timeouts, no hidden retries, outages
redis_server     an embedded, real redis-server for `rollstream up` and the tests
registry         the generator registry the trainer pushes weights to
safetensors_io   a minimal safetensors reader/writer over numpy arrays
service          what every service process does around its loop
streams          the rollout buffer: Redis streams read through consumer groups; RunKeys
tls_files        a small private CA: one certificate per role
validation       what a stream entry must satisfy before a stage uses it
weight_transfer  weight payloads over gRPC as streams of WeightChunks
"""

__version__ = "0.1.0"
