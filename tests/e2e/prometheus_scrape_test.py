#!/usr/bin/env python3
"""A real Prometheus scrapes the built attnd through deploy/prometheus.yml (retargeted to a
loopback port): up == 1, `attnctl demo` makes attnd_kernel_duration_seconds_count grow in
Prometheus, and every PromQL expression of the Grafana dashboard and of the README is accepted
by Prometheus and names metrics attnd exports."""
import json
import os
import re

import e2e_lib
from e2e_lib import REPO, Attnd, Failure, Prometheus, check, passed, wait_until

def kernel_count_in_prometheus(prometheus):
    return prometheus.scalar('sum(attnd_kernel_duration_seconds_count{job="attnd"})')


def dashboard_queries():
    with open(os.path.join(REPO, "deploy", "grafana", "dashboards", "attnd.json")) as f:
        dashboard = json.load(f)
    queries = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                queries.append((panel["title"], target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        match = re.fullmatch(r"label_values\((.+),\s*\w+\)", query or "")
        if match:
            queries.append((f"variable {variable['name']}", match.group(1)))
    return queries


def grafana_to_promql(expr):
    """Grafana's variables replaced by what they mean with 'All' selected."""
    return (expr.replace("$__rate_interval", "1m").replace('"$instance"', '".*"')
            .replace('"$kernel"', '".*"'))


def readme_queries():
    """Lines of the README's ```promql blocks (one query per line; # lines are comments)."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    queries = []
    for block in re.findall(r"```promql\n(.*?)```", text, re.S):
        queries += [(f"README", line.strip()) for line in block.splitlines()
                    if line.strip() and not line.strip().startswith("#")]
    return queries


def test(work_dir):
    args = e2e_lib.parse_args()
    prometheus = Prometheus(work_dir)
    attnd = Attnd(args.attnd, args.attnctl, work_dir,
                  ["--backend=cpu", "--kv_memory_bytes=268435456"]).start()
    prometheus.start(attnd.metrics_port)

    up = wait_until(lambda: prometheus.scalar('up{job="attnd"}'), 60,
                    "Prometheus' first scrape of attnd")
    check(up == 1, f'up{{job="attnd"}} is {up}, expected 1')
    passed('Prometheus scrapes attnd: up{job="attnd"} == 1')

    build_info = prometheus.query('attnd_build_info{job="attnd"}')
    check(len(build_info) == 1 and build_info[0]["metric"].get("backend") == "cpu",
          f"attnd_build_info in Prometheus: {build_info}, expected one series with backend=cpu")
    passed(f"attnd_build_info reached Prometheus: {build_info[0]['metric']}")

    before = kernel_count_in_prometheus(prometheus)
    check(before is not None, "attnd_kernel_duration_seconds_count has no series in Prometheus")
    direct_before = sum(v for (name, _), v in attnd.metrics().items()
                        if name == "attnd_kernel_duration_seconds_count")
    demo = attnd.attnctl_run("demo", "--keep_cache", timeout_seconds=300)
    print(demo.stdout, flush=True)
    direct_after = sum(v for (name, _), v in attnd.metrics().items()
                       if name == "attnd_kernel_duration_seconds_count")
    check(direct_after > direct_before,
          f"attnd's /metrics kernel count did not grow over the demo: {direct_before} -> "
          f"{direct_after}")
    after = wait_until(lambda: (lambda v: v if v is not None and v > before else None)(
        kernel_count_in_prometheus(prometheus)), 30,
        f"Prometheus' kernel count to grow past {before}")
    passed(f"after attnctl demo, sum(attnd_kernel_duration_seconds_count) in Prometheus grew "
           f"{before:g} -> {after:g} (attnd's own /metrics: {direct_before:g} -> {direct_after:g})")

    per_kernel = {r["metric"]["kernel"]: float(r["value"][1]) for r in prometheus.query(
        'sum by (kernel) (attnd_kernel_duration_seconds_count{job="attnd"}) > 0')}
    check(per_kernel, "no kernel has a non-zero count in Prometheus after the demo")
    passed(f"kernels that ran, as Prometheus sees them: {per_kernel}")

    requests = wait_until(lambda: prometheus.query(
        'sum by (method) (attnd_rpc_requests_total{job="attnd", code="ok", method="Forward"})'
        ' or sum by (method) (attnd_rpc_requests_total{job="attnd", code="ok", '
        'method="ForwardStream"})'), 15, "ok Forward RPCs in Prometheus")
    passed(f"attnd_rpc_requests_total counts the demo's forwards: "
           f"{[(r['metric']['method'], r['value'][1]) for r in requests]}")

    # The demo frees its sequences at the end but keeps its cache (--keep_cache): its series
    # must be there, with every page free again.
    usage = wait_until(lambda: prometheus.query('attnd_kv_cache_usage_ratio{job="attnd"}'), 15,
                       "the demo's kept cache in attnd_kv_cache_usage_ratio")
    check(len(usage) == 1 and float(usage[0]["value"][1]) == 0.0,
          f"attnd_kv_cache_usage_ratio after the demo freed its sequences: {usage}")
    cache = usage[0]["metric"]["cache"]
    pages = {r["metric"]["state"]: float(r["value"][1]) for r in prometheus.query(
        f'attnd_kv_pages{{job="attnd", cache="{cache}"}}')}
    check(pages.get("used") == 0 and pages.get("free", 0) > 0,
          f"attnd_kv_pages of {cache}: {pages}, expected 0 used and some free")
    passed(f"KV metrics of cache {cache}: usage ratio 0, pages {pages}")

    missing = attnd.attnctl_run("cache", "get", "e2e-no-such-cache", check_exit=False)
    check(missing.returncode != 0, "attnctl cache get of a missing cache exited 0")
    errors = wait_until(lambda: prometheus.scalar(
        'sum(attnd_errors_total{job="attnd", error_type="not_found"})'), 15,
        "attnd_errors_total{error_type=\"not_found\"} in Prometheus")
    check(errors >= 1, f"attnd_errors_total{{error_type=not_found}} is {errors}, expected >= 1")
    passed(f"a GetCache of a missing cache shows as attnd_errors_total{{error_type=\"not_found\"}}"
           f" = {errors:g}")

    # Every metric a query names must be one attnd exports, and Prometheus must accept it.
    exported = attnd.exported_names()
    queries = dashboard_queries() + readme_queries()
    check(any(origin == "README" for origin, _ in queries), "README.md has no ```promql block")
    for origin, expr in queries:
        promql = grafana_to_promql(expr)
        for metric in set(re.findall(r"\battnd_[a-z0-9_]+", promql)):
            check(metric in exported, f"{origin}: {expr!r} names {metric}, which attnd does not "
                                      f"export (it exports {sorted(exported)})")
        try:
            prometheus.query(promql)
        except Failure as error:
            raise Failure(f"{origin}: {error}")
    passed(f"{len(queries)} PromQL expressions (Grafana dashboard, README) are valid and name "
           "exported metrics")

    check(attnd.stop() == 0, "attnd did not exit 0 on SIGTERM")
    passed("attnd exits 0 on SIGTERM")


if __name__ == "__main__":
    e2e_lib.main(test)
