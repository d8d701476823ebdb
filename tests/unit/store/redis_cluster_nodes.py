"""A 3-node Redis Cluster on loopback ports for the `redis+cluster://` tests, stopped by its own pids."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from tests.helpers import free_port, stop_process

NUM_NODES = 3


class LocalRedisCluster:
    """Three primaries (no replicas) sharing the 16384 slots, made with `redis-cli --cluster create`.

    Attributes:
        ports: Each node's client port; the cluster bus of each is on its own free port.
        url: The `redis+cluster://` URL listing every node.
    """

    def __init__(self, workdir: Path) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            pytest.fail("redis-server and redis-cli are not on PATH; run scripts/ensure-redis-server")
        self.processes: list[subprocess.Popen[bytes]] = []
        self.ports = [free_port() for _ in range(NUM_NODES)]
        self.workdir = workdir
        try:
            for index, port in enumerate(self.ports):
                self.processes.append(self._start_node(server, workdir / f"node-{index}", port))
            for port in self.ports:
                self._wait(lambda port=port: self._client(port).ping(), f"node {port} did not answer PING")
            addresses = [f"127.0.0.1:{port}" for port in self.ports]
            subprocess.run([cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            for port in self.ports:
                self._wait(lambda port=port: self._client(port).cluster("info")["cluster_state"] == "ok",
                           f"node {port} never saw the cluster as ok")
        except BaseException:
            self.stop()
            raise
        self.url = "redis+cluster://" + ",".join(addresses)

    @staticmethod
    def _start_node(server: str, directory: Path, port: int) -> subprocess.Popen[bytes]:
        directory.mkdir(parents=True, exist_ok=True)
        # An explicit bus port: the default (port + 10000) may be taken or past 65535 for a high free port.
        args = [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-port", str(free_port()), "--cluster-config-file", str(directory / "nodes.conf"),
                "--cluster-node-timeout", "2000", "--save", "", "--appendonly", "no", "--dir", str(directory)]
        with (directory / "redis-server.log").open("wb") as log:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    @staticmethod
    def _client(port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5, socket_timeout=0.5)

    def _wait(self, ready: object, message: str, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if ready():  # type: ignore[operator]
                    return
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, KeyError):
                pass
            time.sleep(0.05)
        logs = "\n".join((self.workdir / f"node-{i}" / "redis-server.log").read_text(errors="replace")[-500:]
                         for i in range(len(self.processes)))
        pytest.fail(f"{message}: {logs}")

    def flush(self) -> None:
        """Empty every node (only the primaries hold data; there are no replicas)."""
        for port, process in zip(self.ports, self.processes, strict=True):
            if process.poll() is None:
                with self._client(port) as client:
                    client.flushall()

    def node_of(self, name: str) -> int:
        """Index of the node that owns the slot of the Redis key `name`."""
        with self._client(self.ports[0]) as client:
            slot = int(client.cluster("keyslot", name))
            for start, end, primary, *_ in client.cluster("slots"):
                if start <= slot <= end:
                    return self.ports.index(int(primary[1]))
        raise AssertionError(f"no node owns slot {slot}")

    def kill(self, index: int) -> None:
        """Stop one node, as a crash would take it away."""
        stop_process(self.processes[index])

    def stop(self) -> None:
        for process in self.processes:
            stop_process(process)
