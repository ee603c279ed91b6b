"""gradcomp_bench.netlink: rate/time parsing, and (as root) a real shaped link between namespaces."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from gradcomp_bench import netlink
from gradcomp_bench.netlink import (Link, LinkUnavailable, check_available, cleanup_stale, measure_rtt,
                              measure_throughput, parse_rate, parse_time)


@pytest.mark.parametrize("text, bps", [
    ("100mbit", 100_000_000), ("1gbit", 1_000_000_000), ("500kbit", 500_000),
    ("10Mbit/s", 10_000_000), ("2.5gbit", 2_500_000_000), (" 1GBIT ", 1_000_000_000),
    ("64000", 64_000), ("750bit", 750), (".5mbit", 500_000), (42, 42),
])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["", "fast", "100 mbps", "100mb", "100m", "-5mbit",
                                  "0mbit", "1e3kbit", "mbit", "10mbit/h", None, 0, -1, 1.5, True])
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError, match=r"bad rate .*expected .*100mbit"):
        parse_rate(text)


@pytest.mark.parametrize("text, seconds", [
    ("50ms", 0.05), ("0.1s", 0.1), ("100us", 1e-4), ("0", 0.0), ("2sec", 2.0), ("5 ms", 0.005),
    ("0ms", 0.0), (0.25, 0.25), (0, 0.0),
])
def test_parse_time(text, seconds):
    assert parse_time(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "50", "fast", "-1ms", "5min", "ms", "1h", None, -0.1,
                                  float("nan"), True])
def test_parse_time_rejects(text):
    with pytest.raises(ValueError, match=r"bad time .*expected .*50ms"):
        parse_time(text)


def test_link_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n must be"):
        Link("10mbit", n=1)
    with pytest.raises(ValueError, match="backend"):
        Link("10mbit", backend="slirp")
    with pytest.raises(ValueError, match="bad rate"):
        Link("10 parsecs")


def test_not_root_is_a_clear_one_line_error(monkeypatch):
    monkeypatch.setattr(netlink, "_AVAILABLE", False)
    monkeypatch.setattr(netlink.os, "geteuid", lambda: 1000)
    with pytest.raises(LinkUnavailable, match="root") as info:
        check_available()
    assert "\n" not in str(info.value)
    with pytest.raises(LinkUnavailable):
        Link("10mbit").open()


def _unavailable():
    try:
        check_available()
    except LinkUnavailable as e:
        return str(e)
    return None


needs_link = pytest.mark.skipif(_unavailable() is not None,
                                reason=f"no shaped link here: {_unavailable()}")


def _netns_list():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@needs_link
def test_rate_is_shaped():
    with Link(parse_rate("50mbit")) as link:
        assert link.backend == "veth" and len(link.addrs) == 2 == len(link.namespaces)
        assert set(link.namespaces) <= _netns_list()
        bps = measure_throughput(link, seconds=1.0)
    assert 35e6 <= bps <= 55e6, f"{bps / 1e6:.1f} Mbit/s through a 50mbit link"


@needs_link
def test_latency_is_added_both_ways():
    with Link("100mbit", latency_s=parse_time("50ms")) as link:
        rtt = measure_rtt(link)
    assert 0.100 <= rtt < 0.5, f"TCP connect took {rtt * 1e3:.1f} ms with 50 ms each way"


@needs_link
def test_tun_fallback_shapes_and_delays():
    """The path kernels without netem take; forced here so it is tested on every kernel."""
    with Link("50mbit", latency_s=0.02, backend="tun") as link:
        assert link.backend == "tun"
        rtt = measure_rtt(link)
        bps = measure_throughput(link, seconds=0.5)
    assert 0.040 <= rtt < 0.4, f"TCP connect took {rtt * 1e3:.1f} ms with 20 ms each way"
    assert 35e6 <= bps <= 55e6, f"{bps / 1e6:.1f} Mbit/s through a 50mbit link"


@needs_link
def test_three_ranks_through_a_hub():
    with Link("50mbit", n=3) as link:
        assert link.addrs[2].endswith(".3") and len(set(link.namespaces)) == 3
        out = subprocess.run(link.prefix(2) + ["ip", "-o", "-4", "addr", "show", link.ifname],
                             capture_output=True, text=True, check=True).stdout
        assert f"{link.addrs[2]}/24" in out
        bps = measure_throughput(link, seconds=0.5, src=0, dst=2)
        namespaces = link.namespaces + [link.hub]
    assert 35e6 <= bps <= 55e6, f"{bps / 1e6:.1f} Mbit/s through a 50mbit link"
    assert not set(namespaces) & _netns_list()


@needs_link
@pytest.mark.parametrize("error", [None, RuntimeError, KeyboardInterrupt])
def test_namespaces_are_deleted_on_exit(error):
    names = []
    try:
        with Link("10mbit") as link:
            names = list(link.namespaces)
            assert set(names) <= _netns_list()
            if error is not None:
                raise error("boom")
    except (RuntimeError, KeyboardInterrupt) as e:
        assert error is not None and isinstance(e, error)
    assert len(names) == 2
    assert not set(names) & _netns_list()
    with pytest.raises(RuntimeError, match="not open"):
        link.prefix(0)


_CHILD = textwrap.dedent("""
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("netlink_child", sys.argv[1])
    nl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nl)
    link = nl.Link("10mbit", n=3)  # never closed by this script
    link.open()
    print(" ".join(link.namespaces + [link.hub]), flush=True)
    if sys.argv[2] == "wait":
        time.sleep(60)
""")


@needs_link
@pytest.mark.parametrize("how", ["sigterm", "exit"])
def test_namespaces_are_deleted_when_the_process_ends(how):
    child = subprocess.Popen([sys.executable, "-c", _CHILD, netlink.__file__,
                              "wait" if how == "sigterm" else "exit"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        names = child.stdout.readline().split()
        assert len(names) == 4, child.stderr.read()
        if how == "sigterm":
            assert set(names) <= _netns_list()
            child.send_signal(signal.SIGTERM)
        child.wait(timeout=15)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == (-signal.SIGTERM if how == "sigterm" else 0)
    assert not set(names) & _netns_list()


@needs_link
def test_cleanup_stale_removes_dead_runs_only():
    dead = f"{netlink.PREFIX}4999999-dead00-0"  # above any pid_max: its creator is gone
    subprocess.run(["ip", "netns", "add", dead], check=True)
    try:
        with Link("10mbit") as link:
            removed = cleanup_stale()
            assert dead in removed
            assert not set(link.namespaces) & set(removed)
            assert set(link.namespaces) <= _netns_list()
        assert dead not in _netns_list()
    finally:
        if dead in _netns_list():
            subprocess.run(["ip", "netns", "del", dead])


def test_helpers_do_not_import_the_package():
    """Helper processes load netlink.py by path: it must stay standard-library only."""
    src = open(netlink.__file__).read()
    assert "from ." not in src and "import torch" not in src and "gradcomp" not in "".join(
        line for line in src.splitlines() if line.startswith(("import ", "from ")))
    assert os.path.isabs(netlink._helper_argv("x")[3])
