"""The one launcher, gradcomp_bench.launch.spawn: local processes, or processes inside a shaped
link's network namespaces (root and iproute2), with the same results and failure reports."""
import os

import pytest
import torch
import torch.distributed as dist

from gradcomp_bench.launch import RankError, spawn
from gradcomp_bench.netlink import Link, LinkUnavailable, check_available


def _where(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"sum": t.item(), "rank": dist.get_rank(), "world": dist.get_world_size(),
            "local": (os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")),
            "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "netns": os.readlink("/proc/self/ns/net")}


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one gives up")
    return rank


def _link_reason():
    try:
        check_available()
    except LinkUnavailable as e:
        return str(e)
    return None


needs_link = pytest.mark.skipif(_link_reason() is not None, reason=f"no shaped link: {_link_reason()}")


def test_local_ranks_with_nodes_get_torchruns_local_variables():
    out = spawn(_where, 4, per_node=2, timeout=120)
    assert [o["sum"] for o in out] == [10.0] * 4
    assert [o["local"] for o in out] == [("0", "2"), ("1", "2"), ("0", "2"), ("1", "2")]


def test_bad_node_sizes_are_refused():
    with pytest.raises(ValueError, match="per_node=3: expected an integer >= 1 dividing world=4"):
        spawn(_where, 4, per_node=3)
    with pytest.raises(ValueError, match="per_node=0"):
        spawn(_where, 2, per_node=0)


@needs_link
def test_ranks_inside_a_link_run_in_their_nodes_namespaces():
    with Link("1gbit", n=2) as link:
        out = spawn(_where, 4, per_node=2, link=link, timeout=120)
    assert [o["sum"] for o in out] == [10.0] * 4
    assert [(o["rank"], o["world"]) for o in out] == [(r, 4) for r in range(4)]
    assert [o["local"] for o in out] == [("0", "2"), ("1", "2"), ("0", "2"), ("1", "2")]
    assert all(o["ifname"] == link.ifname for o in out)
    mine = os.readlink("/proc/self/ns/net")
    ns = [o["netns"] for o in out]
    assert ns[0] == ns[1] != ns[2] == ns[3] and mine not in ns


@needs_link
def test_a_failing_rank_inside_a_link_is_reported_with_its_traceback():
    with Link("1gbit", n=2) as link:
        with pytest.raises(RankError, match="rank one gives up") as info:
            spawn(_fail_on_one, 2, link=link, timeout=120, pg_timeout=10)
    assert set(info.value.errors) == {1}
    assert "ValueError" in info.value.errors[1]


def test_a_link_for_another_node_count_is_refused():
    class TwoNodes:
        n = 2
    with pytest.raises(ValueError, match="the link joins 2 nodes; world=3 with per_node=1 needs 3"):
        spawn(_where, 3, link=TwoNodes())


def _env(rank, world, names):
    print(f"rank {rank} says hello", flush=True)
    return {n: os.environ.get(n) for n in names}, os.getppid()


@pytest.mark.parametrize("how", ["forkserver", "spawn"])
def test_a_rank_sees_the_callers_environment_and_output_at_the_time_of_the_call(
        how, monkeypatch, capfd):
    """Ranks come from a fork server started at the first call (its environment and output
    are that call's); a variable set later by the caller, or removed, must reach the ranks as
    it is now, ``env=`` still on top, and what a rank prints must land where the caller's
    output goes now (here: this test's capture), as with fresh interpreters."""
    monkeypatch.setenv("GRADCOMP_SPAWN", how)
    spawn(_env, 2, args=([],), timeout=120)  # the server exists from here on
    capfd.readouterr()
    monkeypatch.setenv("GRADCOMP_TEST_LATE", "late")
    monkeypatch.delenv("GRADCOMP_KERNELS", raising=False)
    out = spawn(_env, 2, args=(["GRADCOMP_TEST_LATE", "GRADCOMP_KERNELS", "GRADCOMP_TEST_ENV"],),
                env={"GRADCOMP_TEST_ENV": "x"}, timeout=120)
    for seen, parent in out:
        assert seen == {"GRADCOMP_TEST_LATE": "late", "GRADCOMP_KERNELS": None,
                        "GRADCOMP_TEST_ENV": "x"}
        assert (parent == os.getpid()) == (how == "spawn")  # forked by the server, or not
    printed = capfd.readouterr().out
    assert "rank 0 says hello" in printed and "rank 1 says hello" in printed


def test_variables_read_at_start_change_the_ranks_to_fresh_interpreters(monkeypatch):
    """A forked rank keeps what the server read when it started (OpenMP, malloc, torch's
    debug level...): a call that sets one differently gets fresh interpreters instead."""
    monkeypatch.setenv("GRADCOMP_SPAWN", "forkserver")
    [(_, parent)] = spawn(_env, 1, args=([],), timeout=120)
    assert parent != os.getpid()
    [(seen, parent)] = spawn(_env, 1, args=(["TORCH_DISTRIBUTED_DEBUG"],), timeout=120,
                             env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert parent == os.getpid() and seen == {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    [(_, parent)] = spawn(_env, 1, args=([],), timeout=120)
    assert parent == os.getpid()
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    # what torch.compile sets in the caller's environment does not: the suite compiles
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/elsewhere")
    [(seen, parent)] = spawn(_env, 1, args=(["TORCHINDUCTOR_CACHE_DIR"],), timeout=120)
    assert parent != os.getpid() and seen == {"TORCHINDUCTOR_CACHE_DIR": "/tmp/elsewhere"}


def test_a_bad_start_method_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("GRADCOMP_SPAWN", "fork")
    with pytest.raises(ValueError, match="GRADCOMP_SPAWN='fork': expected 'forkserver' or 'spawn'"):
        spawn(_env, 2, args=([],))
