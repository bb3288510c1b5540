"""The lab: rates, tbf settings, clear refusals, and (as root) namespaces that are always removed.

The root-only tests use their own namespace prefix (``usbytetest-``), so they never touch a
lab of a concurrent ``usbyte-opt bench``; each checks that nothing with that prefix is left.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from usbyte_opt.bench import netlab as lab_mod
from usbyte_opt.bench.netlab import Lab, LabError, list_namespaces, parse_rate, remove_stale, require_lab, shaping
from usbyte_opt.errors import UsbyteError

PREFIX = "usbytetest-"


def _lab_possible() -> str | None:
    """Why the root-only tests cannot run here (None: they can)."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs ip and tc (iproute2)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if p.returncode != 0:
        return f"`ip netns add` refused here: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


SKIP = _lab_possible()
needs_lab = pytest.mark.skipif(SKIP is not None, reason=f"lab: {SKIP}")


def ours() -> list[str]:
    return [n for n in list_namespaces() if n.startswith(PREFIX)]


# --------------------------------------------------------------------------------------------
# Pure parts
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,bps", [("200mbit", 200_000_000), ("1gbit", 1_000_000_000),
                                      ("1Gbit/s", 1_000_000_000), ("500kbit", 500_000),
                                      (" 2.5 mbit ", 2_500_000)])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["200", "10MB", "200mbps", "fast", "50bit", ""])
def test_parse_rate_refuses(text):
    with pytest.raises(UsbyteError, match="--bandwidth"):
        parse_rate(text)


def test_shaping_burst_and_queue():
    s = shaping(parse_rate("200mbit"))
    assert s.burst_bytes == 16 * 1024 and s.latency_ms == 20.0
    assert s.tc_args() == ["rate", "200000000bit", "burst", "16384", "latency", "20ms"]
    assert shaping(parse_rate("10gbit")).burst_bytes == 625_000  # 0.5 ms of rate


def test_without_root_a_clear_message(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LabError, match="needs root.*leave --bandwidth out"):
        require_lab()
    with pytest.raises(LabError, match="needs root"):
        Lab(2, "200mbit").__enter__()


def test_without_ip_a_clear_message(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(lab_mod.shutil, "which", lambda tool: None if tool == "tc" else "/sbin/" + tool)
    with pytest.raises(LabError, match="needs `tc`.*iproute2"):
        require_lab()


def test_one_rank_is_refused():
    with pytest.raises(UsbyteError, match="at least 2 ranks"):
        Lab(1, "200mbit")


def test_names_and_addresses_are_the_labs_own():
    lab = Lab(3, "1gbit", prefix=PREFIX)
    pid = os.getpid()
    assert lab.namespaces == [f"{PREFIX}{pid}-r{r}" for r in range(3)]
    assert lab.hub == f"{PREFIX}{pid}-hub"
    assert all(a.startswith(f"10.231.{lab.subnet}.") for a in lab.addresses)
    assert lab.command(2, ["python"]) == ["ip", "netns", "exec", f"{PREFIX}{pid}-r2", "python"]
    assert lab.env(1)["MASTER_ADDR"] == lab.addresses[0]
    assert lab.env(1)["GLOO_SOCKET_IFNAME"] == "usb0"


# --------------------------------------------------------------------------------------------
# As root: build, shape, remove on every path
# --------------------------------------------------------------------------------------------


def _qdisc(ns: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", "usb0"],
                          capture_output=True, text=True, timeout=10).stdout


@needs_lab
def test_two_ranks_one_shaped_veth_pair_then_nothing_left():
    with Lab(2, "200mbit", prefix=PREFIX) as lab:
        assert sorted(ours()) == sorted(lab.namespaces)
        for ns in lab.namespaces:
            q = _qdisc(ns)
            assert "tbf" in q and "200Mbit" in q
        # The link carries traffic: rank 1 reaches rank 0's address over the veth.
        probe = ("import socket,sys; s=socket.socket(); s.settimeout(5); "
                 f"s.connect(('{lab.master_addr}', 9)); print('reached')")
        server = subprocess.Popen(lab.command(0, [sys.executable, "-c",
                                  "import socket; s=socket.socket(); s.bind(('0.0.0.0', 9)); "
                                  "s.listen(); c,_=s.accept(); c.close()"]))
        try:
            out = ""
            for _ in range(50):
                p = subprocess.run(lab.command(1, [sys.executable, "-c", probe]),
                                   capture_output=True, text=True, timeout=20)
                out = p.stdout
                if "reached" in out:
                    break
                time.sleep(0.1)
            assert "reached" in out
        finally:
            server.kill()
            server.wait()
    assert ours() == []


@needs_lab
def test_three_ranks_through_a_bridge():
    with Lab(3, "1gbit", prefix=PREFIX) as lab:
        assert len(ours()) == 4  # three ranks and the hub
        assert all("tbf" in _qdisc(ns) for ns in lab.namespaces)
    assert ours() == []


@needs_lab
def test_removed_when_the_body_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with Lab(2, "200mbit", prefix=PREFIX):
            assert len(ours()) == 2
            raise RuntimeError("boom")
    assert ours() == []


@needs_lab
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_removed_when_the_process_is_interrupted(sig):
    code = textwrap.dedent(f"""
        import signal, sys, time
        from usbyte_opt.bench.netlab import Lab
        # Ctrl-C as in a terminal: started from a process that ignores SIGINT (a background
        # job does), this one would inherit that and Python would raise no KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with Lab(2, "200mbit", prefix={PREFIX!r}):
            print("open", flush=True)
            time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "open"
        assert len(ours()) == 2
        p.send_signal(sig)
        try:
            p.wait(timeout=30)   # the cleanup is a few `ip` commands
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            pytest.fail(f"the lab's process did not exit within 30 s of {sig!r}; its stderr:\n{err}")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0
    assert ours() == []


@needs_lab
def test_stale_namespaces_of_dead_processes_are_removed():
    dead = 5_000_000  # above the largest possible pid_max (2**22): no such process
    ns = f"{PREFIX}{dead}-r0"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
    alive = f"{PREFIX}{os.getpid()}-r9"
    subprocess.run(["ip", "netns", "add", alive], check=True, timeout=10)
    try:
        assert remove_stale(PREFIX) == [ns]
        assert ours() == [alive]  # a live process's lab is left alone
    finally:
        subprocess.run(["ip", "netns", "delete", alive], timeout=10)
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=10)
    assert ours() == []
