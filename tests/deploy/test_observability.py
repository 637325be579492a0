"""Alert rules, their unit tests, the Grafana dashboard and the proxy's /metrics.

Everything an operator's monitoring relies on is checked against what the
proxy really exports (proxy/telemetry/metrics.py): a renamed metric must break a test
here, not silently empty a panel or disarm an alert. promtool (Debian package
`prometheus`) checks the rules, runs their unit tests, parses the dashboard's
queries and lints the live exposition.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from proxy.app import create_app
from proxy.telemetry.metrics import Metrics
from tests.integration.conftest import chunk, free_port, make_policy

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "docker" / "prometheus" / "alerts.yml"
ALERTS_TEST = ROOT / "docker" / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "brownout.json"
RUNBOOK = ROOT / "docs" / "runbook.md"
README = ROOT / "README.md"

# Series Prometheus makes itself rather than scraping them from the proxy.
PROMETHEUS_SERIES = {"up"}
SEVERITIES = {"critical", "warning", "info"}
DATASOURCE_UIDS = {"${DS_PROMETHEUS}", "prometheus"}


# -- helpers -------------------------------------------------------------------


def exported_names(exposition: str) -> set[str]:
    """Every series name an exposition can carry, children or not."""
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            elif kind == "summary":
                names |= {name, f"{name}_sum", f"{name}_count"}
            else:  # counters already carry _total in the text format
                names.add(name)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


@pytest.fixture(scope="module")
def proxy_metric_names() -> set[str]:
    names = exported_names(Metrics().exposition().decode())
    # The naming rules this module relies on.
    assert {"brownout_requests_total", "brownout_ttft_seconds_bucket", "brownout_tier"} <= names
    return names


_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS |= {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, labels, keywords aside)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # range selectors
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names: set[str] = set()
    for m in re.finditer(r"(?<![\w:.$])[A-Za-z_:][\w:]*", e):
        if e[m.end() :].lstrip().startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue  # a function or aggregation, or a keyword
        names.add(m.group(0))
    return names


def test_metric_name_extraction() -> None:
    expr = (
        'sum by (job) (rate(foo_total{a="b", c=~"$x"}[5m] offset 5m)) / on (job) bar > 1.8'
        " and histogram_quantile(0.95, sum by (le) (rate(baz_bucket[$__rate_interval])))"
    )
    assert metric_names(expr) == {"foo_total", "bar", "baz_bucket"}


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not installed: `apt-get install prometheus` (Debian's package "
            "ships /usr/bin/promtool; .ci/run installs it)"
        )
    return path


def run_promtool(promtool: str, *args: str, stdin: str | None = None) -> str:
    proc = subprocess.run(
        [promtool, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


def load_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path}: not a mapping"
    return data


def alert_rules() -> list[dict[str, Any]]:
    groups = load_yaml(ALERTS)["groups"]
    rules = [r for g in groups for r in g["rules"]]
    alerts = [r for r in rules if "alert" in r]
    assert alerts, f"{ALERTS}: no alerting rules"
    return alerts


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' collapsed children included."""
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])


def dashboard_exprs(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dash) for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    return exprs


# -- alert rules -----------------------------------------------------------------


@pytest.mark.real
def test_alert_rules_pass_promtool_check(promtool: str) -> None:
    out = run_promtool(promtool, "check", "rules", str(ALERTS))
    assert "SUCCESS" in out, out


@pytest.mark.real
def test_alert_rule_unit_tests_pass(promtool: str) -> None:
    out = run_promtool(promtool, "test", "rules", str(ALERTS_TEST))
    assert "SUCCESS" in out, out


def test_every_alert_is_unit_tested_firing() -> None:
    """Each alert fires in alerts_test.yml at least once; the TTFT one also stays quiet."""
    cases = [c for t in load_yaml(ALERTS_TEST)["tests"] for c in t["alert_rule_test"]]
    fired = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert {r["alert"] for r in alert_rules()} <= fired
    baselines = {
        "BrownoutTTFTAboveBaseline",
        "BrownoutInterTokenLatencyAboveBaseline",
        "BrownoutTokenRatioCollapsed",
        "BrownoutKVCacheNearlyFull",
        "BrownoutEngineQueueWaitHigh",
    }
    assert baselines <= quiet
    assert load_yaml(ALERTS_TEST)["rule_files"] == ["alerts.yml"]


def test_alert_rules_are_complete() -> None:
    for rule in alert_rules():
        name = rule["alert"]
        assert re.fullmatch(r"Brownout[A-Z]\w+", name), name
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), f"{name}: no `for:`"
        assert rule["labels"]["severity"] in SEVERITIES, name
        annotations = rule["annotations"]
        for key in ("summary", "description", "runbook", "runbook_url"):
            assert annotations.get(key, "").strip(), f"{name}: no {key} annotation"


def runbook_anchors() -> set[str]:
    """GitHub's anchors of docs/runbook.md's headings (lower case, spaces to
    dashes, punctuation dropped)."""
    anchors = set()
    for line in RUNBOOK.read_text().splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def test_every_alert_links_its_own_runbook_section() -> None:
    anchors = runbook_anchors()
    text = RUNBOOK.read_text()
    for rule in alert_rules():
        name = rule["alert"]
        url = rule["annotations"]["runbook_url"]
        assert url == f"docs/runbook.md#{name.lower()}", (name, url)
        assert name.lower() in anchors, f"docs/runbook.md has no section {name}"
        # The section says what to do, not only the alert's name.
        section = text.split(f"\n### {name}\n", 1)[1].split("\n#", 1)[0]
        assert len(section.split()) >= 40, f"{name}: runbook section too thin"
    assert "docs/runbook.md" in README.read_text()


def test_alert_rules_use_exported_metrics(proxy_metric_names: set[str]) -> None:
    for rule in alert_rules():
        used = metric_names(rule["expr"])
        assert used, f"{rule['alert']}: no metric in {rule['expr']!r}"
        unknown = used - proxy_metric_names - PROMETHEUS_SERIES
        assert not unknown, f"{rule['alert']} uses metrics the proxy does not export: {unknown}"


def test_ttft_alert_compares_with_a_rolling_baseline() -> None:
    (rule,) = [r for r in alert_rules() if r["alert"] == "BrownoutTTFTAboveBaseline"]
    expr = " ".join(rule["expr"].split())
    assert "histogram_quantile(0.95" in expr
    assert "[5m]" in expr and "[1h] offset 5m" in expr
    assert "1.8 *" in expr
    assert "brownout_ttft_seconds_count" in expr  # the minimum request rate


def test_inter_token_alert_compares_with_a_rolling_baseline() -> None:
    (rule,) = [r for r in alert_rules() if r["alert"] == "BrownoutInterTokenLatencyAboveBaseline"]
    expr = " ".join(rule["expr"].split())
    assert "histogram_quantile(0.95" in expr and "brownout_inter_token_seconds_bucket" in expr
    assert "[5m]" in expr and "[1h] offset 5m" in expr
    assert "1.8 *" in expr
    assert "rate(brownout_inter_token_seconds_count[5m])) >= 1" in expr


def test_token_ratio_alert_compares_with_its_own_baseline() -> None:
    """Per backend and model, the last 15 minutes against half of the 6 hours
    before them (alerts_test.yml: 0.8 falling to 0.3, at once or over an hour)."""
    (rule,) = [r for r in alert_rules() if r["alert"] == "BrownoutTokenRatioCollapsed"]
    expr = " ".join(rule["expr"].split())
    assert "< 0.5 * (" in expr
    for name in ("brownout_completion_tokens_total", "brownout_prompt_tokens_total"):
        assert f"sum by (job, backend, model) (rate({name}[15m]))" in expr
        assert f"sum by (job, backend, model) (rate({name}[6h] offset 15m))" in expr


def test_engine_alerts_read_what_brownout_scrapes_of_vllm() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    kv = rules["BrownoutKVCacheNearlyFull"]
    assert kv["expr"].strip() == "brownout_upstream_kv_cache_usage_perc > 0.85"
    assert kv["for"] == "2m"
    wait = " ".join(rules["BrownoutEngineQueueWaitHigh"]["expr"].split())
    assert wait == (
        "rate(brownout_upstream_request_queue_time_seconds_sum[5m]) / "
        "rate(brownout_upstream_request_queue_time_seconds_count[5m]) > 1.5"
    )


def test_rollback_alert_also_fires_on_a_gate_s_first_rollback() -> None:
    """The counter's child for a gate is born with its first rollback (value 1),
    which `increase` alone never sees; alerts_test.yml runs both cases."""
    (rule,) = [r for r in alert_rules() if r["alert"] == "BrownoutRolloutRolledBack"]
    expr = " ".join(rule["expr"].split())
    assert "increase(brownout_rollout_rollbacks_total[5m]) > 0" in expr
    assert (
        "(brownout_rollout_rollbacks_total unless brownout_rollout_rollbacks_total offset 5m)"
        in expr
    )


# -- dashboard -------------------------------------------------------------------


def test_dashboard_is_a_valid_grafana_dashboard() -> None:
    dash = dashboard()
    assert dash["uid"] == "brownout" and dash["title"]
    assert 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids: list[int] = []
    for p in panels(dash):
        ids.append(p["id"])
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["type"] == "prometheus", p["title"]
        assert p["datasource"]["uid"] in DATASOURCE_UIDS, p["title"]
        targets = p.get("targets")
        assert targets, f"panel {p['title']!r} has no targets"
        ref_ids = [t["refId"] for t in targets]
        assert len(set(ref_ids)) == len(ref_ids), p["title"]
        for t in targets:
            assert t["expr"].strip(), p["title"]
            assert t.get("datasource", p["datasource"])["uid"] in DATASOURCE_UIDS, p["title"]
    assert len(set(ids)) == len(ids), "duplicate panel ids"


def test_dashboard_uses_exported_metrics(proxy_metric_names: set[str]) -> None:
    dash = dashboard()
    for expr in dashboard_exprs(dash):
        used = metric_names(expr)
        assert used, f"no metric in {expr!r}"
        unknown = used - proxy_metric_names
        assert not unknown, f"dashboard query uses metrics the proxy does not export: {unknown}"
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+)[{,].*", var["query"]["query"])
            assert m and m.group(1) in proxy_metric_names, var["name"]


def test_dashboard_shows_what_operators_need() -> None:
    used = set().union(*(metric_names(e) for e in dashboard_exprs(dashboard())))
    needed = {
        "brownout_tier",
        "brownout_tier_transitions_total",
        "brownout_ttft_seconds_bucket",
        "brownout_requests_total",
        "brownout_shed_total",
        "brownout_guard_trips_total",
        "brownout_queue_depth",
        "brownout_admission_limit",
        "brownout_admission_inflight",
        "brownout_inflight_requests",
        "brownout_breaker_state",
        "brownout_backend_up",
        "brownout_upstream_num_requests_waiting",
        "brownout_upstream_num_requests_running",
        "brownout_upstream_kv_cache_usage_perc",
        "brownout_stream_rescues_total",
        "brownout_session_store_up",
        # The gray release row (issue 21).
        "brownout_rollout_state",
        "brownout_rollout_share",
        "brownout_rollout_gate_value",
        "brownout_rollout_rollbacks_total",
        # The tokens row (issue 23).
        "brownout_prompt_tokens_total",
        "brownout_completion_tokens_total",
        "brownout_inter_token_seconds_bucket",
        "brownout_time_per_output_token_seconds_bucket",
        "brownout_upstream_request_queue_time_seconds_sum",
        "brownout_upstream_request_queue_time_seconds_count",
    }
    assert not needed - used, f"dashboard lacks {needed - used}"


def test_dashboard_has_a_gray_release_row() -> None:
    """One row: state, share, rollbacks by gate, the gate values per arm."""
    dash = dashboard()
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    (row,) = [r for r in rows if r["title"].startswith("Gray release")]
    top = row["gridPos"]["y"]
    end = min([r["gridPos"]["y"] for r in rows if r["gridPos"]["y"] > top], default=10**6)
    below = [p for p in dash["panels"] if p["type"] != "row" and top < p["gridPos"]["y"] < end]
    exprs = " ".join(t["expr"] for p in below for t in p["targets"])
    for name in (
        "brownout_rollout_state",
        "brownout_rollout_share",
        "brownout_rollout_rollbacks_total",
    ):
        assert name in exprs, name
    arms = [
        t["expr"] for p in below for t in p["targets"] if "brownout_rollout_gate_value" in t["expr"]
    ]
    assert any('arm=~"primary|candidate"' in e and "by (gate, arm)" in e for e in arms), arms
    assert any('arm="ratio"' in e for e in arms), arms
    (state,) = [p for p in below if "brownout_rollout_state" in p["targets"][0]["expr"]]
    names = {v["text"] for v in state["fieldConfig"]["defaults"]["mappings"][0]["options"].values()}
    assert names == {"idle", "mirror", "step", "paused", "complete", "rolled back", "aborted"}


def test_dashboard_has_a_tokens_row() -> None:
    """Tokens/s, the ratio against the alert's threshold, ITL with its alert
    threshold, TPOT: one row."""
    dash = dashboard()
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    (row,) = [r for r in rows if r["title"].startswith("Tokens")]
    top = row["gridPos"]["y"]
    end = min([r["gridPos"]["y"] for r in rows if r["gridPos"]["y"] > top], default=10**6)
    below = [p for p in dash["panels"] if p["type"] != "row" and top < p["gridPos"]["y"] < end]
    exprs = [" ".join(t["expr"].split()) for p in below for t in p["targets"]]
    assert any(
        "rate(brownout_completion_tokens_total" in e and "[$__rate_interval]" in e for e in exprs
    )
    assert any(e.startswith("1.8 * histogram_quantile(0.95") and "inter_token" in e for e in exprs)
    assert any("[6h] offset 15m" in e and e.startswith("0.5 *") for e in exprs)
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in below}
    assert units["Inter-token latency (ITL) by backend"] == "s"
    assert units["Time per output token (TPOT) by backend"] == "s"


@pytest.mark.real
def test_dashboard_queries_parse(promtool: str, tmp_path: Path) -> None:
    """promtool parses every query once Grafana's variables are filled in."""
    rules = []
    for i, expr in enumerate(dashboard_exprs(dashboard())):
        concrete = expr.replace("$__rate_interval", "5m")
        concrete = re.sub(r"\$\{?\w+\}?", ".*", concrete)
        rules.append({"record": f"dashboard:query_{i}", "expr": concrete})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = run_promtool(promtool, "check", "rules", str(path))
    assert f"SUCCESS: {len(rules)} rules found" in out, out


# -- the live exposition -------------------------------------------------------


async def scrape_live_proxy() -> tuple[str, str]:
    """/metrics of a real proxy that has served a stream, an answer and a bad request."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        if not body.get("stream"):
            return web.json_response({"object": "chat.completion", "choices": [], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("hello"))
        await asyncio.sleep(0.01)
        await resp.write(chunk(" there") + chunk("", "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            obj = {"object": "chat.completion.chunk", "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(request: web.Request) -> web.StreamResponse:
        return web.Response()

    async def vllm_metrics(request: web.Request) -> web.StreamResponse:
        return web.Response(
            text='vllm:num_requests_running{model_name="tiny"} 2\n'
            'vllm:num_requests_waiting{model_name="tiny"} 1\n'
            'vllm:kv_cache_usage_perc{model_name="tiny"} 0.25\n'
            'vllm:request_queue_time_seconds_sum{model_name="tiny"} 1.5\n'
            'vllm:request_queue_time_seconds_count{model_name="tiny"} 3\n'
        )

    upstream = web.Application()
    upstream.router.add_post("/v1/chat/completions", chat)
    upstream.router.add_get("/health", health)
    upstream.router.add_get("/metrics", vllm_metrics)
    upstream_port, proxy_port = free_port(), free_port()
    runners: list[web.AppRunner] = []
    try:
        for app, port in (
            (upstream, upstream_port),
            (create_app(make_policy(f"http://127.0.0.1:{upstream_port}")), proxy_port),
        ):
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{proxy_port}"
        messages = [{"role": "user", "content": "hi"}]
        async with aiohttp.ClientSession() as s:
            for stream in (True, False):
                body = {"model": "tiny", "messages": messages, "stream": stream}
                async with s.post(url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
            async with s.post(url + "/v1/chat/completions", data=b"{not json") as resp:
                assert resp.status == 400
            async with s.get(url + "/metrics") as resp:
                assert resp.status == 200
                return resp.headers["Content-Type"], await resp.text()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


@pytest.mark.real
async def test_live_metrics_pass_promtool_lint(promtool: str) -> None:
    content_type, text = await scrape_live_proxy()
    assert content_type.startswith("text/plain; version=0.0.4")
    # The exposition linted below is a populated one.
    assert re.search(r'^brownout_requests_total\{[^}]*status="200"', text, re.M), text
    assert re.search(r"^brownout_ttft_seconds_bucket\{", text, re.M), text
    for series in (
        'brownout_prompt_tokens_total{backend="primary",model="tiny",tier="normal"} 10.0',
        'brownout_completion_tokens_total{backend="primary",model="tiny",tier="normal"} 4.0',
        'brownout_inter_token_seconds_count{backend="primary"} 2.0',
        'brownout_time_per_output_token_seconds_count{backend="primary"} 1.0',
        "process_resident_memory_bytes ",
    ):
        assert series in text, series
    assert re.search(
        r'^brownout_build_info\{policy_hash="\w{12}",python="[\d.]+",version=', text, re.M
    )
    out = run_promtool(promtool, "check", "metrics", stdin=text)
    assert not out.strip(), f"promtool check metrics found problems:\n{out}"


@pytest.mark.real
def test_promtool_lint_catches_bad_names(promtool: str) -> None:
    """The lint above is not vacuous: a counter without `_total` is reported."""
    bad = "# HELP things Things.\n# TYPE things counter\nthings 1\n"
    proc = subprocess.run(
        [promtool, "check", "metrics"],
        input=bad,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "_total" in proc.stdout + proc.stderr
