"""The doctor's checks one by one, in this process: launch variables, NCCL_SOCKET_IFNAME
matching, the variable table, the cross-rank comparison, the check-in roster (a HashStore),
the straggler naming and the smoke-test verdict."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from trainguard.doctor.checkin import check_in, roster_findings
from trainguard.doctor.collective_phase import stragglers
from trainguard.doctor.compare import compare_ranks, odd_ranks
from trainguard.doctor.findings import DoctorReport, Finding
from trainguard.doctor.rendezvous import read_launch, resolve
from trainguard.doctor.smoke_results import smoke_findings
from trainguard.doctor.variables import check_variables, judge, nccl_interfaces_match


def _fails(findings: list[Finding]) -> list[str]:
    return [f.message for f in findings if f.status == "fail"]


def test_launch_variables_consistent_and_not() -> None:
    launch, found = read_launch(
        {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
         "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    )  # fmt: skip
    assert launch is not None and launch.rank == 1 and launch.world_size == 4
    assert not _fails(found)
    assert not launch.hosts_store  # rank 1 connects; rank 0 hosts
    cases = {
        "RANK=4 but WORLD_SIZE=4": {"RANK": "4", "WORLD_SIZE": "4"},
        "LOCAL_RANK=2 but LOCAL_WORLD_SIZE=2": {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "2",
            "LOCAL_WORLD_SIZE": "2",
        },
        "'two' is not an integer": {"RANK": "0", "WORLD_SIZE": "two"},
        "WORLD_SIZE not": {"RANK": "0"},
        "MASTER_ADDR is not set": {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"},
        "MASTER_PORT=70000 is out of range": {"MASTER_PORT": "70000"},
    }
    for expected, env in cases.items():
        launch, found = read_launch(env)
        assert launch is None, expected
        assert any(expected in m for m in _fails(found)), (expected, found)
    alone, found = read_launch({})
    assert alone is not None and not alone.distributed and alone.hosts_store


def test_agent_store_means_every_rank_connects() -> None:
    launch, _ = read_launch(
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
         "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "x"}
    )  # fmt: skip
    assert launch is not None and launch.torchrun and not launch.hosts_store


def test_restarts_over_a_shared_store_are_flagged_with_the_fix() -> None:
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
                "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_MAX_RESTARTS": "3"}  # fmt: skip
    _, found = read_launch({**torchrun, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    flagged = [f for f in found if f.check == "rendezvous.restart_store"]
    assert [f.status for f in flagged] == ["warn"]
    assert "--max-restarts=3" in flagged[0].message
    assert flagged[0].fix and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in flagged[0].fix
    fresh_store = {**torchrun, "TORCHELASTIC_USE_AGENT_STORE": "False"}
    no_restarts = {
        **torchrun,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }
    for env in (fresh_store, no_restarts):
        _, found = read_launch(env)
        assert not [f for f in found if f.check == "rendezvous.restart_store"], env


def test_resolve_is_bounded_and_names_the_error() -> None:
    addresses, error, _ = resolve("127.0.0.1", 1, 5.0)
    assert addresses == ["127.0.0.1"] and error is None
    addresses, error, took = resolve("no-such-host.invalid", 1, 5.0)
    assert not addresses and error and took <= 5.5


def test_nccl_socket_ifname_semantics() -> None:
    interfaces = ["lo", "eth0", "eth1", "docker0", "ib0"]
    assert nccl_interfaces_match("eth", interfaces) == ["eth0", "eth1"]
    assert nccl_interfaces_match("=eth0", interfaces) == ["eth0"]
    assert nccl_interfaces_match("^docker,lo", interfaces) == ["eth0", "eth1", "ib0"]
    assert nccl_interfaces_match("^=docker0", interfaces) == ["lo", "eth0", "eth1", "ib0"]
    assert nccl_interfaces_match("enp", interfaces) == []


def test_variable_table_flags_risky_settings() -> None:
    rows, found = check_variables(
        {"NCCL_P2P_DISABLE": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "NCCL_DEBUG": "INFO",
         "NCCL_SOCKET_IFNAME": "no-such-if", "NCCL_SOCKT_IFNAME": "eth", "PATH": "/bin"}
    )  # fmt: skip
    status = {f.check.split(".", 1)[1]: f.status for f in found}
    assert status == {
        "NCCL_DEBUG": "info",
        "NCCL_P2P_DISABLE": "warn",
        "NCCL_SOCKET_IFNAME": "fail",
        "NCCL_SOCKT_IFNAME": "warn",  # a typo: did you mean NCCL_SOCKET_IFNAME?
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "warn",
    }
    assert [r["name"] for r in rows] == sorted(status)
    assert judge("NCCL_SOCKT_IFNAME", "eth")[1] == "unknown; did you mean NCCL_SOCKET_IFNAME?"
    assert judge("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")[0] == "info"


def test_compare_names_the_odd_rank() -> None:
    base = {"torch": "2.5.0", "cuda": "12.4", "nccl": "2.21.5", "python": "3.11.9"}
    payloads = {r: {"versions": dict(base), "variables": {"NCCL_IB_HCA": "mlx5"}} for r in range(4)}
    assert [f.check for f in compare_ranks(payloads)] == ["ranks.match"]
    payloads[2]["versions"]["nccl"] = "2.18.1"
    payloads[3]["variables"]["NCCL_DEBUG"] = "INFO"
    found = {f.check: f for f in compare_ranks(payloads)}
    assert found["ranks.nccl"].status == "fail" and found["ranks.nccl"].rank == 2
    assert "rank 2 has '2.18.1'" in found["ranks.nccl"].message
    assert found["ranks.NCCL_DEBUG"].status == "warn" and found["ranks.NCCL_DEBUG"].rank == 3
    assert found["ranks.NCCL_DEBUG"].message == (
        "NCCL_DEBUG differs: rank 3 has 'INFO'; ranks 0, 1, 2 have it unset"
    )
    assert odd_ranks({0: "a", 1: "b"}) == ("a", [1])  # a tie: rank 0's value is the reference
    assert odd_ranks({0: "a", 1: "b", 2: "b"}) == ("b", [0])


def test_check_in_names_a_rank_that_never_came_and_one_that_came_late() -> None:
    store = dist.HashStore()
    payload = {"versions": {}, "variables": {}}
    start = time.monotonic()
    roster = check_in(store, 0, 3, payload, timeout_s=0.5)
    assert time.monotonic() - start < 3
    assert roster.present == [0] and roster.missing == [1, 2]
    messages = [f.message for f in roster_findings(roster, 0, 0.5)]
    assert messages == [
        "rank 1 did not check in within 0.5 s",
        "rank 2 did not check in within 0.5 s",
    ]
    late = check_in(store, 2, 3, payload, timeout_s=0.5)
    assert late.late and roster_findings(late, 2, 0.5)[0].status == "fail"


def test_check_in_all_present() -> None:
    store = dist.HashStore()
    rosters = {}

    def rank(r: int) -> None:
        rosters[r] = check_in(store, r, 2, {"versions": {"r": r}, "variables": {}}, 5.0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert rosters[0].present == rosters[1].present == [0, 1]
    assert rosters[1].payloads[0]["versions"] == {"r": 0}
    assert roster_findings(rosters[1], 1, 5.0)[0].status == "ok"


def test_stragglers_and_stuck_verdict() -> None:
    where = {0: (3, "broadcast"), 1: (2, "all_gather"), 2: (3, "broadcast"), 3: None}
    finding = stragglers(where)
    assert finding is not None and finding.status == "fail"
    assert "rank 1 at all_gather" in finding.message
    assert "rank 3 at nothing (never started)" in finding.message
    assert stragglers({0: (1, "all_reduce"), 1: (1, "all_reduce")}) is None
    outcomes = {
        0: {"results": [], "stuck_in": "all_gather", "error": None},
        1: None,
    }
    found = smoke_findings(outcomes, 5.0, ["all_reduce"])
    assert {(f.check, f.rank) for f in found} == {("smoke.all_gather", 0), ("smoke.report", 1)}


def test_exit_code_counts_warn_and_fail_not_info() -> None:
    report = DoctorReport(rank=None, world_size=1)
    report.add(Finding("environment.gpu", "info", "no GPU"))
    assert report.exit_code == 0
    report.add(Finding("environment.shm", "warn", "small"))
    assert report.exit_code == 1 and report.to_dict()["counts"]["warn"] == 1
