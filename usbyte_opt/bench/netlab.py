"""The lab (docs/design.md §7): ranks on this machine joined by a real, slow, shaped network.

A loopback network is too fast to show a communication bottleneck. As root on Linux,
:class:`Lab` gives every rank its own network namespace and joins them with veth links shaped
by ``tc ... tbf`` (token bucket: a rate limit without added delay; these kernels have no netem):

* 2 ranks: one veth pair, one end in each rank's namespace (interface ``usb0`` on both
  sides), tbf on both ends, so each direction of the link carries ``rate``.
* more ranks: a hub namespace with a Linux bridge, one veth pair per rank (rank end ``usb0``,
  hub end attached to the bridge), tbf on both ends of every pair: each rank's uplink and
  downlink carry ``rate``, as with one switch port per host.

With ``ranks_per_node`` G > 1 it is the **two-level lab**: one namespace per *node*
(``usbyte-<pid>-n<node>``), the node's G ranks sharing it, so that traffic between ranks of
one node stays on that namespace's loopback (fast, as NVLink is against the NIC) while traffic
between nodes crosses the shaped links, joined as above (2 nodes: one veth pair; more: the
hub). Ranks are grouped as torchrun numbers them: node k holds global ranks k*G .. k*G+G-1,
and :meth:`Lab.env` gives each rank torchrun's ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK`` and ``GROUP_WORLD_SIZE``; :meth:`Lab.torchrun` is the command that starts a
node's ranks with torchrun itself.

Names and addresses are the lab's own: namespaces ``usbyte-<pid>-r<rank>`` (two-level:
``usbyte-<pid>-n<node>``; and ``usbyte-<pid>-hub``), addresses ``10.231.<k>.<i + 1>/24``
(``i`` the rank, or the node) with ``k`` derived from the pid, inside those namespaces only.
Nothing is created in the host's own namespace, so deleting the namespaces removes every link.
They are deleted on every exit path: normal exit, errors, Ctrl-C, SIGTERM/SIGHUP (turned into
:class:`SystemExit` while the lab is open) and interpreter exit. A lab killed with SIGKILL
leaves its namespaces behind; the next :class:`Lab` removes those of processes that no longer
exist (only names with the ``usbyte-`` prefix).

MTU 9000 on every link (jumbo frames, as data-centre and HPC networks run them): at 1500
bytes the veth + tbf + TCP path costs the cores that train many times more CPU per
all-reduce, work a real NIC does in hardware, so the lab's communication would steal compute
that a real network does not (measured in ``docs/bench.md``, "The lab").

Shaping (``tbf rate R burst B latency L``), chosen by :func:`shaping`:

* ``burst`` = max(16 KiB, two frames, 0.5 ms of rate): a real link sends nothing faster than
  its rate, and tbf's bucket lets ``burst`` bytes through at memory speed after an idle
  spell, which makes small all-reduces look faster than the line and the fitted ``algbw``
  too high; less than 0.5 ms of rate starves a fast link between timer wake-ups (both
  measured in ``docs/bench.md``, "The lab"). tbf re-segments TCP's 64 KiB offload packets
  that exceed the burst.
* ``latency`` = 20 ms of queue: with one TCP flow per direction, enough to keep the link busy
  through the sender's window growth, small enough not to add bufferbloat to the few
  small messages a collective exchanges.

Example::

    >>> parse_rate("200mbit"), parse_rate("1Gbit/s"), parse_rate("1.5gbit")
    (200000000, 1000000000, 1500000000)
    >>> s = shaping(parse_rate("200mbit"))
    >>> s.burst_bytes, s.latency_ms
    (16384, 20.0)
    >>> shaping(parse_rate("200mbit"), mtu=9000).burst_bytes
    18000
    >>> shaping(parse_rate("1gbit")).burst_bytes
    62500
    >>> with Lab(2, "200mbit") as lab:          # doctest: +SKIP
    ...     lab.command(1, ["python", "-c", "print(1)"])[:4], lab.master_addr
    (['ip', 'netns', 'exec', 'usbyte-4242-r1'], '10.231.243.1')
    >>> two = Lab(4, "200mbit", ranks_per_node=2, prefix="x-")   # 2 nodes x 2 ranks
    >>> two.nodes, two.node_of(3), two.command(3, ["python"])[3].endswith("-n1")
    (2, 1, True)
    >>> {k: two.env(3)[k] for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    {'LOCAL_RANK': '1', 'LOCAL_WORLD_SIZE': '2', 'GROUP_RANK': '1'}
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import UsbyteError

#: Every namespace the lab creates starts with this (stale clean-up touches nothing else).
PREFIX = "usbyte-"
#: Interface name of each rank's end of its link (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME).
IFNAME = "usb0"
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class LabError(UsbyteError):
    """The lab cannot be built here (not root, no ``ip``/``tc``, namespaces refused)."""


def parse_rate(text: str) -> int:
    """Bits per second of a rate written as tc writes it: ``200mbit``, ``1gbit``, ``500kbit``
    (an optional ``/s``, any case). Megabytes (tc's ``mbps``) are refused: too easily misread.

    Example::

        >>> parse_rate("25mbit")
        25000000
        >>> parse_rate("10MB")
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.UsbyteError: --bandwidth '10MB': expected a rate in bits such as 200mbit, 1gbit or 500kbit
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmg]?bit)(?:/s)?\s*", str(text).lower())
    if not m:
        raise UsbyteError(f"--bandwidth {text!r}: expected a rate in bits such as 200mbit, 1gbit "
                          "or 500kbit")
    bps = int(round(float(m.group(1)) * _UNITS[m.group(2)]))
    if bps < 100_000:
        raise UsbyteError(f"--bandwidth {text!r}: expected at least 100kbit (gloo's own timeouts "
                          "would fire below that)")
    return bps


def format_rate(bps: float) -> str:
    """``200 Mbit/s``-style text of a rate in bits per second.

    Example::

        >>> format_rate(2e8), format_rate(1e9), format_rate(1.5e9)
        ('200 Mbit/s', '1 Gbit/s', '1.5 Gbit/s')
    """
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:g} bit/s"


@dataclass(frozen=True, slots=True)
class Shaping:
    """tbf settings of every link end."""

    rate_bps: int
    burst_bytes: int
    latency_ms: float

    def tc_args(self) -> list[str]:
        return ["rate", f"{self.rate_bps}bit", "burst", str(self.burst_bytes),
                "latency", f"{self.latency_ms:g}ms"]

    def describe(self) -> str:
        return (f"tbf rate {format_rate(self.rate_bps)}, burst {self.burst_bytes // 1024} KiB, "
                f"latency {self.latency_ms:g} ms")


def shaping(rate_bps: int, latency_ms: float = 20.0, mtu: int = 1500) -> Shaping:
    """The tbf settings for ``rate_bps`` (see the module docstring for the reasons)."""
    burst = max(16 * 1024, 2 * mtu, int(rate_bps / 8 * 0.0005))
    return Shaping(int(rate_bps), burst, float(latency_ms))


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        first = (p.stderr or p.stdout).strip().splitlines()
        raise LabError(f"lab: `{' '.join(argv)}` failed: {first[0] if first else f'exit {p.returncode}'}")
    return p


def list_namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows (empty when it cannot list them)."""
    p = _run(["ip", "netns", "list"], check=False)
    if p.returncode != 0:
        return []
    return [ln.split()[0] for ln in p.stdout.splitlines() if ln.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str) -> None:
    """SIGKILL the processes still inside ``ns`` (ranks of the lab that owns it)."""
    p = _run(["ip", "netns", "pids", ns], check=False)
    for tok in p.stdout.split():
        if tok.isdigit() and int(tok) != os.getpid():
            try:
                os.kill(int(tok), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces of labs whose process is gone (a crash, SIGKILL); return them.

    Only names ``<prefix><pid>-...`` are considered, and only when ``pid`` no longer runs.
    """
    removed = []
    for ns in list_namespaces():
        m = re.fullmatch(re.escape(prefix) + r"(\d+)-.+", ns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_inside(ns)
            _run(["ip", "netns", "delete", ns], check=False)
            removed.append(ns)
    return removed


def tx_bytes(ifname: str = IFNAME, table: str = "/proc/net/dev") -> int | None:
    """Bytes this process's network namespace has sent on ``ifname`` (the kernel's counter in
    ``table``, ``/proc/net/dev``, which each namespace has its own of); ``None`` when it has no
    such interface. Inside the lab, what a node sent on its shaped link.

    Example::

        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".dev", delete=False) as f:
        ...     _ = f.write("Inter-|   Receive |  Transmit\\n face |bytes packets|bytes packets\\n"
        ...                 "    lo: 10 1 0 0 0 0 0 0 10 1 0 0 0 0 0 0\\n"
        ...                 "  usb0: 700 5 0 0 0 0 0 0 9000 7 0 0 0 0 0 0\\n")
        >>> tx_bytes("usb0", f.name), tx_bytes("eth9", f.name)
        (9000, None)
    """
    try:
        with open(table) as f:
            for line in f:
                name, sep, rest = line.partition(":")
                if sep and name.strip() == ifname:
                    return int(rest.split()[8])
    except (OSError, ValueError, IndexError):
        return None
    return None


def require_lab() -> None:
    """Raise :class:`LabError` (one line, with what to do) unless the lab can be built here."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        raise LabError("--bandwidth needs Linux network namespaces; leave --bandwidth out to use the "
                       "ordinary network")
    if os.geteuid() != 0:
        raise LabError("--bandwidth needs root: the lab creates network namespaces, veth links and "
                       "tc shaping (run as root, or leave --bandwidth out to use the ordinary network)")
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise LabError(f"--bandwidth needs `{tool}` (package {pkg}), which is not on PATH")


def node_env(rank: int, world_size: int, ranks_per_node: int) -> dict[str, str]:
    """torchrun's variables for global rank ``rank`` of ``world_size`` ranks in nodes of
    ``ranks_per_node``: node k holds ranks k*G .. k*G+G-1 (``RANK = GROUP_RANK *
    LOCAL_WORLD_SIZE + LOCAL_RANK``, as torchrun numbers them).

    Example::

        >>> node_env(5, 8, 4)   # doctest: +NORMALIZE_WHITESPACE
        {'RANK': '5', 'WORLD_SIZE': '8', 'LOCAL_RANK': '1', 'LOCAL_WORLD_SIZE': '4',
         'GROUP_RANK': '1', 'GROUP_WORLD_SIZE': '2'}
    """
    g = int(ranks_per_node)
    if g < 1 or world_size % g or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of {world_size} in nodes of {ranks_per_node}")
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % g),
            "LOCAL_WORLD_SIZE": str(g), "GROUP_RANK": str(rank // g),
            "GROUP_WORLD_SIZE": str(world_size // g)}


def check_nodes(nodes: int, ranks_per_node: int) -> None:
    """Refuse a node layout that makes no two-level lab (one line naming the option).

    Example::

        >>> check_nodes(2, 2)
        >>> check_nodes(0, 2)
        Traceback (most recent call last):
        ...
        usbyte_opt.errors.UsbyteError: --nodes 0: expected an integer >= 1
    """
    if nodes < 1:
        raise UsbyteError(f"--nodes {nodes}: expected an integer >= 1")
    if ranks_per_node < 1:
        raise UsbyteError(f"--nproc-per-node {ranks_per_node}: expected an integer >= 1")
    if nodes * ranks_per_node > 250:
        raise UsbyteError(f"--nodes {nodes} x --nproc-per-node {ranks_per_node}: the lab holds at "
                          "most 250 ranks on one machine")


class Lab:
    """Network namespaces joined by tbf-shaped veth links: one namespace per rank, or with
    ``ranks_per_node`` > 1 one per node (the two-level lab: a node's ranks share its
    namespace and talk over its loopback; nodes talk over the shaped links).

    Args:
        world_size: number of ranks (>= 2; with ``ranks_per_node`` a multiple of it, for at
            least 2 nodes).
        rate: link rate, e.g. ``"200mbit"`` (or bits per second as an int).
        latency_ms: tbf queue length in ms of ``rate``.
        mtu: MTU of every link (default 9000, jumbo frames as in data-centre networks; see
            the module docstring).
        prefix: name prefix of the namespaces (tests use their own).
        ranks_per_node: ranks sharing one namespace (a node); 1 (default): one namespace per
            rank, as before nodes existed.

    Use it as a context manager; :meth:`command` wraps a rank's argv in ``ip netns exec`` (of
    its node's namespace) and :meth:`env` gives the rank's rendezvous variables.
    """

    def __init__(self, world_size: int = 2, rate: str | int = "200mbit", latency_ms: float = 20.0,
                 prefix: str = PREFIX, mtu: int = 9000, ranks_per_node: int = 1):
        g = int(ranks_per_node)
        if g > 1:
            check_nodes(world_size // g, g)
            if world_size % g or world_size // g < 2:
                raise UsbyteError(f"--nodes {world_size // g}: the two-level lab needs at least 2 "
                                  f"nodes of {g} ranks (got {world_size} ranks)")
        elif world_size < 2:
            raise UsbyteError(f"--nproc-per-node {world_size}: the lab needs at least 2 ranks")
        self.world_size = world_size
        self.ranks_per_node = max(1, g)
        self.nodes = world_size // self.ranks_per_node
        self.shaping = shaping(parse_rate(rate) if isinstance(rate, str) else int(rate), latency_ms,
                               mtu)
        self.mtu = int(mtu)
        self.prefix = prefix
        pid = os.getpid()
        tag = "n" if self.ranks_per_node > 1 else "r"
        #: One namespace per node (per rank when ``ranks_per_node`` is 1).
        self.namespaces = [f"{prefix}{pid}-{tag}{k}" for k in range(self.nodes)]
        self.hub = f"{prefix}{pid}-hub" if self.nodes > 2 else None
        self.subnet = 1 + pid % 254  # 10.231.<subnet>.0/24
        #: Each namespace's address on its ``usb0`` (a node's ranks share it).
        self.addresses = [f"10.231.{self.subnet}.{k + 1}" for k in range(self.nodes)]
        self._created: list[str] = []
        self._lock = threading.Lock()
        self._saved: dict[int, Any] = {}
        self._open = False

    # -- what ranks need ---------------------------------------------------------------------

    @property
    def master_addr(self) -> str:
        return self.addresses[0]

    def node_of(self, rank: int) -> int:
        """The node (namespace index) of global rank ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank}: expected 0 .. {self.world_size - 1}")
        return rank // self.ranks_per_node

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside rank ``rank``'s namespace (its node's)."""
        return ["ip", "netns", "exec", self.namespaces[self.node_of(rank)], *argv]

    def env(self, rank: int) -> dict[str, str]:
        """Rendezvous variables of rank ``rank``: MASTER_ADDR and the interface for gloo/NCCL;
        in the two-level lab also torchrun's node variables (:func:`node_env`)."""
        # NCCL would otherwise move bytes between GPUs of one host through shared memory or
        # peer-to-peer copies, past the shaped link. (Two-level: gloo binds every rank to its
        # node's usb0 address; a rank of the same node is that same address, which the kernel
        # routes over the namespace's loopback, so only bytes between nodes meet the tbf.)
        env = {"MASTER_ADDR": self.master_addr, "GLOO_SOCKET_IFNAME": IFNAME,
               "NCCL_SOCKET_IFNAME": IFNAME, "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
               "NCCL_IB_DISABLE": "1"}
        if self.ranks_per_node > 1:
            env.update(node_env(rank, self.world_size, self.ranks_per_node))
        return env

    def torchrun(self, node: int, argv: Sequence[str], port: int = 29500) -> list[str]:
        """The command that starts node ``node``'s ranks with torchrun inside its namespace,
        meeting at node 0's address (``--nnodes``, ``--nproc-per-node``, ``--node-rank``):
        run it once per node, with :meth:`env`'s interface variables in the environment.

        Example::

            >>> Lab(4, "1gbit", ranks_per_node=2, prefix="x-").torchrun(1, ["train.py"])[5:]
            ... # doctest: +ELLIPSIS, +NORMALIZE_WHITESPACE
            ['-m', 'torch.distributed.run', '--nnodes', '2', '--nproc-per-node', '2',
             '--node-rank', '1', '--master-addr', '10.231...1', '--master-port', '29500',
             'train.py']
        """
        import sys

        if not 0 <= node < self.nodes:
            raise ValueError(f"node {node}: expected 0 .. {self.nodes - 1}")
        return ["ip", "netns", "exec", self.namespaces[node], sys.executable, "-m",
                "torch.distributed.run", "--nnodes", str(self.nodes), "--nproc-per-node",
                str(self.ranks_per_node), "--node-rank", str(node), "--master-addr",
                self.master_addr, "--master-port", str(port), *argv]

    def link_bytes(self) -> list[int]:
        """Bytes each namespace has sent on its ``usb0`` so far (the shaped link's own
        counter, as ``tc -s qdisc`` reports it), in namespace order."""
        out = []
        for ns in self.namespaces:
            p = _run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", IFNAME])
            m = re.search(r"Sent (\d+) bytes", p.stdout)
            out.append(int(m.group(1)) if m else 0)
        return out

    def describe(self) -> str:
        n = self.nodes
        topo = "veth pair" if n == 2 else f"bridge, {n} veth pairs"
        if self.ranks_per_node > 1:
            return (f"{n} nodes of {self.ranks_per_node} ranks, one namespace each (the node's "
                    f"ranks over its loopback, nodes over a {topo}), 10.231.{self.subnet}.0/24, "
                    f"{self.shaping.describe()} on every link end")
        return (f"{n} namespaces ({topo}), 10.231.{self.subnet}.0/24, "
                f"{self.shaping.describe()} on every link end")

    # -- life cycle --------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        require_lab()
        remove_stale(self.prefix)
        self._install_signals()
        atexit.register(self.close)
        self._open = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _ns(self, name: str) -> None:
        p = _run(["ip", "netns", "add", name], check=False)
        if p.returncode != 0:
            first = p.stderr.strip().splitlines()
            raise LabError(f"lab: cannot create network namespace {name} "
                           f"({first[0] if first else 'exit ' + str(p.returncode)}); the lab needs "
                           "CAP_SYS_ADMIN and a writable /run/netns")
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _shape(self, ns: str, dev: str) -> None:
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
              *self.shaping.tc_args()])

    def _build(self) -> None:
        for ns in self.namespaces:
            self._ns(ns)
        if self.hub is None:
            a, b = self.namespaces
            _run(["ip", "link", "add", IFNAME, "netns", a, "type", "veth", "peer", "name", IFNAME,
                  "netns", b])
            ends = [(a, IFNAME), (b, IFNAME)]
        else:
            self._ns(self.hub)
            _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
            ends = []
            for r, ns in enumerate(self.namespaces):
                port = f"p{r}"
                _run(["ip", "link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", port,
                      "netns", self.hub])
                _run(["ip", "-n", self.hub, "link", "set", port, "master", "br0"])
                _run(["ip", "-n", self.hub, "link", "set", port, "up"])
                ends += [(ns, IFNAME), (self.hub, port)]
        if self.hub is not None:
            _run(["ip", "-n", self.hub, "link", "set", "br0", "mtu", str(self.mtu)])
        for ns, dev in ends:
            _run(["ip", "-n", ns, "link", "set", dev, "mtu", str(self.mtu)])
        for k, ns in enumerate(self.namespaces):
            _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[k]}/24", "dev", IFNAME])
            _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
        for ns, dev in ends:
            self._shape(ns, dev)

    def close(self) -> None:
        """Delete every namespace this lab created (idempotent; safe from any exit path)."""
        with self._lock:
            if not self._open:
                return
            self._open = False
            for ns in reversed(self._created):
                _kill_inside(ns)
                _run(["ip", "netns", "delete", ns], check=False)
            self._created.clear()
            self._restore_signals()
            try:
                atexit.unregister(self.close)
            except Exception:  # noqa: BLE001 - interpreter shutting down
                pass

    # -- signals -----------------------------------------------------------------------------

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; atexit still cleans up

        def handler(signum: int, frame: Any) -> None:
            # Unwind through every `with` and `finally` (the lab's __exit__ included).
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._saved[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):
                pass

    def _restore_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._saved.items():
            try:
                signal.signal(sig, old)
            except (ValueError, OSError, TypeError):
                pass
        self._saved.clear()


class LoopbackNodes:
    """Ranks grouped into nodes on this machine's loopback, without a lab: every rank gets
    torchrun's node variables (:func:`node_env`), so that what reads the topology (the
    profiler, the planner, the runtime's subgroups) sees ``world_size // ranks_per_node``
    nodes, but nothing between them is shaped: it checks the flow, not the network. It has
    the surface :func:`usbyte_opt.launcher.run_ranks` takes as ``lab``.

    Example::

        >>> with LoopbackNodes(4, 2) as nodes:
        ...     nodes.command(3, ["python"]), nodes.env(3)["GROUP_RANK"], nodes.master_addr
        (['python'], '1', '127.0.0.1')
    """

    def __init__(self, world_size: int, ranks_per_node: int):
        check_nodes(world_size // max(1, ranks_per_node), ranks_per_node)
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.nodes = world_size // ranks_per_node
        self.master_addr = "127.0.0.1"
        self.port: int | None = None

    def __enter__(self) -> LoopbackNodes:
        from ..launcher import free_port

        self.port = free_port()
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` itself: every rank runs on this machine."""
        return list(argv)

    def env(self, rank: int) -> dict[str, str]:
        """torchrun's variables of rank ``rank`` (its node's), the rendezvous port, and gloo
        on the loopback interface (a job spanning nodes must name the one they meet on)."""
        env = {**node_env(rank, self.world_size, self.ranks_per_node), "GLOO_SOCKET_IFNAME": "lo"}
        if self.port is not None:
            env["MASTER_PORT"] = str(self.port)
        return env

    def describe(self) -> str:
        return (f"{self.nodes} nodes of {self.ranks_per_node} ranks on this machine's loopback "
                "(nothing shaped between them)")


__all__ = ["IFNAME", "Lab", "LabError", "LoopbackNodes", "PREFIX", "Shaping", "check_nodes", "format_rate",
           "list_namespaces", "node_env", "parse_rate", "require_lab", "remove_stale", "shaping", "tx_bytes"]
