"""An emulated cluster on one machine: N network-namespace "nodes" on a bridge, each link rate-limited.

    with Cluster(2, rates_mbit=[1000, 100]) as c:      # node 1's link is 100 Mbit/s in both directions
        c.run(0, ["python", "-c", "..."])                 # a command inside node 0's namespace
        procs = [c.popen(i, cmd(i)) for i in c.nodes]    # torchrun on every node

Layout: a "switch" namespace holds a bridge; each node namespace holds one end of a veth pair
(`eth0`, address 10.<net>.0.<i+1>/24) whose other end is a port of the bridge. `tc tbf` shapes
both directions of every link (the node's egress on eth0, its ingress on the switch port).
tc netem is not available on these machines, so latency cannot be added; the bandwidth is real.

Everything lives in namespaces this module creates, named with a per-cluster prefix; nothing
touches the host's own network. `close()` (also on exceptions, SIGTERM and interpreter exit)
kills every process left in the namespaces and deletes them, which removes the links too.

Needs root and iproute2 (`ip`, `tc`). `available()` says whether this machine can, and why not.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys


def available() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"rpt-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _sh(*args: str) -> None:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")


class Cluster:
    def __init__(self, n_nodes: int, rates_mbit: list[float] | float | None = None, net: int | None = None):
        self.n = n_nodes
        rates = rates_mbit if isinstance(rates_mbit, list) else [rates_mbit] * n_nodes
        if len(rates) != n_nodes:
            raise ValueError(f"{len(rates)} link rates for {n_nodes} nodes")
        self.rates = rates
        self.prefix = f"rpt{os.getpid() % 100000}"
        self.net = net if net is not None else 100 + os.getpid() % 150  # 10.<net>.0.0/24, per cluster
        self.switch = f"{self.prefix}-sw"
        self.names = [f"{self.prefix}-n{i}" for i in range(n_nodes)]
        self.procs: list[subprocess.Popen] = []
        self._closed = False

    @property
    def nodes(self) -> range:
        return range(self.n)

    def address(self, node: int) -> str:
        return f"10.{self.net}.0.{node + 1}"

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> "Cluster":
        atexit.register(self.close)
        self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_term(self, signum, frame):
        self.close()
        sys.exit(128 + signum)

    def _build(self) -> None:
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            _sh("ip", "netns", "add", name)
            port = f"p{i}"
            _sh("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
            _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _sh("ip", "-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _sh("ip", "-n", name, "link", "set", "eth0", "up")
            _sh("ip", "-n", name, "link", "set", "lo", "up")
            if self.rates[i]:
                for ns, dev in ((name, "eth0"), (self.switch, port)):
                    _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rates[i]}mbit",
                        "burst", _burst(self.rates[i]), "latency", "100ms")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for name in self.names + [self.switch]:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        if hasattr(self, "_old_term"):
            signal.signal(signal.SIGTERM, self._old_term)

    # ------------------------------------------------------------------ running things on a node
    def cores(self, node: int) -> list[int]:
        """The cores a node's processes run on: an equal share each, or (more nodes than cores) one, shared."""
        cpus = sorted(os.sched_getaffinity(0))
        share = len(cpus) // self.n
        return cpus[node * share:(node + 1) * share] if share else [cpus[node % len(cpus)]]

    def command(self, node: int, argv: list[str]) -> list[str]:
        """`argv` inside the node's namespace, on the node's cores only: nodes of a real cluster do not share
        CPUs, and a torch process per node that sees every core oversubscribes them (seconds-long stalls)."""
        cores = ",".join(map(str, self.cores(node)))
        return ["ip", "netns", "exec", self.names[node], "taskset", "-c", cores, *argv]

    def env(self, node: int, extra: dict | None = None) -> dict:
        """The environment for a process on a node: gloo talks over the emulated link, torch uses the node's
        cores."""
        return {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0",
                "OMP_NUM_THREADS": str(len(self.cores(node))), **(extra or {})}

    def popen(self, node: int, argv: list[str], **kwargs) -> subprocess.Popen:
        kwargs.setdefault("env", self.env(node))
        proc = subprocess.Popen(self.command(node, argv), **kwargs)
        self.procs.append(proc)
        return proc

    def torchrun(self, node: int, nproc_per_node: int, args: list[str], port: int = 29400) -> list[str]:
        """torchrun on `node` joining every node through c10d rendezvous hosted on node 0."""
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.n}", f"--nproc-per-node={nproc_per_node}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={self.address(0)}:{port}",
                f"--rdzv-id={self.prefix}", f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
                f"--local-addr={self.address(node)}", *args]

    def run(self, node: int, argv: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("env", self.env(node))
        return subprocess.run(self.command(node, argv), timeout=timeout, capture_output=True, text=True, **kwargs)


def _burst(rate_mbit: float) -> str:
    """tbf's bucket: at least one 10 ms worth of the rate, and never below 64 KB (jumbo GSO segments)."""
    return f"{max(64 * 1024, int(rate_mbit * 1e6 / 8 / 100))}b"
