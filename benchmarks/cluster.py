"""Test hosts made from Linux network namespaces, for multi-host MPI runs on one machine.

Each host has its own network stack (a veth pair into a shared bridge, its own address in a
private test subnet), its own hostname (a UTS namespace, so MPI sees separate nodes) and
its own view of one data folder (a mount namespace with a private bind mount), so a file
can exist on one host and not another. ``mpiexec`` (MPICH's Hydra, or Open MPI's prterun:
:meth:`Cluster.prterun`) reaches the hosts through its ordinary host list and a launcher
that enters the host's namespaces in place of ssh. Traffic stays between the bridge and
these hosts. Needs root and iproute2; everything is removed on exit, also when a test fails.

``rate_bits`` (or :meth:`Cluster.limit` between runs) makes each host's link a slower one: a
token bucket (``tc qdisc ... tbf``) on both of its directions, the bridge side's egress
(into the host) and the host's own ``eth0`` egress (out of it). :meth:`Cluster.link_bytes`
reads the bytes that crossed each host's link from the bridge-side veth's counters.

Run by hand: ``python -m benchmarks.cluster 2 -- python -m mpidp train ...``
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
_MADE = 0  # clusters this process has made
BURST_S = 400e-6  # a rate limit's bucket holds this long at the rate, at least MIN_BURST bytes
MIN_BURST = 128 * 1024  # two full-size GSO packets: tbf never splits one, nor waits per packet
QUEUE_S = 0.005  # the longest a packet may wait in the bucket's queue before it is dropped

LAUNCHER = """#!/bin/sh
# ssh stand-in for mpiexec: launcher HOST COMMAND... (ssh options before HOST are ignored)
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
%(cases)s
  *) echo "launcher: unknown test host $host" >&2; exit 1;;
esac
exec ip netns exec "$ns" unshare --uts --mount sh -c \\
  'hostname "$1" && mount --bind "$2" "$3" && exec sh -c "$4"' sh "$ns" "$hostdir" %(data)s "$*"
"""

# receiver / sender of Cluster.transfer: ADDRESS PORT NBYTES; the receiver prints "ready"
# once listening, then the seconds from the first byte to the last
RECEIVE = """import socket, sys, time
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
c, _ = s.accept()
buf, left, t0 = bytearray(1 << 20), int(sys.argv[3]), None
while left > 0:
    k = c.recv_into(buf)
    if not k:
        sys.exit("transfer: the sender closed early")
    t0, left = t0 or time.perf_counter(), left - k
print(time.perf_counter() - t0)
"""
SEND = """import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block, left = bytes(1 << 20), int(sys.argv[3])
while left > 0:
    c.sendall(block[:left])
    left -= len(block)
c.close()
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


def limits_available() -> str | None:
    """None if test hosts with rate limits (:meth:`Cluster.limit`) can be made here, else
    the reason they cannot."""
    return available() or (None if shutil.which("tc") else "rate limits need tc (iproute2)")


def _ip(*args: str, check: bool = True) -> None:
    _cmd("ip", *args, check=check)


def _cmd(*args: str, check: bool = True) -> None:
    r = subprocess.run(args, capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")


def tbf_args(rate_bits: float) -> list[str]:
    """``tc`` arguments of a token bucket that passes ``rate_bits`` bits/s.

    The bucket (``burst``, bytes) is what the link lets through at full speed after an idle
    spell: 400 us at the rate, at least 128 KiB (128 KiB at 1 Gbit/s, 500 KB at 10 Gbit/s).
    That is small against the megabytes of a step's exchange, so the idle link of a compute
    phase hides little of the next transfer, yet big enough that TCP reaches the rate: a
    bucket under one 64 KiB GSO packet makes tbf split every packet and wake per segment,
    and a transfer between the hosts then falls well short of the rate. The queue
    (``latency``) holds 5 ms at the rate: TCP's bursts are not dropped, and round trips
    stay short.
    """
    if not (rate_bits > 0 and rate_bits < float("inf")) or int(rate_bits) < 1:
        raise ValueError(f"rate must be a finite number of bits/s >= 1, got {rate_bits!r}")
    burst = max(int(rate_bits / 8 * BURST_S), MIN_BURST)
    return ["tbf", "rate", f"{int(rate_bits)}bit", "burst", str(burst),
            "latency", f"{QUEUE_S * 1e6:.0f}us"]


@dataclass(frozen=True)
class LinkBytes:
    """Bytes that crossed one host's link, as its bridge-side veth counts them (frames:
    payload plus TCP/IP/Ethernet headers). ``sent``: out of the host; ``received``: into it."""

    sent: int
    received: int

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.sent - other.sent, self.received - other.received)


class Cluster:
    """``n_hosts`` test hosts; use as a context manager. ``data`` is the folder path that
    each host sees as its own (``host_dir(i)`` holds host ``i``'s files)."""

    def __init__(self, n_hosts: int = 2, subnet: int = 231, rate_bits: float | None = None,
                 mtu: int | None = None) -> None:
        global _MADE
        _MADE += 1  # several clusters of one process: names of their own
        tag = f"{os.getpid() % 100000}{'' if _MADE == 1 else chr(ord('a') + (_MADE - 2) % 26)}"
        self.bridge = f"mpbr{tag}"
        self.names = [f"mpdh{i}x{tag}" for i in range(n_hosts)]
        self.veths = [f"mpv{i}x{tag}" for i in range(n_hosts)]
        self.subnet, self.net = subnet, (os.getpid() + _MADE - 1) % 250
        self._set_net(self.net)
        self.root = Path(tempfile.mkdtemp(prefix="mpidp-hosts-"))
        self.data = self.root / "data"  # the path every host sees as its own folder
        self.rate_bits, self.mtu = rate_bits, mtu

    def _set_net(self, net: int) -> None:
        self.net, self.gateway = net, f"10.{self.subnet}.{net}.1"
        self.ips = [f"10.{self.subnet}.{net}.{10 + i}" for i in range(len(self.names))]

    def _free_net(self) -> None:
        """Move to the first ``10.subnet.x.0/24`` from this one on that no interface uses
        (another cluster's, whose process number matched this one's modulo 250)."""
        shown = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                               text=True).stdout
        used = {int(w.split(".")[2]) for w in shown.split()
                if w.startswith(f"10.{self.subnet}.") and w.count(".") == 3}
        free = [k % 250 for k in range(self.net, self.net + 250) if k % 250 not in used]
        if not free:
            raise RuntimeError(f"no free 10.{self.subnet}.x.0/24 for the test hosts")
        self._set_net(free[0])

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
        self._free_net()
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
        if self.mtu is not None:
            self.set_mtu(self.mtu)
        self.limit(self.rate_bits)
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

    def set_mtu(self, mtu: int) -> None:
        """Every host link's MTU (bytes, 68-65535): both ends of each veth and the bridge."""
        if not 68 <= mtu <= 65535:
            raise ValueError(f"MTU must be 68-65535 bytes, got {mtu!r}")
        self.mtu = mtu
        for name, veth in zip(self.names, self.veths):
            _ip("link", "set", veth, "mtu", str(mtu))
            _ip("-n", name, "link", "set", "eth0", "mtu", str(mtu))
        _ip("link", "set", self.bridge, "mtu", str(mtu))

    def limit(self, rate_bits: float | None) -> None:
        """Limit every host's link to ``rate_bits`` bits/s each way (None: no limit, the
        veth's own speed). May be called again between runs to change the rate."""
        if rate_bits is not None and shutil.which("tc") is None:
            raise RuntimeError("rate limits need tc: install iproute2")
        self.rate_bits = rate_bits
        for name, veth in zip(self.names, self.veths):
            for ns, dev in ((None, veth), (name, "eth0")):
                where = ["-n", ns] if ns else []
                if rate_bits is None:
                    _cmd("tc", *where, "qdisc", "del", "dev", dev, "root", check=False)
                else:
                    _cmd("tc", *where, "qdisc", "replace", "dev", dev, "root", *tbf_args(rate_bits))

    def link_bytes(self) -> list[LinkBytes]:
        """Bytes each host's link has carried so far (its bridge-side veth's counters: what
        the veth received came out of the host). Subtract two readings for an interval."""
        def read(veth: str, what: str) -> int:
            return int(Path(f"/sys/class/net/{veth}/statistics/{what}_bytes").read_text())
        return [LinkBytes(sent=read(v, "rx"), received=read(v, "tx")) for v in self.veths]

    def transfer(self, src: int, dst: int, n_bytes: int, port: int = 5601,
                 timeout: float = 60) -> float:
        """Send ``n_bytes`` over TCP from host ``src`` to host ``dst``; return the seconds the
        receiver took from the first byte to the last."""
        ns = lambda i, code: ["ip", "netns", "exec", self.names[i], sys.executable, "-c", code,
                              self.ips[dst], str(port), str(n_bytes)]
        with subprocess.Popen(ns(dst, RECEIVE), stdout=subprocess.PIPE, text=True) as rx:
            try:
                if rx.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"transfer: the receiver on host {dst} did not start")
                subprocess.run(ns(src, SEND), check=True, timeout=timeout)
                out, _ = rx.communicate(timeout=timeout)
            finally:
                rx.kill()
        if rx.returncode:
            raise RuntimeError(f"transfer from host {src} to host {dst} failed")
        return float(out)

    def mpiexec(self, n: int, per_host: int, *cmd: str, hosts: list[int] | None = None,
                tcp: bool = True) -> list[str]:
        """The ``mpiexec`` command line for ``n`` ranks, ``per_host`` per host, on ``hosts``
        (default: all). ``tcp`` forces UCX onto TCP between hosts (no shared-memory paths)."""
        ips = [self.ips[i] for i in (hosts if hosts is not None else range(len(self.ips)))]
        env = ["-genv", "UCX_TLS", "tcp,self", "-genv", "UCX_NET_DEVICES", "eth0"] if tcp else []
        return [MPIEXEC, "-iface", self.bridge, "-launcher", "ssh", "-launcher-exec",
                str(self.launcher), "-hosts", ",".join(ips), "-ppn", str(per_host), "-n", str(n),
                *env, *cmd]

    def prterun(self, n: int, per_host: int, *cmd: str) -> list[str]:
        """Open MPI's ``mpiexec`` (prterun) command line for ``n`` ranks, ``per_host`` per
        host: its daemons started through the same launcher, every connection (the daemons'
        and the ranks' TCP transport) kept on the test subnet."""
        hostfile = self.root / "hostfile"
        hostfile.write_text("".join(f"{ip} slots={per_host}\n" for ip in self.ips))
        net = f"10.{self.subnet}.{self.net}.0/24"
        return [MPIEXEC, "--prtemca", "plm_ssh_agent", str(self.launcher), "--hostfile",
                str(hostfile), "--prtemca", "oob_tcp_if_include", net, "--mca",
                "btl_tcp_if_include", net, "--map-by", f"ppr:{per_host}:node", "-n", str(n),
                *cmd]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[0].isdigit() or int(argv[0]) < 1 or argv[1] != "--":
        print("usage: cluster.py N_HOSTS -- COMMAND...  (as root: runs COMMAND under "
              "mpiexec with one rank on each of N_HOSTS test hosts)", file=sys.stderr)
        return 2
    n = int(argv[0])
    cmd = argv[2:]
    with Cluster(n) as c:
        return subprocess.call(c.mpiexec(len(c.ips), 1, *cmd))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
