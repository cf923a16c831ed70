# rollstream/trainer: the GRPO trainer (CPU or CUDA torch, whichever the wheelhouse holds) with
# the demo model inside. Its entrypoint, trainer_start.py, runs `python -m rollstream.trainer`
# (with `--colocate`: the trainer and a generator in one process, one copy of the weights) with
# `--resume latest` added when /checkpoints (a volume) already holds a checkpoint.
# Build: bash scripts/build_images.sh (CPU), ROLLSTREAM_TORCH=cuda bash scripts/build_images.sh (GPU).
# The build installs only from the wheelhouse that script fills (no index, no network but apt);
# nothing is downloaded at run time.
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

# --- deps: third-party dependencies only (from the pyprojects), so code edits keep this layer
FROM python AS deps
ARG WHEELHOUSE=build/wheelhouse-cpu
ARG CONSTRAINTS=constraints/cpu.txt
COPY ${WHEELHOUSE}/ /wheels/
COPY ${CONSTRAINTS} /tmp/constraints.txt
COPY docker/service_deps.py /tmp/service_deps.py
COPY core/pyproject.toml /tmp/src/core/pyproject.toml
COPY services/trainer/pyproject.toml /tmp/src/services/trainer/pyproject.toml
RUN python3 /tmp/service_deps.py /tmp/src trainer > /tmp/requirements.txt \
 && python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /wheels \
      -c /tmp/constraints.txt -r /tmp/requirements.txt

# --- wheels: rollstream-core and the service, built from the source; gcc compiles the split
# layout's AdamW kernel (services/trainer/setup.py) into the trainer's wheel, and stays here
FROM deps AS wheels
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY core/ /tmp/src/core/
COPY services/trainer/ /tmp/src/services/trainer/
# The generator (its transformers backend needs nothing the trainer lacks) and the launcher
# without its [up] extra: the colocated process (`trainer_start.py --colocate`, compose.one-gpu.yaml)
# and compose's `admin` service (`rollstream status`) run from this image.
COPY services/generator/ /tmp/src/services/generator/
COPY launcher/ /tmp/src/launcher/
RUN /opt/venv/bin/pip wheel --no-cache-dir --no-index --find-links /wheels --no-deps \
      --wheel-dir /rs-wheels /tmp/src/core /tmp/src/services/trainer /tmp/src/services/generator /tmp/src/launcher

FROM python
COPY --from=deps /opt/venv /opt/venv
COPY --from=wheels /rs-wheels /tmp/rs-wheels
RUN /opt/venv/bin/pip install --no-cache-dir --no-index --no-deps /tmp/rs-wheels/*.whl \
 && rm -rf /tmp/rs-wheels \
 && /opt/venv/bin/pip check
# The demo model where resolve_model("smollm2-135m") looks: $ROLLSTREAM_CACHE/models.
COPY --from=model /models /opt/rollstream/cache/models
COPY docker/trainer_start.py /opt/rollstream/trainer_start.py
# checkpoint_dir and anchor_dir (the weight store): named volumes (compose) or PVCs (k8s)
# mounted here start out owned by the user.
RUN mkdir /checkpoints /weights && chown 10001:10001 /checkpoints /weights
# HOME=/tmp: the root file system may be read-only (k8s, compose read_only); /tmp is a tmpfs there.
ENV PATH=/opt/venv/bin:$PATH \
    ROLLSTREAM_CACHE=/opt/rollstream/cache \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    HOME=/tmp PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
USER 10001:10001
# gRPC and HTTP (/healthz /readyz /metrics); the ports are settings (grpc_port, http_port).
EXPOSE 50051 8080
ENTRYPOINT ["python", "/opt/rollstream/trainer_start.py"]
