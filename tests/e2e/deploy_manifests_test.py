#!/usr/bin/env python3
"""What can be checked of deploy/ without a Docker engine or a cluster:
- compose.yaml is valid for `docker-compose config` (Debian's docker-compose, offline) and
  wires attnd, Prometheus and Grafana together consistently;
- deploy/prometheus.yml passes `promtool check config`;
- the Grafana provisioning and dashboard are well-formed and chart the attnd metrics;
- the k8s manifests parse, request a GPU, probe with Kubernetes' gRPC probe and agree with
  each other (selectors, named ports, ServiceMonitor);
- every attnd flag the Dockerfile, compose and k8s pass exists;
- attnd started with the k8s args answers the liveness and readiness probes' health checks.
"""
import json
import os
import re
import shutil

import e2e_lib
from deploy_lib import (DEPLOY, attnd_flag_names, check_flags, dockerfile_instructions,
                        exec_form, flag_value, healthcheck_command, load_yaml_documents, port_of)
from e2e_lib import REPO, Attnd, check, passed, run, skip_or_fail

SERVICE = "attnd.v1.AttentionService"


def check_dockerfile(known_flags):
    instructions = dockerfile_instructions()
    stages = [a for _, k, a in instructions if k == "FROM"]
    check(len(stages) == 2, f"expected a two-stage Dockerfile, FROM lines: {stages}")
    check(re.search(r"nvidia/cuda:\S*devel\S* AS build$", stages[0]),
          f"first stage is not a CUDA devel image named build: {stages[0]}")
    check(re.search(r"nvidia/cuda:\S*runtime", stages[1]),
          f"last stage is not a CUDA runtime image: {stages[1]}")
    build_runs = " ".join(a for s, k, a in instructions if s == 0 and k == "RUN")
    for script in ("scripts/install-deps.sh", "scripts/build.sh", "deploy/stage-runtime.sh"):
        check(script in build_runs, f"the build stage does not run {script}")
        check(os.access(os.path.join(REPO, script), os.X_OK), f"{script} is not executable")
    final = [(k, a) for s, k, a in instructions if s == 1]
    check(any(k == "COPY" and "--from=build" in a for k, a in final),
          "the runtime stage copies nothing from the build stage")
    users = [a for k, a in final if k == "USER"]
    check(users and users[-1].split(":")[0] not in ("0", "root"),
          f"the runtime stage does not switch to a non-root user: USER {users}")
    exposed = {int(p.split("/")[0]) for k, a in final if k == "EXPOSE" for p in a.split()}
    check(exposed == {50051, 9400}, f"EXPOSE {sorted(exposed)}, expected 50051 and 9400")
    command, options = healthcheck_command(instructions)
    check(command[:2] == ["attnctl", "health"], f"HEALTHCHECK does not run attnctl health: "
                                                f"{command}")
    entrypoint = exec_form(next(a for k, a in final if k == "ENTRYPOINT"), "ENTRYPOINT")
    cmd = exec_form(next(a for k, a in final if k == "CMD"), "CMD")
    check(entrypoint == ["attnd"], f"ENTRYPOINT {entrypoint}, expected [\"attnd\"]")
    check_flags(cmd, known_flags, "Dockerfile CMD")
    check({port_of(flag_value(cmd, "listen_address")), port_of(flag_value(cmd, "metrics_address"))}
          == exposed, f"CMD listens on {cmd}, EXPOSE says {sorted(exposed)}")
    with open(os.path.join(DEPLOY, "Dockerfile.dockerignore")) as f:
        ignored = f.read().split()
    check("build" in ignored and ".git" in ignored,
          "deploy/Dockerfile.dockerignore does not keep build/ and .git out of the context")
    passed(f"Dockerfile: {stages[0].split()[0]} -> {stages[1].split()[0]}, USER {users[-1]}, "
           f"EXPOSE {sorted(exposed)}, HEALTHCHECK {' '.join(command)}, CMD flags known")
    return command


def check_compose(known_flags):
    compose = os.path.join(DEPLOY, "compose.yaml")
    docker_compose = shutil.which("docker-compose")
    if docker_compose is None:
        skip_or_fail("docker-compose is not installed (Debian package docker-compose)")
    result = run([docker_compose, "-f", compose, "config", "-q"], check_exit=False)
    check(result.returncode == 0, f"docker-compose config rejects deploy/compose.yaml:\n"
                                  f"{result.stdout}{result.stderr}")
    passed("deploy/compose.yaml: `docker-compose config -q` (compose schema, offline) accepts it")
    (spec,) = load_yaml_documents(compose)
    services = spec["services"]
    check({"attnd", "prometheus", "grafana"} <= set(services), f"services: {list(services)}")
    attnd = services["attnd"]
    devices = attnd["deploy"]["resources"]["reservations"]["devices"]
    check(any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices),
          f"attnd reserves no NVIDIA GPU: {devices}")
    check_flags(attnd.get("command", []), known_flags, "compose attnd command")
    published = {int(p.split(":")[-1]) for p in attnd["ports"]}
    check({50051, 9400} <= published, f"attnd publishes {attnd['ports']}")
    check(attnd["healthcheck"]["test"][1:3] == ["attnctl", "health"],
          f"compose healthcheck: {attnd['healthcheck']}")
    check(any(v.startswith("./prometheus.yml:") for v in services["prometheus"]["volumes"]),
          "Prometheus does not mount deploy/prometheus.yml")
    (prometheus_config,) = load_yaml_documents(os.path.join(DEPLOY, "prometheus.yml"))
    targets = [t for job in prometheus_config["scrape_configs"] if job["job_name"] == "attnd"
               for c in job["static_configs"] for t in c["targets"]]
    metrics_port = port_of(flag_value(attnd["command"], "metrics_address"))
    check(targets == [f"attnd:{metrics_port}"],
          f"prometheus.yml scrapes {targets}, compose's attnd serves metrics on "
          f"attnd:{metrics_port}")
    grafana_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"]
                          if v.startswith("./"))
    for source in grafana_mounts:
        check(os.path.isdir(os.path.join(DEPLOY, source)), f"grafana mounts missing {source}")
    provisioning = os.path.join(DEPLOY, "grafana", "provisioning")
    (datasources,) = load_yaml_documents(os.path.join(provisioning, "datasources",
                                                      "prometheus.yaml"))
    (providers,) = load_yaml_documents(os.path.join(provisioning, "dashboards", "attnd.yaml"))
    source = datasources["datasources"][0]
    check(source["type"] == "prometheus" and source["url"] == "http://prometheus:9090",
          f"Grafana datasource: {source}")
    dashboards_path = providers["providers"][0]["options"]["path"]
    check(grafana_mounts.get("./grafana/dashboards") == dashboards_path,
          f"dashboard provider reads {dashboards_path}, compose mounts {grafana_mounts}")
    passed(f"compose wiring: attnd reserves an NVIDIA GPU and publishes {sorted(published)}; "
           f"Prometheus scrapes {targets[0]}; Grafana provisions datasource {source['uid']} and "
           f"dashboards from {dashboards_path}")
    return source["uid"]


def check_dashboard(datasource_uid):
    with open(os.path.join(DEPLOY, "grafana", "dashboards", "attnd.json")) as f:
        dashboard = json.load(f)
    panels, ids = [], set()

    def walk(items):
        for panel in items:
            check(panel["id"] not in ids, f"duplicate panel id {panel['id']}")
            ids.add(panel["id"])
            panels.append(panel)
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    exprs = {p["title"]: " ".join(t["expr"] for t in p.get("targets", [])) for p in panels}
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    check(variables["datasource"]["current"]["value"] == datasource_uid,
          f"dashboard's datasource defaults to {variables['datasource']['current']}, the "
          f"provisioned one has uid {datasource_uid}")

    def panel_with(pattern, kind=None):
        return [t for t, e in exprs.items() if re.search(pattern, e)
                and (kind is None or any(p["title"] == t and p["type"] == kind for p in panels))]

    required = {
        "kernel latency percentiles": panel_with(
            r"histogram_quantile\(0\.99, .*attnd_kernel_duration_seconds_bucket"),
        "kernel latency heatmap": panel_with(r"attnd_kernel_duration_seconds_bucket", "heatmap"),
        "RPC rate by code": panel_with(r"sum by \(method, code\) \(rate\(attnd_rpc_requests_total"),
        "errors by code": panel_with(r"attnd_errors_total"),
        "KV usage per cache": panel_with(r"by \(cache\) \(attnd_kv_cache_usage_ratio"),
        "KV pages": panel_with(r"attnd_kv_pages"),
        "transfer bytes": panel_with(r"attnd_transfer_bytes_total"),
    }
    for what, found in required.items():
        check(found, f"the dashboard has no panel for {what}")
    passed(f"Grafana dashboard: {len(panels)} panels; " +
           "; ".join(f"{what}: {found[0]!r}" for what, found in required.items()))


def check_kubernetes(known_flags):
    k8s = os.path.join(DEPLOY, "k8s")
    documents = {}
    for name in sorted(os.listdir(k8s)):
        for doc in load_yaml_documents(os.path.join(k8s, name)):
            check("apiVersion" in doc and "kind" in doc, f"k8s/{name}: no apiVersion/kind")
            documents[(doc["kind"], doc.get("metadata", {}).get("name"))] = (name, doc)
    kustomization = documents[("Kustomization", None)][1]
    listed = set(kustomization["resources"])
    files = {f for f in os.listdir(k8s) if f != "kustomization.yaml"}
    check(listed == files, f"kustomization lists {sorted(listed)}, k8s/ has {sorted(files)}")

    deployment = documents[("Deployment", "attnd")][1]
    check(deployment["apiVersion"] == "apps/v1", "Deployment is not apps/v1")
    template = deployment["spec"]["template"]
    pod_labels = template["metadata"]["labels"]
    check(deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items(),
          "the Deployment's selector does not match its pod labels")
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    check_flags(args, known_flags, "k8s container args")
    check(ports["grpc"] == port_of(flag_value(args, "listen_address"))
          and ports["metrics"] == port_of(flag_value(args, "metrics_address")),
          f"containerPorts {ports} do not match the args {args}")
    for section in ("requests", "limits"):
        check(str(container["resources"][section].get("nvidia.com/gpu")) == "1",
              f"resources.{section} does not ask for nvidia.com/gpu: 1")
    probes = {}
    for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
        probe = container[probe_name]
        check("grpc" in probe and probe["grpc"]["port"] == ports["grpc"],
              f"{probe_name} is not a gRPC probe on the grpc port: {probe}")
        probes[probe_name] = probe["grpc"].get("service", "")
    check(probes["livenessProbe"] == "" and probes["readinessProbe"] == SERVICE,
          f"probe services: {probes}, expected liveness '' and readiness {SERVICE}")
    annotations = template["metadata"]["annotations"]
    check(annotations.get("prometheus.io/scrape") == "true"
          and int(annotations.get("prometheus.io/port")) == ports["metrics"]
          and annotations.get("prometheus.io/path") == "/metrics",
          f"pod scrape annotations: {annotations}")
    security = template["spec"]["securityContext"]
    check(security.get("runAsNonRoot") is True and security.get("runAsUser") != 0,
          f"pod securityContext: {security}")

    service = documents[("Service", "attnd")][1]
    check(service["spec"]["selector"].items() <= pod_labels.items(),
          "the Service's selector does not match the pods")
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    for name, port in service_ports.items():
        check(port["targetPort"] in ports, f"Service port {name} targets {port['targetPort']}, "
                                           f"not a named container port ({list(ports)})")
    monitor = documents[("ServiceMonitor", "attnd")][1]
    check(monitor["apiVersion"] == "monitoring.coreos.com/v1", "ServiceMonitor apiVersion")
    check(monitor["spec"]["selector"]["matchLabels"].items()
          <= service["metadata"]["labels"].items(),
          "the ServiceMonitor does not select the Service")
    for endpoint in monitor["spec"]["endpoints"]:
        check(endpoint["port"] in service_ports and endpoint.get("path", "/metrics") == "/metrics",
              f"ServiceMonitor endpoint {endpoint} names no Service port")
    passed(f"k8s: Deployment asks nvidia.com/gpu 1, gRPC probes {probes}, scrape annotations on "
           f"port {ports['metrics']}; Service and ServiceMonitor select it by named ports")
    return args, probes


def test(work_dir):
    args = e2e_lib.parse_args()
    known = attnd_flag_names(args.attnd)
    healthcheck = check_dockerfile(known)
    datasource_uid = check_compose(known)
    promtool = shutil.which("promtool")
    if promtool is None:
        skip_or_fail("promtool is not installed (Debian package prometheus)")
    run([promtool, "check", "config", os.path.join(DEPLOY, "prometheus.yml")])
    passed("deploy/prometheus.yml: promtool check config")
    check_dashboard(datasource_uid)
    k8s_args, probes = check_kubernetes(known)

    # attnd with the pod's args (CPU instead of the GPU it would get, loopback ports) answers
    # the health checks the kubelet's gRPC probes and the image's HEALTHCHECK send.
    pod_args = [a for a in k8s_args if not a.startswith(("--listen_address", "--metrics_address",
                                                         "--backend"))] + ["--backend=cpu"]
    attnd = Attnd(args.attnd, args.attnctl, work_dir, pod_args).start()
    for probe, service in probes.items():
        result = attnd.attnctl_run("health", f"--service={service}")
        check(result.stdout.strip() == "SERVING", f"{probe} ({service!r}): {result.stdout}")
    image_check = [a for a in healthcheck[2:] if not a.startswith("--server=")]
    result = run([args.attnctl, "health", *image_check, f"--server={attnd.address}"])
    check(result.stdout.strip() == "SERVING", f"HEALTHCHECK: {result.stdout}")
    passed(f"attnd with the pod's args: probes {probes} and the image's HEALTHCHECK answer "
           "SERVING")
    check(attnd.stop() == 0, "attnd did not exit 0 on SIGTERM")


if __name__ == "__main__":
    e2e_lib.main(test)
