"""Nodes as hosts: each node of a test job in Linux namespaces of its own, on this machine.

A `Fabric` is a private Ethernet segment: a bridge in a network namespace of its own
(the switch), and hosts plugged into it by veth pairs, each with its own address in a
10.213.K.0/24 subnet that no interface of this machine uses. A `Host` holds a network,
IPC, UTS (its own hostname) and mount namespace (a private `/dev/shm` tmpfs) for as long as the fabric lives,
and boots a PID namespace inside them whose PID 1 is `ns_init.py`: killing that init
is a host that vanished with every process on it (its `/dev/shm` stays, as on a host
whose processes all died), and `boot()` starts it again. The test process reaches the
segment through a door of its own (a veth pair with the subnet's `.1` in this machine's
network namespace), so tests and benches talk to Redis and Flight over TCP like any
other host; they dial only the fabric's own addresses.

Faults: `kill()` (the whole host), `cut()`/`mend()` (its link down/up), `freeze()`/
`thaw()` (SIGSTOP/SIGCONT every process of its PID namespace), `fill_shm()`; a single
process is killed through its `HostProcess`.

Everything is torn down by `close()`, and by the kernel if the test process dies: every
namespace holder gets SIGKILL when its parent dies (PR_SET_PDEATHSIG), and a veth pair
goes when either end's namespace does. Needs root and util-linux's unshare/nsenter;
`unavailable()` says why not.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

INIT = Path(__file__).with_name("ns_init.py")
_PR_SET_PDEATHSIG = 1
_WAIT_S = 20.0


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _run(*argv: str, ns: int | None = None, net: bool = True) -> str:
    """Run a setup command, in the network namespace of `ns` when given; fail loudly."""
    cmd = [*(["nsenter", "-t", str(ns), "-n"] if ns is not None and net else []), *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=_WAIT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _until(condition, what: str, timeout: float = _WAIT_S):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def unavailable() -> str | None:
    """Why hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "namespaced hosts need root (unshare of network, IPC, mount and PID namespaces, veth pairs)"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"namespaced hosts need {tool} (util-linux / iproute2) on PATH"
    probe = subprocess.run(
        ["unshare", "--net", "--ipc", "--mount", "--pid", "--fork", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"this kernel or container refuses new namespaces: {probe.stderr.strip()}"
    return None


def _free_subnet() -> int:
    """A K such that 10.213.K.0/24 is on no interface or route of this machine."""
    used = _run("ip", "-4", "addr") + _run("ip", "-4", "route")
    free = [k for k in range(1, 255) if f"10.213.{k}." not in used]
    if not free:
        raise RuntimeError("no free 10.213.K.0/24 subnet for a test fabric")
    return random.choice(free)


class HostProcess:
    """A process started in a host's namespaces. `pid` is its pid on this machine (the
    one to signal); `popen` is the nsenter that waits for it and returns its status."""

    def __init__(self, popen: subprocess.Popen, name: str) -> None:
        self.popen, self.name = popen, name
        found = _until(lambda: (_children(popen.pid) or [None])[0] or popen.poll() is not None, f"{name} to start")
        self.pid: int | None = None if found is True else found  # True: it ended before it showed

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout=timeout)

    def send_signal(self, sig: int) -> None:
        if self.pid is None or self.popen.poll() is not None:
            return  # ended: its pid may be someone else's by now
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode


class Host:
    """One host on a fabric: its own network (one address), IPC and mount namespaces
    (a private /dev/shm of `shm_bytes`), and a PID namespace booted inside them."""

    def __init__(self, fabric: Fabric, name: str, index: int, address: str, shm_bytes: int) -> None:
        self.fabric, self.name, self.address = fabric, name, address
        self.link = f"o{fabric.id}{index:02d}"  # <link>e on the switch, <link>i in the host
        self.holder = subprocess.Popen(
            [
                "unshare",
                "--net",
                "--ipc",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                f"hostname {name} && mount -t tmpfs -o size={shm_bytes},mode=1777 overlord-shm /dev/shm "
                "&& exec sleep infinity",
            ],
            preexec_fn=_die_with_parent,
        )
        _until(lambda: "overlord-shm" in Path(f"/proc/{self.holder.pid}/mountinfo").read_text(), f"{name}'s /dev/shm")
        _run("ip", "link", "add", f"{self.link}e", "type", "veth", "peer", "name", f"{self.link}i")
        _run("ip", "link", "set", f"{self.link}e", "netns", str(fabric.switch.pid))
        _run("ip", "link", "set", f"{self.link}i", "netns", str(self.holder.pid))
        _run("ip", "link", "set", f"{self.link}e", "master", "br0", "up", ns=fabric.switch.pid)
        _run("ip", "addr", "add", f"{address}/24", "dev", f"{self.link}i", ns=self.holder.pid)
        _run("ip", "link", "set", f"{self.link}i", "up", ns=self.holder.pid)
        _run("ip", "link", "set", "lo", "up", ns=self.holder.pid)
        self.boot_proc: subprocess.Popen | None = None
        self.init: int | None = None
        self.boot()

    @property
    def shm(self) -> Path:
        """This host's /dev/shm, as seen from outside it."""
        return Path(f"/proc/{self.holder.pid}/root/dev/shm")

    def boot(self) -> None:
        """Start the host's PID namespace (again, after `kill`)."""
        self.boot_proc = subprocess.Popen(
            [
                "nsenter",
                "-t",
                str(self.holder.pid),
                "-n",
                "-i",
                "-m",
                "-u",
                "--",
                "unshare",
                "--pid",
                "--fork",
                "--kill-child",
                "--mount-proc",
                "--",
                sys.executable,
                str(INIT),
            ],
            preexec_fn=_die_with_parent,
            stderr=subprocess.DEVNULL,  # unshare's own complaint when its child is killed: the point of kill()
        )
        boot = self.boot_proc

        def started() -> int | None:
            for child in _children(boot.pid):
                try:
                    if str(INIT) in Path(f"/proc/{child}/cmdline").read_text():
                        return child
                except FileNotFoundError:
                    pass
            return None

        self.init = _until(started, f"{self.name}'s init")

    def run(
        self, argv: Sequence[str], *, env: dict[str, str] | None = None, log: Path | None = None, name: str = ""
    ) -> HostProcess:
        """Start `argv` on this host (its namespaces, its /proc and /dev/shm, this cwd)."""
        if self.init is None:
            raise RuntimeError(f"host {self.name} is down; boot() it first")
        out = open(log, "ab") if log is not None else subprocess.DEVNULL
        popen = subprocess.Popen(
            ["nsenter", "-t", str(self.init), "-n", "-i", "-m", "-u", "-p", f"--wd={os.getcwd()}", "--", *argv],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        return HostProcess(popen, name or f"{argv[0]} on {self.name}")

    def pids(self) -> list[int]:
        """Every process of the host's PID namespace (pids of this machine), init first."""
        if self.init is None:
            return []
        try:
            ns = os.readlink(f"/proc/{self.init}/ns/pid")
        except FileNotFoundError:
            return []
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.readlink(entry / "ns" / "pid") == ns:
                        found.append(int(entry.name))
                except (FileNotFoundError, ProcessLookupError, PermissionError):
                    pass
        return sorted(found, key=lambda p: p != self.init)

    def processes(self) -> list[tuple[int, int, str, str]]:
        """(pid on this machine, pid in the host, name, state) of each of its processes but init."""
        out = []
        for machine in self.pids()[1:]:
            try:
                lines = Path(f"/proc/{machine}/status").read_text().splitlines()
            except OSError:
                continue  # it ended meanwhile
            status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
            nspids = status.get("NSpid", "").split()
            if nspids:
                out.append((machine, int(nspids[-1]), status.get("Name", "?"), status.get("State", "?")))
        return out

    def machine_pid(self, pid: int) -> int | None:
        """The pid on this machine of the process this host knows as `pid` (its PID
        namespace's; what Redis records, e.g. `active`); None if none runs."""
        return next((machine for machine, inner, _, _ in self.processes() if inner == pid), None)

    def kill(self) -> None:
        """The host vanishes: SIGKILL to its init takes every process with it."""
        if self.init is not None:
            os.kill(self.init, signal.SIGKILL)
            assert self.boot_proc is not None
            self.boot_proc.wait(timeout=_WAIT_S)
        self.init = None

    def freeze(self) -> None:
        """SIGSTOP every process of the host, and wait until each shows stopped."""
        pids = self.pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)

        def stopped() -> bool:
            for pid in pids:
                try:
                    if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "Tt":
                        return False
                except FileNotFoundError:
                    pass
            return True

        _until(stopped, f"every process of {self.name} to stop")

    def thaw(self) -> None:
        for pid in self.pids():
            os.kill(pid, signal.SIGCONT)

    def cut(self) -> None:
        """Its link down (at the switch): the host lives, and nobody reaches it."""
        _run("ip", "link", "set", f"{self.link}e", "down", ns=self.fabric.switch.pid)

    def mend(self) -> None:
        _run("ip", "link", "set", f"{self.link}e", "up", ns=self.fabric.switch.pid)

    def fill_shm(self, leave_bytes: int = 0) -> Path:
        """Take this host's /dev/shm up to `leave_bytes` free; returns the filler to delete."""
        st = os.statvfs(self.shm)
        size = max(0, st.f_bavail * st.f_frsize - leave_bytes)
        filler = self.shm / f"fill-{uuid.uuid4().hex[:6]}"
        with open(filler, "wb") as f:
            if size:
                os.posix_fallocate(f.fileno(), 0, size)
        return filler

    def close(self) -> None:
        if self.init is not None:
            try:
                self.kill()
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.holder.kill()
        self.holder.wait(timeout=_WAIT_S)


class Fabric:
    """A private bridge and the hosts on it; the test process's door is `door`.

    Use as a context manager, or call `close()`."""

    def __init__(self, shm_bytes: int = 256 << 20) -> None:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.id = uuid.uuid4().hex[:4]
        self.subnet = _free_subnet()
        self.shm_bytes = shm_bytes
        self.hosts: dict[str, Host] = {}
        self.switch = subprocess.Popen(["unshare", "--net", "--", "sleep", "infinity"], preexec_fn=_die_with_parent)
        _until(lambda: os.readlink(f"/proc/{self.switch.pid}/ns/net") != os.readlink("/proc/self/ns/net"), "the switch")
        _run("ip", "link", "add", "br0", "type", "bridge", ns=self.switch.pid)
        _run("ip", "link", "set", "br0", "up", ns=self.switch.pid)
        self.door = f"10.213.{self.subnet}.1"
        self._door_link = f"o{self.id}d"
        _run("ip", "link", "add", f"{self._door_link}i", "type", "veth", "peer", "name", f"{self._door_link}e")
        _run("ip", "link", "set", f"{self._door_link}e", "netns", str(self.switch.pid))
        _run("ip", "link", "set", f"{self._door_link}e", "master", "br0", "up", ns=self.switch.pid)
        _run("ip", "addr", "add", f"{self.door}/24", "dev", f"{self._door_link}i")
        _run("ip", "link", "set", f"{self._door_link}i", "up")

    def host(self, name: str) -> Host:
        """A new host on this fabric (addresses .10, .11, ... in the order made)."""
        if name in self.hosts:
            raise ValueError(f"fabric already has a host named {name!r}")
        index = len(self.hosts)  # hosts are never removed: indexes (links, addresses) stay unique
        self.hosts[name] = Host(self, name, index, f"10.213.{self.subnet}.{10 + index}", self.shm_bytes)
        return self.hosts[name]

    def close(self) -> None:
        for host in self.hosts.values():
            try:
                host.close()
            except Exception:  # noqa: BLE001 - tear down the rest
                pass
        self.switch.kill()
        self.switch.wait(timeout=_WAIT_S)
        subprocess.run(["ip", "link", "del", f"{self._door_link}i"], capture_output=True, timeout=_WAIT_S)

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
