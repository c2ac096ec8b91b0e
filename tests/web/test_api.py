"""The web view's JSON, SSE and Prometheus endpoints, and `swarm status`, against known counts.

RunStats is fed a scripted history (two nodes, known tokens, lags, refusals and sample times), so
every rate and count below is exact.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from swarm import status
from trainer.node_registry import NodeRegistry
from trainer.stats import EvalRow, RunStats, StepRow
from trainer.web.view import WebView

A, B = "a" * 64, "b" * 64
TREE = {"origin": "http://127.0.0.1:1", "trees": 1, "fanout": 4, "latest": 3, "versions": [2, 3],
        "origin_children": [[A]], "peers": [
            {"peer_id": A, "name": "n0", "url": None, "relay": True, "group": 0, "complete": [2, 3],
             "progress": {}, "last_heartbeat_age": 0.4, "strikes": 0, "parents": [None], "children": [[B]]},
            {"peer_id": B, "name": "n1", "url": None, "relay": True, "group": None, "complete": [2],
             "progress": {"3": 5}, "last_heartbeat_age": 0.9, "strikes": 0, "parents": [A], "children": [[]]}],
        "banned": [], "events": []}


def scripted_stats() -> RunStats:
    reg = NodeRegistry(heartbeat_s=2.0)
    s = RunStats("runs/x", max_steps=50, registry=reg)
    a, b = reg.register(A, "n0"), reg.register(B, "n1")
    s.sample(now=1000.0)
    for lag in (0, 0, 1):
        s.accepted(a, 40, lag)
    s.accepted(b, 20, 2)
    s.refuse(b, "bad_logprob")
    s.refuse(b, "bad_logprob")
    s.refuse(None, "unassigned")  # a node the trainer never registered
    s.drop("stale")
    s.sample(now=1010.0)
    reg.banned.add(B)
    s.step, s.version = 3, 3
    s.steps.append(StepRow(1, 1, 5.0, 0.5, 0.4, 4, 0, 0.25, 0.1, 0.0, 1.0))
    s.evals.append(EvalRow(0, 0.0, 0.3, 0.3))
    return s


def metrics(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[smp.name, tuple(sorted(smp.labels.items()))] = smp.value
    return out


async def _with_client(fn, stats: RunStats, **kw):
    view = WebView(stats, **kw)
    async with TestClient(TestServer(view.make_app())) as client:
        return await fn(client, view)


def test_view_json_has_the_known_counts_and_rates():
    async def go(client, _view):
        v = await (await client.get("/api/view")).json()
        ov = v["overview"]
        assert (ov["accepted_groups"], ov["tokens_generated"], ov["step"], ov["version"]) == (4, 140, 3, 3)
        assert ov["refused"] == {"bad_logprob": 2, "unassigned": 1}
        assert ov["dropped"] == {"stale": 1}
        assert ov["lag_counts"] == {"0": 2, "1": 1, "2": 1}
        # 140 tokens and 4 groups between the samples at t=1000 and t=1010.
        assert (ov["tokens_per_s"], ov["rollouts_per_s"]) == (14.0, 0.4)
        nodes = {n["name"]: n for n in ov["nodes"]}
        assert nodes["n0"]["state"] == "healthy" and nodes["n1"]["state"] == "banned"
        assert (nodes["n0"]["tokens_per_s"], nodes["n0"]["rollouts_per_s"], nodes["n0"]["share"]) == (12.0, 0.3, 0.75)
        assert (nodes["n1"]["tokens_per_s"], nodes["n1"]["rollouts_per_s"], nodes["n1"]["share"]) == (2.0, 0.1, 0.25)
        assert nodes["n1"]["refused"] == {"bad_logprob": 2} and nodes["n0"]["accepted_groups"] == 3
        assert ov["tree"] is None
        tp = v["throughput"]
        assert tp["t"] == [1000.0, 1010.0] and tp["tokens_per_s"] == [0.0, 14.0] and tp["rollouts_per_s"] == [0.0, 0.4]
        assert tp["nodes"][A] == {"name": "n0", "tokens_per_s": [0.0, 12.0], "rollouts_per_s": [0.0, 0.3]}
        assert [r["step"] for r in v["steps"]] == [1] and [e["accuracy"] for e in v["evals"]] == [0.3]
        assert await (await client.get("/api/throughput")).json() == tp
        assert [n["name"] for n in await (await client.get("/api/nodes")).json()] == ["n0", "n1"]
        assert await (await client.get("/api/tree")).json() is None
        # The API also carries the trainer's own summary.
        summ = await (await client.get("/api/summary")).json()
        assert summ["accepted_groups"] == 4 and summ["banned"] == [B]

    asyncio.run(_with_client(go, scripted_stats()))


def test_rates_window_and_late_joining_node():
    reg = NodeRegistry(heartbeat_s=2.0)
    s = RunStats("runs/x", 10, reg)
    a = reg.register(A, "n0")
    for t in range(0, 21):  # n0: 10 tokens and 1 group every second
        if t:
            s.accepted(a, 10, 0)
        if t == 15:
            reg.register(B, "n1")
        s.sample(now=100.0 + t)
    v = WebView(s, window_s=5.0).throughput()
    assert v.tokens_per_s[0] == 0.0 and v.tokens_per_s[1] == 10.0 and v.tokens_per_s[-1] == 10.0
    assert v.nodes[B].tokens_per_s[:15] == [None] * 15 and v.nodes[B].tokens_per_s[15:] == [0.0] * 6


def test_tree_endpoint_uses_the_provider():
    stats = scripted_stats()
    stats.tree_provider = lambda: TREE

    async def go(client, _view):
        assert await (await client.get("/api/tree")).json() == TREE
        assert (await (await client.get("/api/view")).json())["overview"]["tree"] == TREE

    asyncio.run(_with_client(go, stats))


def test_prometheus_metrics_have_the_known_counts():
    async def go(client, _view):
        r = await client.get("/metrics")
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        m = metrics(await r.text())
        assert m["swarm_groups_accepted_total", (("node", "n0"),)] == 3
        assert m["swarm_groups_accepted_total", (("node", "n1"),)] == 1
        assert m["swarm_tokens_generated_total", (("node", "n0"),)] == 120
        assert m["swarm_groups_refused_total", (("node", "n1"), ("reason", "bad_logprob"))] == 2
        assert m["swarm_groups_refused_total", (("node", "unknown"), ("reason", "unassigned"))] == 1
        assert m["swarm_groups_dropped_total", (("reason", "stale"),)] == 1
        assert m["swarm_rollout_lag_count", ()] == 4 and m["swarm_rollout_lag_sum", ()] == 3
        assert m["swarm_rollout_lag_bucket", (("le", "0.0"),)] == 2
        assert m["swarm_nodes", (("state", "healthy"),)] == 1 and m["swarm_nodes", (("state", "banned"),)] == 1
        assert m["swarm_node_tokens_per_second", (("node", "n0"),)] == 12.0
        assert m["swarm_node_tokens_per_second", (("node", "n1"),)] == 2.0

    asyncio.run(_with_client(go, scripted_stats()))


async def _next_event(resp) -> tuple[str, dict]:
    event, data = "", b""
    while True:
        line = await asyncio.wait_for(resp.content.readline(), 5)
        if line == b"\n" and data:
            return event, json.loads(data)
        if line.startswith(b"event: "):
            event = line[7:].strip().decode()
        elif line.startswith(b"data: "):
            data += line[6:]


def test_event_stream_sends_a_snapshot_then_increments():
    stats = scripted_stats()

    async def go(client, view: WebView):
        resp = await client.get("/events")
        assert resp.headers["Content-Type"] == "text/event-stream"
        kind, snap = await _next_event(resp)
        assert kind == "snapshot" and snap["throughput"]["t"] == [1000.0, 1010.0] and len(snap["steps"]) == 1
        stats.steps.append(StepRow(2, 2, 9.0, 0.6, 0.5, 4, 1, 0.5, 0.1, 0.0, 1.0))
        stats.accepted(stats.registry.get(A), 30, 0)
        stats.sample(now=1011.0)
        await asyncio.sleep(0.1)  # let the stream reach its wait
        await view.notify()
        kind, tick = await _next_event(resp)
        assert kind == "tick"
        assert [r["step"] for r in tick["steps"]] == [2] and tick["evals"] == []  # only what is new
        # The 10 s window at t=1011 reaches back to the sample at t=1010: 30 tokens in 1 s.
        assert tick["point"]["t"] == 1011.0 and tick["point"]["tokens_per_s"] == 30.0
        assert tick["overview"]["accepted_groups"] == 5
        await view.notify()  # no new sample: the next tick carries no point and no steps
        kind, tick = await _next_event(resp)
        assert tick["point"] is None and tick["steps"] == []
        resp.close()

    asyncio.run(_with_client(go, stats))


def test_page_and_vendored_chart_library_are_served():
    async def go(client, _view):
        page = await (await client.get("/")).text()
        assert "uPlot.iife.min.js" in page and 'id="throughput"' in page
        for path in ("/static/app.js", "/static/style.css", "/static/vendor/uplot/uPlot.iife.min.js",
                     "/static/vendor/uplot/uPlot.min.css", "/static/vendor/uplot/LICENSE"):
            r = await client.get(path)
            assert r.status == 200, path
        assert "MIT" in await (await client.get("/static/vendor/uplot/LICENSE")).text()

    asyncio.run(_with_client(go, scripted_stats()))


def test_swarm_status_prints_the_same_figures(capsys):
    stats = scripted_stats()
    stats.tree_provider = lambda: TREE

    async def go(client, _view):
        base = str(client.make_url("/"))
        return await asyncio.to_thread(status.run, base.removeprefix("http://"))

    assert asyncio.run(_with_client(go, stats)) == 0
    out = capsys.readouterr().out
    assert "step 3/50, policy v3" in out
    assert "14 tokens/s, 0.40 rollouts/s" in out
    assert "refused: bad_logprob 2, unassigned 1" in out
    assert "lag 0 2, lag 1 1, lag 2 1" in out
    n0 = next(line for line in out.splitlines() if line.startswith("n0 "))
    assert "healthy" in n0 and "v-1" not in n0 and "75.0%" in n0
    assert "banned" in next(line for line in out.splitlines() if line.startswith("n1 "))
    assert "relay tree: 2 peers, 1 trees, fanout 4, latest v3; 1 peers hold it" in out


def test_swarm_status_fails_cleanly_without_a_trainer(capsys):
    from tests.conftest import free_port

    assert status.run(f"127.0.0.1:{free_port()}") == 1
    assert "cannot read" in capsys.readouterr().out


def test_the_views_do_not_grow_with_throwaway_keys():
    """Keys that registered and delivered nothing: silent ones are a count, live ones beyond the newest
    MAX_UNPROVEN a count too; those that delivered, and banned keys, are always rows."""
    import time as _time

    from trainer.stats import MAX_UNPROVEN

    s = scripted_stats()  # n0 delivered; n1 delivered and is banned
    reg = s.registry
    for i in range(MAX_UNPROVEN + 30):
        reg.register(f"{i:064x}", f"x{i}")
    for i in range(20):  # the first 20 went quiet long ago
        reg.nodes[f"{i:064x}"].last_seen = _time.monotonic() - reg.gone_after_s - 1
    ov = s.overview()
    names = {n.name for n in ov.nodes}
    assert {"n0", "n1"} <= names and ov.silent_keys == 20
    assert len(names) == 2 + MAX_UNPROVEN and ov.unlisted_keys == 10
    assert f"x{MAX_UNPROVEN + 29}" in names and "x25" not in names  # the newest are the ones listed
