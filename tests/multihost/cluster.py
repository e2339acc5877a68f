"""Test hosts made from Linux network namespaces, for multi-host MPI runs on one machine.

Each host has its own network stack (a veth pair into a shared bridge, its own address in a
private test subnet), its own hostname (a UTS namespace, so MPI sees separate nodes) and
its own view of one data folder (a mount namespace with a private bind mount), so a file
can exist on one host and not another. ``mpiexec`` reaches the hosts through its ordinary
host list and a launcher that enters the host's namespaces in place of ssh. Traffic stays
between the bridge and these hosts. Needs root and iproute2; everything is removed on exit,
also when a test fails.

Run by hand: ``python tests/multihost/cluster.py 2 -- python -m mpidp train ...``
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")

LAUNCHER = """#!/bin/sh
# ssh stand-in for mpiexec: launcher HOST COMMAND... (ssh options before HOST are ignored)
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
%(cases)s
  *) echo "launcher: unknown test host $host" >&2; exit 1;;
esac
exec ip netns exec "$ns" unshare --uts --mount sh -c \\
  "hostname $ns && mount --bind $hostdir %(data)s && exec $*"
"""


def available() -> str | None:
    """None if test hosts can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2 / util-linux)"
    probe = f"mpidpprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"cannot create network namespaces: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Cluster:
    """``n_hosts`` test hosts; use as a context manager. ``data`` is the folder path that
    each host sees as its own (``host_dir(i)`` holds host ``i``'s files)."""

    def __init__(self, n_hosts: int = 2, subnet: int = 231) -> None:
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"mpbr{tag}"
        self.names = [f"mpdh{i}x{tag}" for i in range(n_hosts)]
        self.veths = [f"mpv{i}x{tag}" for i in range(n_hosts)]
        self.gateway = f"10.{subnet}.{os.getpid() % 250}.1"
        self.ips = [self.gateway.rsplit(".", 1)[0] + f".{10 + i}" for i in range(n_hosts)]
        self.root = Path(tempfile.mkdtemp(prefix="mpidp-hosts-"))
        self.data = self.root / "data"  # the path every host sees as its own folder

    def host_dir(self, i: int) -> Path:
        return self.root / self.names[i]

    def __enter__(self) -> Cluster:
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def _up(self) -> None:
        self.data.mkdir()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        cases = []
        for name, veth, ip, i in zip(self.names, self.veths, self.ips, range(len(self.ips))):
            self.host_dir(i).mkdir()
            _ip("netns", "add", name)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", name, "addr", "add", f"{ip}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            cases.append(f"  {ip}) ns={name}; hostdir={self.host_dir(i)};;")
        self.launcher = self.root / "launcher"
        self.launcher.write_text(LAUNCHER % {"cases": "\n".join(cases), "data": self.data})
        self.launcher.chmod(0o755)

    def down(self) -> None:
        """Remove every host, link and file (idempotent), killing what still runs there
        (a rank cut off by a link test may still be shutting down)."""
        for name in self.names:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
            for pid in pids.stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", name, check=False)
        for veth in self.veths:
            _ip("link", "del", veth, check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def link(self, i: int, up: bool) -> None:
        """Cut (or restore) host ``i``'s network link. Restoring also forgets the failed
        address lookups of the cut (else the next job's first connects find no route)."""
        _ip("link", "set", self.veths[i], "up" if up else "down")
        if up:
            for name in self.names:
                _ip("-n", name, "neigh", "flush", "all", check=False)
            _ip("neigh", "flush", "dev", self.bridge, check=False)
            time.sleep(0.5)

    def mpiexec(self, n: int, per_host: int, *cmd: str, hosts: list[int] | None = None,
                tcp: bool = True) -> list[str]:
        """The ``mpiexec`` command line for ``n`` ranks, ``per_host`` per host, on ``hosts``
        (default: all). ``tcp`` forces UCX onto TCP between hosts (no shared-memory paths)."""
        ips = [self.ips[i] for i in (hosts if hosts is not None else range(len(self.ips)))]
        env = ["-genv", "UCX_TLS", "tcp,self", "-genv", "UCX_NET_DEVICES", "eth0"] if tcp else []
        return [MPIEXEC, "-iface", self.bridge, "-launcher", "ssh", "-launcher-exec",
                str(self.launcher), "-hosts", ",".join(ips), "-ppn", str(per_host), "-n", str(n),
                *env, *cmd]


def main(argv: list[str]) -> int:
    n = int(argv[0])
    cmd = argv[argv.index("--") + 1:]
    with Cluster(n) as c:
        return subprocess.call(c.mpiexec(len(c.ips), 1, *cmd))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
