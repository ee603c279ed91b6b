"""A real rate-limited (and optionally delayed) network link between local processes.

For benchmarks: run each DDP rank inside its own Linux network namespace, joined by a link whose
bandwidth is shaped with ``tc`` and whose one-way latency is added per packet::

    from gradcomp_bench.netlink import Link
    with Link("100mbit", latency_s=0.005, n=2) as link:
        procs = [subprocess.Popen(link.prefix(i) + [sys.executable, "bench.py", "--rank", str(i),
                                                    "--master", link.addrs[0]])
                 for i in range(link.n)]
        ...

Topology: n=2 is one veth pair between the two rank namespaces; n>2 is a hub namespace with a
Linux bridge and one veth pair per rank.  Every rank's egress is shaped with a ``tbf`` qdisc (and
for n>2 the hub's port towards each rank too, so a rank also *receives* at most ``rate``, as
with a real full-duplex NIC).  Latency is a ``netem`` child of that ``tbf``, applied on every
rank's egress, so a round trip costs ``2 * latency_s``.

Kernels built without netem (CONFIG_NET_SCH_NETEM unset) get a fallback when ``latency_s > 0``:
each rank gets a TUN device (shaped by the same ``tbf``) and a small forwarder process, running
outside the namespaces, moves IPv4 packets between them after holding each one ``latency_s``
(for n>2 it also paces what each rank receives at ``rate``, like the hub's tbf).  Its MTU is 9000,
not 1500, so the Python forwarder keeps up with 1 Gbit/s.
``link.backend`` says which was used ("veth" or "tun").  Inside every rank namespace the link's
interface is called ``link.ifname`` ("eth0"; e.g. for ``GLOO_SOCKET_IFNAME``).

Needs root, ``ip``/``tc`` (iproute2) and permission to create network namespaces;
``check_available()`` says why not in one line.  Only addresses in 10.77.0.0/16 are used, and only
inside the namespaces created here (they have no default route), so no traffic leaves them.

This module only uses the standard library: its helper processes load this file by path, without
importing the ``gradcomp_bench`` package (and torch).
"""
from __future__ import annotations

import atexit
import collections
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time

__all__ = ["Link", "LinkUnavailable", "check_available", "cleanup_stale", "measure_rtt",
           "measure_throughput", "parse_rate", "parse_time"]

PREFIX = "gcb"
IFNAME = "eth0"
TUN_MTU = 9000  # jumbo frames on the TUN fallback: 6x fewer packets through the Python forwarder

_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])


class LinkUnavailable(RuntimeError):
    """This machine (or this user) cannot create a shaped link; the message says why."""


# ----------------------------------------------------------------------------------- parsing

_RATE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}  # SI, as tc uses for bit/s
_RATE_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(?:([kmgt]?)bit(?:/s)?)?", re.IGNORECASE)
_RATE_FORMS = ("a positive number of bits per second with a unit: '500kbit', '100mbit', "
               "'2.5gbit', '10Mbit/s', '1tbit' (a bare number means bit/s)")

_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
_TIME_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(s|sec|ms|msec|us|usec)?", re.IGNORECASE)
_TIME_FORMS = "a non-negative time with a unit: '50ms', '0.1s', '100us' (or a bare '0')"


def parse_rate(text) -> int:
    """Bits per second from '100mbit', '1gbit', '500kbit', '10Mbit/s', '2.5gbit' (SI prefixes)."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    m = _RATE_RE.fullmatch(text.strip().replace(" ", "")) if isinstance(text, str) else None
    if m is not None:
        bps = round(float(m.group(1)) * _RATE_UNITS[(m.group(2) or "").lower()])
        if bps > 0:
            return bps
    raise ValueError(f"bad rate {text!r}: expected {_RATE_FORMS}")


def parse_time(text) -> float:
    """Seconds from '50ms', '0.1s', '100us', '0'."""
    if isinstance(text, (int, float)) and not isinstance(text, bool) and 0 <= text < float("inf"):
        return float(text)
    m = _TIME_RE.fullmatch(text.strip().replace(" ", "")) if isinstance(text, str) else None
    if m is not None:
        value = float(m.group(1))
        if m.group(2) is not None:
            return value * _TIME_UNITS[m.group(2).lower()]
        if value == 0:
            return 0.0
    raise ValueError(f"bad time {text!r}: expected {_TIME_FORMS}")


# ---------------------------------------------------------------------------- availability

def _which(name):
    return shutil.which(name) or shutil.which(name, path=_PATH)


def _tool(name):
    """argv[0] for iproute2's `name`: the bare name when it is on PATH, else where it was found."""
    if shutil.which(name):
        return name
    return _which(name) or name


def _run(argv, check=True, input=None):
    proc = subprocess.run(argv, capture_output=True, text=True, input=input)
    if check and proc.returncode != 0:
        err = " ".join((proc.stderr or proc.stdout).split())
        raise RuntimeError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {err}")
    return proc


def _one_line(text):
    return " ".join(str(text).split())


_AVAILABLE = False  # cached once everything checked out


def check_available() -> None:
    """Raise LinkUnavailable (one-line reason) unless this process can build a Link."""
    global _AVAILABLE
    if _AVAILABLE:
        return
    if not sys.platform.startswith("linux"):
        raise LinkUnavailable(f"network namespaces need Linux (this is {sys.platform})")
    if os.geteuid() != 0:
        raise LinkUnavailable(f"needs root to create network namespaces (running as uid "
                              f"{os.geteuid()}); run the benchmark with sudo")
    for tool in ("ip", "tc"):
        if _which(tool) is None:
            raise LinkUnavailable(f"'{tool}' not found on PATH or in /usr/sbin, /sbin: "
                                  f"install iproute2")
    probe = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
    ip = _tool("ip")
    proc = _run([ip, "netns", "add", probe], check=False)
    if proc.returncode != 0:
        raise LinkUnavailable(f"cannot create a network namespace: {_one_line(proc.stderr)}")
    try:
        for argv, what in (([ip, "netns", "exec", probe, ip, "link", "set", "lo", "up"],
                            "run a command inside a network namespace"),
                           ([_tool("tc"), "-n", probe, "qdisc", "add", "dev", "lo", "root",
                             "handle", "1:", "tbf", "rate", "1mbit", "burst", "32768",
                             "limit", "65536"], "add a tbf qdisc (CONFIG_NET_SCH_TBF)")):
            proc = _run(argv, check=False)
            if proc.returncode != 0:
                raise LinkUnavailable(f"cannot {what}: {_one_line(proc.stderr)}")
    finally:
        _run([ip, "netns", "del", probe], check=False)
    _AVAILABLE = True


_NETEM = None  # None: not probed yet


def _netem_available(ns):
    """Whether the kernel has the netem qdisc (probed once, on `ns`'s loopback)."""
    global _NETEM
    if _NETEM is None:
        tc = _tool("tc")
        proc = _run([tc, "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                    check=False)
        _NETEM = proc.returncode == 0
        if _NETEM:
            _run([tc, "-n", ns, "qdisc", "del", "dev", "lo", "root"], check=False)
    return _NETEM


# ------------------------------------------------------------------ cleanup on every exit path

_LIVE: set = set()
_LIVE_LOCK = threading.RLock()
_HANDLERS = False


def _cleanup_all():
    with _LIVE_LOCK:
        links = list(_LIVE)
    for link in links:
        try:
            link.close()
        except Exception:  # noqa: BLE001 - best effort at exit: clean up the others too
            pass


def _on_signal(previous, signum, frame):
    _cleanup_all()
    if callable(previous):
        previous(signum, frame)
    else:  # default action (terminate) as if we had never been here
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_handlers():
    global _HANDLERS
    if _HANDLERS:
        return
    _HANDLERS = True
    atexit.register(_cleanup_all)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still covers exit
    for signum in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN:
            continue
        signal.signal(signum, lambda s, f, previous=previous: _on_signal(previous, s, f))


def _netns_list():
    proc = _run([_tool("ip"), "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _pid_alive(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = PREFIX, force: bool = False) -> list[str]:
    """Delete namespaces named `prefix`... left behind by crashed runs; return their names.

    Names carry the creating process id; a namespace whose creator is still alive belongs to a
    running benchmark and is kept unless `force`.  Namespaces of this process's own open Links
    are always kept.
    """
    with _LIVE_LOCK:
        mine = {name for link in _LIVE for name in link._all_namespaces}
    pid_re = re.compile(re.escape(prefix) + r"(\d+)-")
    removed = []
    for name in _netns_list():
        if not name.startswith(prefix) or name in mine:
            continue
        m = pid_re.match(name)
        owner = int(m.group(1)) if m else None
        if not force and owner is not None and owner != os.getpid() and _pid_alive(owner):
            continue
        if _run([_tool("ip"), "netns", "del", name], check=False).returncode == 0:
            removed.append(name)
    return removed


# --------------------------------------------------------------------------------- the link

def _burst_bytes(rate_bps):
    # tbf refills its bucket from timer ticks (HZ can be as low as 100-250): the bucket must hold
    # at least one tick's worth of bytes (rate/8/250 for HZ=250) or it throttles below `rate`; and
    # at least 32 KiB so a jumbo (TUN) frame or a chunk of a segmented GSO packet always fits.
    # Bigger would only let short bursts run above `rate`.
    return max(rate_bps // 8 // 250, 32 * 1024)


def _queue_seconds(latency_s):
    # queue up to 50 ms plus one round trip at the shaped rate: enough for TCP to keep the link
    # busy (buffer >= bandwidth-delay product) without unbounded bufferbloat
    return 0.05 + 2 * latency_s


class Link:
    """`with Link(rate_bps, latency_s=0.0, n=2) as link:` n namespaces joined by a shaped link.

    rate_bps: bits/s (int) or a string for parse_rate ("100mbit"); latency_s: one-way delay in
    seconds (float) or a string for parse_time ("5ms"), added to every packet each rank sends.
    backend: "auto" (veth + netem, or the TUN fallback when latency is asked for and the kernel
    has no netem), "veth" or "tun".

    Attributes: addrs[i] (IPv4 of rank i), namespaces[i] (netns name), ifname (interface name
    inside each namespace), backend, n, rate_bps, latency_s; prefix(i) -> argv prefix that runs a
    command inside rank i's namespace.
    """

    def __init__(self, rate_bps, latency_s=0.0, n: int = 2, *, backend: str = "auto"):
        self.rate_bps = parse_rate(rate_bps)
        self.latency_s = parse_time(latency_s)
        if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 250:
            raise ValueError(f"n must be an int in [2, 250], got {n!r}")
        if backend not in ("auto", "veth", "tun"):
            raise ValueError(f"backend must be 'auto', 'veth' or 'tun', got {backend!r}")
        self.n = n
        self.ifname = IFNAME
        self.backend = backend
        self.namespaces: list[str] = []
        self.addrs: list[str] = []
        self.hub = None
        self._all_namespaces: list[str] = []
        self._forwarder = None
        self._owner = None
        self._lock = threading.RLock()

    # -- lifecycle --
    def __enter__(self):
        self.open()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        state = "open" if self._owner is not None else "closed"
        return (f"Link(rate_bps={self.rate_bps}, latency_s={self.latency_s}, n={self.n}, "
                f"backend={self.backend!r}, {state}, addrs={self.addrs})")

    def prefix(self, i: int) -> list[str]:
        """argv prefix that runs a command inside rank i's namespace."""
        if self._owner is None:
            raise RuntimeError("the Link is not open")
        return [_tool("ip"), "netns", "exec", self.namespaces[i]]

    def open(self):
        if self._owner is not None:
            raise RuntimeError("the Link is already open")
        check_available()
        tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        subnet = f"10.77.{secrets.randbelow(256)}"
        self.namespaces = [f"{tag}-{i}" for i in range(self.n)]
        self.addrs = [f"{subnet}.{i + 1}" for i in range(self.n)]
        self.hub = None
        self._tag = tag
        self._owner = os.getpid()
        with _LIVE_LOCK:
            _install_handlers()
            _LIVE.add(self)
        try:
            for name in self.namespaces:
                self._add_netns(name)
            backend = self.backend
            if backend == "auto":
                backend = ("veth" if self.latency_s == 0 or _netem_available(self.namespaces[0])
                           else "tun")
            if backend == "tun":
                self._build_tun(subnet)
            else:
                if self.latency_s > 0 and not _netem_available(self.namespaces[0]):
                    raise LinkUnavailable("this kernel has no netem qdisc "
                                          "(CONFIG_NET_SCH_NETEM); use backend='tun'")
                self._build_veth()
            self.backend = backend
        except BaseException:
            self.close()
            raise
        return self

    def close(self):
        """Delete everything this Link created (idempotent; safe from signal handlers).

        The Link stays registered for the atexit/signal cleanup until everything is gone, so an
        interrupted close() is finished at exit.
        """
        with self._lock:
            if self._owner is None:
                return
            if self._owner != os.getpid():  # a forked child: the parent's to delete, not ours
                self._owner = None
                with _LIVE_LOCK:
                    _LIVE.discard(self)
                return
            forwarder, self._forwarder = self._forwarder, None
            if forwarder is not None:
                _stop(forwarder)
            ip = _tool("ip")
            while self._all_namespaces:
                name = self._all_namespaces[-1]
                _run([ip, "netns", "del", name], check=False)
                if self._all_namespaces and self._all_namespaces[-1] == name:
                    self._all_namespaces.pop()
            self._owner = None
            with _LIVE_LOCK:
                _LIVE.discard(self)

    # -- building --
    def _add_netns(self, name):
        ip = _tool("ip")
        self._all_namespaces.append(name)  # before creating: a half-made one is deleted too
        _run([ip, "netns", "add", name])
        _run([ip, "-n", name, "link", "set", "lo", "up"])

    def _shape(self, ns, dev, netem):
        """tbf at `rate` on dev's egress, with a netem `latency` child when `netem`."""
        tc = _tool("tc")
        burst = _burst_bytes(self.rate_bps)
        limit = max(2 * burst, int(self.rate_bps / 8 * _queue_seconds(self.latency_s)))
        _run([tc, "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
              "rate", f"{self.rate_bps}bit", "burst", str(burst), "limit", str(limit)])
        if netem:
            # netem replaces tbf's internal fifo, so it holds the queue: room for the packets in
            # flight during the delay plus the tbf backlog, counted in MTU-sized packets, x2
            # for the small ones (ACKs)
            packets = 1000 + 2 * int(self.rate_bps / 8 * (self.latency_s + _queue_seconds(
                self.latency_s)) / 1500)
            _run([tc, "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                  "netem", "delay", f"{self.latency_s * 1e6:.0f}us", "limit", str(packets)])

    def _build_veth(self):
        ip = _tool("ip")
        netem = self.latency_s > 0
        if self.n == 2:
            a, b = self.namespaces
            _run([ip, "link", "add", IFNAME, "netns", a, "type", "veth",
                  "peer", "name", IFNAME, "netns", b])
            pairs = []
        else:
            self.hub = f"{self._tag}-hub"
            self._add_netns(self.hub)
            _run([ip, "-n", self.hub, "link", "add", "br0", "type", "bridge"])
            _run([ip, "-n", self.hub, "link", "set", "br0", "up"])
            for i, name in enumerate(self.namespaces):
                port = f"p{i}"
                _run([ip, "link", "add", IFNAME, "netns", name, "type", "veth",
                      "peer", "name", port, "netns", self.hub])
                _run([ip, "-n", self.hub, "link", "set", port, "master", "br0"])
                _run([ip, "-n", self.hub, "link", "set", port, "up"])
            pairs = [f"p{i}" for i in range(self.n)]
        for name, addr in zip(self.namespaces, self.addrs):
            _run([ip, "-n", name, "addr", "add", f"{addr}/24", "dev", IFNAME])
            _run([ip, "-n", name, "link", "set", IFNAME, "up"])
            self._shape(name, IFNAME, netem)
        for port in pairs:
            # the hub's port towards a rank: caps what the rank receives, as a switch port would
            self._shape(self.hub, port, False)

    def _build_tun(self, subnet):
        if not os.path.exists("/dev/net/tun"):
            raise LinkUnavailable("no /dev/net/tun (CONFIG_TUN) for the latency fallback")
        ip = _tool("ip")
        argv = _helper_argv("forward", str(self.latency_s), str(self.rate_bps),
                            str(_queue_seconds(self.latency_s)), subnet, *self.namespaces)
        self._forwarder = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, start_new_session=True)
        line = self._forwarder.stdout.readline()
        if line.strip() != b"ready":
            forwarder, self._forwarder = self._forwarder, None
            err = _stop(forwarder)
            raise RuntimeError(f"link forwarder failed to start: {_one_line(err or line)}")
        for name, addr in zip(self.namespaces, self.addrs):
            _run([ip, "-n", name, "link", "set", IFNAME, "mtu", str(TUN_MTU)])
            _run([ip, "-n", name, "addr", "add", f"{addr}/24", "dev", IFNAME])
            _run([ip, "-n", name, "link", "set", IFNAME, "up"])
            self._shape(name, IFNAME, False)


def _stop(proc, timeout=3.0):
    """Stop a helper process: close its stdin (it exits on EOF), then kill; return its stderr."""
    try:
        if proc.stdin:
            proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    err = b""
    if proc.stderr:
        try:
            err = proc.stderr.read()
        except (OSError, ValueError):
            pass
        proc.stderr.close()
    if proc.stdout:
        proc.stdout.close()
    return err.decode(errors="replace") if isinstance(err, bytes) else err


# ------------------------------------------------------------------- helper processes

def _helper_argv(*args):
    """argv that runs _helper_main(args) from this file in a fresh interpreter, stdlib only."""
    code = ("import importlib.util as u, sys; s = u.spec_from_file_location('_gcb_netlink', "
            "sys.argv[1]); m = u.module_from_spec(s); s.loader.exec_module(m); "
            "sys.exit(m._helper_main(sys.argv[2:]))")
    return [sys.executable, "-c", code, os.path.abspath(__file__), *args]


def _setns(name):
    """Move this (single-threaded) process into network namespace `name`."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "setns"):  # Python >= 3.12
            os.setns(fd, os.CLONE_NEWNET)
        else:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                err = ctypes.get_errno()
                raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _open_tun(ifname):
    import fcntl
    import struct
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    ifr = struct.pack("16sH22x", ifname.encode(), 0x0001 | 0x1000)  # IFF_TUN | IFF_NO_PI
    fcntl.ioctl(fd, 0x400454CA, ifr)  # TUNSETIFF
    return fd


def _forward(latency_s, rate_bps, queue_s, subnet, names):
    """The TUN fallback's wire: rank i's tun -> (hold latency_s) -> the destination's tun.

    For n > 2 it also paces what it hands to each destination at rate_bps (the hub port's
    egress; the ranks' own egress is shaped by tbf on their tun), dropping what would wait
    longer than queue_s, as a switch would.  Exits when its stdin closes (owner gone).
    """
    import select
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the owner, who then stops us
    fds = []
    for name in names:
        _setns(name)
        fds.append(_open_tun(IFNAME))
    n = len(fds)
    net = bytes(int(x) for x in subnet.split("."))
    pace = n > 2
    queues = [collections.deque() for _ in range(n)]  # (release time, packet) in time order
    next_free = [0.0] * n
    rank_of = {fd: i for i, fd in enumerate(fds)}
    poller = select.epoll()
    for fd in fds:
        poller.register(fd, select.EPOLLIN)
    stdin = sys.stdin.fileno()
    poller.register(stdin, select.EPOLLIN)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    clock = time.monotonic
    while True:
        due = min((q[0][0] for q in queues if q), default=None)
        timeout = -1 if due is None else max(0.0, due - clock())
        for fd, _ in poller.poll(timeout):
            if fd == stdin:
                if not os.read(stdin, 4096):
                    return 0
                continue
            src = rank_of[fd]
            for _ in range(512):
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    return 0  # the namespace and its device are gone
                # IPv4 to one of the other ranks; anything else (IPv6 chatter) goes nowhere
                if len(pkt) < 20 or pkt[0] >> 4 != 4 or pkt[16:19] != net:
                    continue
                dst = pkt[19] - 1
                if not 0 <= dst < n or dst == src:
                    continue
                now = clock()
                release = now + latency_s
                if pace:
                    start = max(release, next_free[dst])
                    if start - release > queue_s:
                        continue  # port queue full: drop, as a switch does
                    release = next_free[dst] = start + len(pkt) * 8 / rate_bps
                queues[dst].append((release, pkt))
        now = clock()
        for dst, queue in enumerate(queues):
            while queue and queue[0][0] <= now:
                try:
                    os.write(fds[dst], queue.popleft()[1])
                except BlockingIOError:
                    pass
                except OSError:
                    return 0


def _recv(bind_addr, seconds, warmup):
    """Throughput sink: print the port, accept one sender, print bits/s over the window."""
    import socket
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((bind_addr, 0))
    srv.listen(1)
    srv.settimeout(15.0)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.settimeout(15.0)
    buf = bytearray(1 << 20)
    total = 0
    t_first = start = end = None
    while True:
        k = conn.recv_into(buf)
        if not k:
            break
        total += k
        now = time.monotonic()
        if t_first is None:
            t_first = now
        elif start is None and now >= t_first + warmup:
            start = (now, total)
        elif start is not None and now >= start[0] + seconds:
            end = (now, total)
            break
    conn.close()
    srv.close()
    if end is None:
        print("sender stopped early", file=sys.stderr)
        return 1
    print((end[1] - start[1]) * 8 / (end[0] - start[0]), flush=True)
    return 0


def _send(addr, port):
    """Throughput source: send zeros as fast as the link takes them until the sink hangs up."""
    import socket
    sock = socket.create_connection((addr, int(port)), timeout=15.0)
    chunk = bytes(1 << 20)
    try:
        while True:
            sock.sendall(chunk)
    except OSError:
        return 0


def _rtt_server(bind_addr):
    import socket
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((bind_addr, 0))
    srv.listen(64)
    print(srv.getsockname()[1], flush=True)
    sys.stdin.read()  # the kernel completes handshakes; just stay until told to stop
    return 0


def _rtt_client(addr, port, count):
    """Print each TCP connect time: SYN out, SYN-ACK back = one round trip."""
    import socket
    for _ in range(int(count)):
        t = time.perf_counter()
        sock = socket.create_connection((addr, int(port)), timeout=15.0)
        print(time.perf_counter() - t, flush=True)
        sock.close()
    return 0


def _helper_main(argv):
    cmd, args = argv[0], argv[1:]
    if cmd == "forward":
        return _forward(float(args[0]), int(args[1]), float(args[2]), args[3], args[4:])
    if cmd == "recv":
        return _recv(args[0], float(args[1]), float(args[2]))
    if cmd == "send":
        return _send(args[0], args[1])
    if cmd == "rtt-server":
        return _rtt_server(args[0])
    if cmd == "rtt-client":
        return _rtt_client(args[0], args[1], args[2])
    raise SystemExit(f"unknown helper {cmd!r}")


# ------------------------------------------------------------------------- verification

def _check_ranks(link, src, dst):
    if link._owner is None:
        raise RuntimeError("the Link is not open")
    if src == dst or not (0 <= src < link.n and 0 <= dst < link.n):
        raise ValueError(f"need two different ranks in [0, {link.n}), got {src} and {dst}")


def measure_throughput(link: Link, seconds: float = 2.0, src: int = 0, dst: int = 1,
                       warmup: float = 0.25) -> float:
    """TCP goodput in bits/s from rank src to rank dst, measured over `seconds` after `warmup`.

    Goodput excludes TCP/IP headers, so it is ~4% under the shaped rate at MTU 1500.
    """
    _check_ranks(link, src, dst)
    recv = subprocess.Popen(link.prefix(dst) + _helper_argv("recv", link.addrs[dst], str(seconds),
                                                            str(warmup)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    send = None
    try:
        port = recv.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"throughput receiver failed: {_one_line(recv.stderr.read())}")
        send = subprocess.Popen(link.prefix(src) + _helper_argv("send", link.addrs[dst], port),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        out, err = recv.communicate(timeout=seconds + warmup + 30 + 20 * link.latency_s)
        if recv.returncode != 0:
            raise RuntimeError(f"throughput measurement failed: {_one_line(err)}")
        return float(out.strip().splitlines()[-1])
    finally:
        for proc in (send, recv):
            if proc is not None:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                for f in (proc.stdout, proc.stderr):
                    if f:
                        f.close()


def measure_rtt(link: Link, src: int = 0, dst: int = 1, count: int = 3) -> float:
    """Round-trip time in seconds from rank src to dst: the fastest of `count` TCP connects."""
    _check_ranks(link, src, dst)
    server = subprocess.Popen(link.prefix(dst) + _helper_argv("rtt-server", link.addrs[dst]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"rtt server failed: {_one_line(server.stderr.read())}")
        proc = subprocess.run(link.prefix(src) + _helper_argv("rtt-client", link.addrs[dst], port,
                                                              str(count)),
                              capture_output=True, text=True, timeout=30 + 10 * count)
        if proc.returncode != 0:
            raise RuntimeError(f"rtt client failed: {_one_line(proc.stderr)}")
        return min(float(x) for x in proc.stdout.split())
    finally:
        _stop(server)
