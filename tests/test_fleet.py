"""The fleet recipe of docs/deploy.md, run small: two `ds4py serve` replicas (demo model) behind vllm-router
(PyPI, in the test extra) with its consistent hash on X-Session-ID, three streamed conversations of four turns,
and one replica SIGKILLed while its requests run (bench/fleet.py does the work; loopback only, bounded)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fleet  # noqa: E402


def test_replicas_behind_vllm_router_keep_sessions_and_survive_a_kill(capsys):
    if fleet.router_command("vllm") is None:
        pytest.skip("vllm-router is not installed (it is in the test extra: pip install -e '.[test]')")
    # as many sessions per replica as conversations: the consistent hash may put all three on one replica, and
    # after the kill the survivor holds them all. With fewer, turns that overlap displace each other's resident
    # state in a chain, and these short prompts (below the disk cache's 512 tokens) are not checkpointed.
    args = ["--conversations", "3", "--turns", "4", "--max-tokens", "2", "--system-repeat", "1",
            "--sessions", "3", "--time-limit", "400"]
    report = fleet.run(fleet.parse_args(args))
    assert report["answered"], report                            # every turn answered (a failed one retried)
    assert report["affinity"] >= 0.95, report                    # each conversation's turns on one replica
    assert set(report["per_replica_requests"]) == {"r0", "r1"}   # X-Replica-Id counted per replica
    assert report["cached_later_turns_min"] > 0, report          # later turns reuse the prompt's KV
    assert not any(report["displaced"].values()), report         # no conversation lost its resident session
    # only requests in flight on the killed replica may fail, and its conversations moved to the other one
    assert report["failures_outside_killed"] == 0, report
    assert report["moved_conversations"], report
    assert all(f["in_flight_on_killed"] for f in report["failures"])
    victims = {f["conversation"] for f in report["failures"]}
    assert victims <= set(report["moved_conversations"])
