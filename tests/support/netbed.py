"""A multi-host test bed on one machine (issue 17): supervisors in network namespaces.

:class:`Host` is a network namespace joined to the test's own by a veth pair. A
:class:`~cyclone_mp.testing.network.FaultProxy` in the test's namespace listens on the
near end's address and forwards to the test's PostgreSQL, so a supervisor started in the
namespace (``Env.start_worker(dsn=host.dsn, prefix=host.prefix)``) reaches the database
only over the veth link, with real TCP. :meth:`Host.partition` takes the near end of the
link down: the far side keeps its route and its carrier state says nothing useful, so
packets vanish without an RST or an ICMP error (the neighbour entries are static, so no
address resolution fails either): a black hole, as a dropped firewall rule or a dead
switch port makes one. Added latency is the proxy's (this kernel has no ``netem``).

Needs root and ``ip netns``; :func:`available` says why not otherwise.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import uuid

from cyclone_mp.testing.env import through, upstream_of
from cyclone_mp.testing.network import FaultProxy


def _ip(*args: str, ns: str | None = None) -> str:
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=10).stdout


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    name = f"cyc-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", name)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"ip netns add failed: {exc}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    return None


class Host:
    """One namespace ("another host") reaching the database at ``dsn`` over a veth link."""

    _count = 0

    def __init__(self, dsn: str) -> None:
        Host._count += 1
        tag = f"{os.getpid() % 10000}{Host._count}"
        self.name = f"cyc-{uuid.uuid4().hex[:8]}"
        self.near, self.far = f"cn{tag}", f"cf{tag}"
        subnet = (os.getpid() * 7 + Host._count) % 250 + 1
        self.near_ip, self.far_ip = f"10.232.{subnet}.1", f"10.232.{subnet}.2"
        _ip("netns", "add", self.name)
        try:
            _ip("link", "add", self.near, "type", "veth", "peer", "name", self.far)
            _ip("link", "set", self.far, "netns", self.name)
            _ip("addr", "add", f"{self.near_ip}/30", "dev", self.near)
            _ip("link", "set", self.near, "up")
            _ip("addr", "add", f"{self.far_ip}/30", "dev", self.far, ns=self.name)
            _ip("link", "set", self.far, "up", ns=self.name)
            _ip("link", "set", "lo", "up", ns=self.name)
            near_mac = open(f"/sys/class/net/{self.near}/address").read().strip()
            far_mac = _ip("link", "show", self.far, ns=self.name).split("link/ether")[1].split()[0]
            _ip("neigh", "replace", self.far_ip, "lladdr", far_mac, "dev", self.near, "nud", "permanent")
            _ip("neigh", "replace", self.near_ip, "lladdr", near_mac, "dev", self.far, "nud", "permanent", ns=self.name)
        except BaseException:
            self.close()
            raise
        self.proxy = FaultProxy(upstream_of(dsn), listen=(self.near_ip, 0))
        self.dsn = through(dsn, self.proxy)
        self.prefix = ["ip", "netns", "exec", self.name]

    def partition(self) -> None:
        """Black-hole the link (see the module docstring)."""
        _ip("link", "set", self.near, "down")

    def heal(self) -> None:
        _ip("link", "set", self.near, "up")

    def close(self) -> None:
        if getattr(self, "proxy", None) is not None:
            self.proxy.close()
        subprocess.run(["ip", "link", "del", self.near], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=10)
