"""Which network interface gloo uses on a node of a multi-node job (launch side: each node's `ft train`, `ft generate`).

ft's own collectives travel over gloo: every step's scalar reductions, the checkpoint agreements, `ft generate`'s final
barrier (the "cpu:gloo,cuda:nccl" group of runtime.backend, and infer/nodes.py's group). Without GLOO_SOCKET_IFNAME,
torch's gloo binds the address this machine's hostname resolves to (ProcessGroupGloo.cpp `createDefaultDevice`:
gethostname, then that name's address, else loopback): 127.0.1.1 on a stock Ubuntu, or a management network the other
nodes cannot reach, and the job fails to rendezvous where NCCL alone would not. With it, gloo binds each listed
interface (ProcessGroupGloo.cpp `Options::create_default`: GLOO_SOCKET_IFNAME split at commas, a device per name).

So each node chooses, before its ranks start: the user's GLOO_SOCKET_IFNAME as it is; else the interface of this
node that NCCL_SOCKET_IFNAME names (NCCL's syntax: prefixes, `=` exact, `^` excluded; gloo wants exact names, and one,
as every rank must open as many devices as the others); else the interface whose address the route to MASTER_ADDR
leaves from (a UDP socket's `connect` looks the route up and sends nothing). On node 0 itself, whose name may resolve
to a loopback address here, the interface of the default route (/proc/net/route). A single node needs none of this.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
from pathlib import Path

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def gloo_environment(master_addr: str | None, nodes: int, out=None) -> dict[str, str]:
    """{"GLOO_SOCKET_IFNAME": name} for this node's ranks when the job spans nodes and the user set none; one line in
    `out` (stderr) says which interface gloo uses and why. {} on one node, or when no interface could be told."""
    if nodes <= 1:
        return {}
    name, why = choose(master_addr or os.environ.get("MASTER_ADDR", ""), os.environ)
    (out or sys.stderr).write(
        f"ft: gloo (ft's own collectives between nodes) uses {name}: {why}\n"
        if name
        else f"ft: gloo's network interface is left to torch (the address this host's name resolves to): {why}; set "
        "GLOO_SOCKET_IFNAME to the interface the nodes reach each other on\n"
    )
    return {"GLOO_SOCKET_IFNAME": name} if name and "GLOO_SOCKET_IFNAME" not in os.environ else {}


def choose(master_addr: str, env) -> tuple[str | None, str]:
    """(interface, why) for gloo on this node: GLOO_SOCKET_IFNAME, else NCCL_SOCKET_IFNAME's interface, else the route
    to `master_addr`'s; (None, why) when none can be told."""
    if env.get("GLOO_SOCKET_IFNAME"):
        return env["GLOO_SOCKET_IFNAME"], "GLOO_SOCKET_IFNAME, as set"
    routed, why = routed_interface(master_addr)
    spec = env.get("NCCL_SOCKET_IFNAME", "")
    if spec:
        picked = from_nccl(spec, [n for _, n in socket.if_nameindex()], routed)
        if picked:
            return picked, f"the interface NCCL_SOCKET_IFNAME={spec} names here"
        why = f"NCCL_SOCKET_IFNAME={spec} names no interface of this node; {why}"
    return routed, why


def routed_interface(master_addr: str) -> tuple[str | None, str]:
    """The interface packets to `master_addr` leave from, or the default route's where the master is this host under
    a name that resolves to loopback here (its other nodes reach it on another address)."""
    try:
        address = route_source(master_addr)
    except OSError as e:
        return (
            default_route_interface(),
            f"MASTER_ADDR {master_addr!r} cannot be routed to here ({e}): the default route",
        )
    if ipaddress.ip_address(address).is_loopback and not _loopback_literal(master_addr):
        return default_route_interface(), f"MASTER_ADDR {master_addr!r} is this host (loopback here): the default route"
    name = interface_of(address)
    if name is None:
        return None, f"no interface of this node has {address}, the source of the route to MASTER_ADDR {master_addr!r}"
    return name, f"{address}, the route to MASTER_ADDR {master_addr!r}"


def route_source(host: str) -> str:
    """The local address the route to `host` leaves from (IPv4 first): a UDP socket's connect sends nothing."""
    infos = sorted(socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM), key=lambda i: i[0] != socket.AF_INET)
    with socket.socket(infos[0][0], socket.SOCK_DGRAM) as s:
        s.connect(infos[0][4])
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the interface that holds `address` (IPv4 through the kernel's SIOCGIFADDR, else psutil where it is
    installed; IPv6 from /proc/net/if_inet6), or None."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.version == 6:
        return _ipv6_interface(ip)
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == str(ip):
                return name
    return _psutil_interface(str(ip))  # SIOCGIFADDR gives an interface's first address only


def _psutil_interface(address: str) -> str | None:
    try:
        import psutil
    except ImportError:
        return None
    return next((n for n, addrs in psutil.net_if_addrs().items() if any(a.address == address for a in addrs)), None)


def _ipv6_interface(ip) -> str | None:
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()  # address, index, length, scope, flags, name
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) == 6 and ipaddress.ip_address(bytes.fromhex(fields[0])) == ip:
            return fields[5]
    return None


def default_route_interface() -> str | None:
    """The interface of the IPv4 default route (/proc/net/route: destination and mask 0), or None."""
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 7 and fields[1] == "00000000" and fields[7] == "00000000":
            return fields[0]
    return None


def from_nccl(spec: str, names: list[str], preferred: str | None) -> str | None:
    """The one interface of `names` that NCCL_SOCKET_IFNAME `spec` selects: `preferred` (the routed one) when it
    does, else the first that does. NCCL's syntax: comma-separated prefixes, `=` for exact names, `^` to exclude."""
    exclude = spec.startswith("^")
    exact = spec.lstrip("^").startswith("=")
    entries = [e for e in spec.lstrip("^").lstrip("=").split(",") if e]

    def named(n: str) -> bool:
        return any(n == e if exact else n.startswith(e) for e in entries)

    fits = [n for n in names if named(n) != exclude and not (exclude and n == "lo")]
    return preferred if preferred in fits else (fits[0] if fits else None)


def _loopback_literal(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
