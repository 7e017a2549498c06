"""The server fuzz harness (bench/fuzz_server.py) on every CI run: every JSON path of a valid body of every route
given a value of each JSON type, every path dropped, every known field added with odd values, malformed bodies,
headers and HTTP. No answer may be a 5xx, a dropped connection or an error outside the route's API shape, and
nothing may be logged with a traceback. (`python bench/fuzz_server.py --random 6000` is the long run.)"""

from __future__ import annotations

from helpers import bench_module


def _harness():
    return bench_module("fuzz_server")


def test_fuzzed_requests_get_clean_answers():
    fz_mod = _harness()
    with fz_mod.InProcess() as srv:
        fz = fz_mod.Fuzzer(srv.server.host, srv.server.port, srv.api_key)
        fz_mod.run(fz, n_random=200, seed=1, values=[True, 1.5, "x", [1], {"a": 1}])
        tracebacks = srv.log.tracebacks
        m = srv.state.metrics
        idle = (m.running, m.queue_depth)
    stats = {c: dict(v) for c, v in fz.stats.items()}
    total = sum(sum(v.values()) for v in stats.values())
    assert total > 2900 and set(stats) >= {"valid", "field-type", "field-drop", "field-add", "random", "body",
                                           "headers", "http", "routes"}
    assert stats["valid"] == {"200": sum(stats["valid"].values())}, stats["valid"]   # the bases are valid
    assert not fz.findings, "\n".join(fz.findings[:20])
    assert not tracebacks, tracebacks[:5]
    assert idle == (0, 0)                                 # no request leaked in the engine or the queue
