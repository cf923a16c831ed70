# rollstream/redis: Debian bookworm's redis-server (7.0), the rollout buffer. Any Redis >= 6.2
# works (the official redis:7 image too); this one is built from the same base as the service
# images so that nothing has to be pulled from a registry.
# AOF and the ACL file (--aclfile: one user per service, docs/security.md) are set by the
# command line (compose.yaml, k8s/10-redis.yaml).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
LABEL io.rollstream.built-by=scripts/build_images.sh
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
# The redis user gets a fixed uid/gid (999) before the package creates it, so that k8s can
# run the pod as that uid (runAsUser: 999) and fsGroup makes the data volume writable.
RUN groupadd --system --gid 999 redis \
 && useradd --system --uid 999 --gid 999 --home-dir /data --no-create-home --shell /usr/sbin/nologin redis \
 && apt-get update \
 && apt-get install -y --no-install-recommends redis-server redis-tools \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
USER 999:999
WORKDIR /data
EXPOSE 6379
# No config file: everything is on the command line. Protected mode only concerns a default
# user without a password; with the ACL file the default user is off.
CMD ["redis-server", "--dir", "/data", "--appendonly", "yes", "--appendfsync", "everysec"]
