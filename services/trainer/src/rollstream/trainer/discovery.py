"""Finding the generators to push weights to, from a DNS name.

On Kubernetes a headless Service (clusterIP: None) has one A record per ready pod, so
`gen-headless.ns.svc:50051` names every generator. The name is resolved again at every
push: pods come and go, and a generator that joins gets the next delta (or catches up
through FetchWeights when the base does not match).
"""

from __future__ import annotations

import socket

from rollstream.core import redis_policy, run_keys


class DiscoveryError(ValueError):
    """A `host:port` that cannot be used (no port, bad port)."""


def split_host_port(target: str) -> tuple[str, int]:
    """ "host:port" or "[v6addr]:port" -> (host, port)."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DiscoveryError(f"{target!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def resolve_all(target: str) -> list[str]:
    """Every address `host` resolves to, as sorted, de-duplicated "addr:port" strings.

    IPv4 (A) and IPv6 (AAAA) both count; IPv6 comes back as "[addr]:port", which gRPC
    accepts. A name that does not resolve (no pod ready yet) gives []: the caller has
    nobody to push to this time, which is not an error.
    """
    host, port = split_host_port(target)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    addresses = {
        f"[{sockaddr[0]}]:{port}" if family == socket.AF_INET6 else f"{sockaddr[0]}:{port}"
        for family, *_, sockaddr in infos
    }
    return sorted(addresses)


class GeneratorDirectory:
    """Where to push: the configured addresses plus whatever the DNS name resolves to now,
    else (neither configured) the live generators of the Redis registry (heartbeats)."""

    def __init__(self, configured: list[str], dns_name: str = ""):
        self.configured = configured
        self.dns_name = dns_name
        self.last: list[str] = list(configured)  # what GetState reports, without a Redis call

    @property
    def from_registry(self) -> bool:
        """Whether the addresses come from the Redis registry, which the `generator` user
        writes: then each generator must prove the address it is dialed at (publisher)."""
        return not (self.configured or self.dns_name)

    def addresses(self, client: redis_policy.Client, keys: run_keys.RunKeys) -> list[str]:
        if self.configured or self.dns_name:
            resolved = resolve_all(self.dns_name) if self.dns_name else []
            self.last = sorted(set(self.configured) | set(resolved))
        else:
            # An empty address is a generator colocated with its trainer: nothing to push to.
            self.last = sorted(a for a in run_keys.live_generators(client, keys).values() if a)
        return self.last
