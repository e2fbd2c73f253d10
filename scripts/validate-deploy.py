#!/usr/bin/env python3
"""Consistency checks of deploy/ that the schemas cannot make (scripts/validate-deploy.sh runs
the schemas first): every Service, disruption budget, autoscaler and ServiceMonitor finds what it
names; probes use ports the container declares; pods run as hardened as docs/deploy.md says;
grace periods cover the drain; and every `faden` flag and FADEN_* variable in the Kubernetes
manifests, the compose file and the systemd units exists in the binary's own `--help`.

Usage: validate-deploy.py FADEN_BINARY
"""

import configparser
import pathlib
import re
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMMANDS = ("server", "gateway", "worker", "mock-engine", "up", "probe")
problems = []


def problem(where, text):
    problems.append(f"{where}: {text}")


def cli_reference(binary):
    """Per command: the long flags and the FADEN_* variables its --help lists."""
    ref = {}
    for cmd in COMMANDS:
        text = subprocess.run([binary, cmd, "--help"], check=True, capture_output=True, text=True).stdout
        ref[cmd] = (set(re.findall(r"--[a-z][a-z0-9-]*", text)), set(re.findall(r"\bFADEN_[A-Z0-9_]+", text)))
    return ref


def check_command(where, args, ref):
    """`args` is a faden command line without the binary: a known command with known flags."""
    if not args or args[0] not in ref:
        problem(where, f"not a faden command: {args[:1]}")
        return
    flags, _ = ref[args[0]]
    for arg in args[1:]:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and flag not in flags:
            problem(where, f"`faden {args[0]}` has no flag {flag}")


def check_env(where, command, names, ref):
    _, envs = ref[command]
    for name in names:
        if name.startswith("FADEN_") and name not in envs:
            problem(where, f"`faden {command}` reads no {name}")


def duration_seconds(text):
    m = re.fullmatch(r"(\d+)(ms|s|m)", text)
    if not m:
        return None
    value, unit = int(m.group(1)), m.group(2)
    return {"ms": value / 1000, "s": value, "m": value * 60}[unit]


def drain_seconds(args, env=None):
    for arg in args:
        if arg.startswith("--drain-timeout="):
            return duration_seconds(arg.split("=", 1)[1])
    if env and "FADEN_DRAIN_TIMEOUT" in env:
        return duration_seconds(env["FADEN_DRAIN_TIMEOUT"])
    return 30  # faden's default


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def kubernetes(ref, version):
    docs = []
    for path in sorted((DEPLOY / "kubernetes").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.relative_to(ROOT), doc))
    workloads = [(p, d) for p, d in docs if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]
    services = [(p, d) for p, d in docs if d["kind"] == "Service"]
    configmaps = {(d["metadata"]["namespace"], d["metadata"]["name"]): d.get("data", {}) for _, d in docs if d["kind"] == "ConfigMap"}

    def pods(namespace, selector):
        return [
            d for _, d in workloads
            if d["metadata"]["namespace"] == namespace and matches(selector, d["spec"]["template"]["metadata"]["labels"])
        ]

    def port_names(workload):
        return {p.get("name") for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}

    for path, w in workloads:
        where = f"{path} {w['kind']}/{w['metadata']['name']}"
        spec = w["spec"]["template"]["spec"]
        if not matches(w["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"]):
            problem(where, "selector does not match its own pod labels")
        pod_sc = spec.get("securityContext", {})
        if not pod_sc.get("runAsNonRoot") or pod_sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            problem(where, "pod must set runAsNonRoot and seccompProfile RuntimeDefault")
        if spec.get("automountServiceAccountToken") is not False:
            problem(where, "faden needs no Kubernetes API token: automountServiceAccountToken: false")
        for c in spec["containers"]:
            sc = c.get("securityContext", {})
            if sc.get("allowPrivilegeEscalation") is not False or sc.get("capabilities", {}).get("drop") != ["ALL"]:
                problem(where, f"container {c['name']}: allowPrivilegeEscalation false and drop ALL")
            if "requests" not in c.get("resources", {}):
                problem(where, f"container {c['name']}: no resource requests")
            names = {p.get("name") for p in c.get("ports", [])}
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                if port is not None and port not in names:
                    problem(where, f"{probe} uses port {port}, not declared by {c['name']}")
            if not c["image"].split("/")[-1].startswith("faden:"):
                continue
            # A faden container: hardened fully, the version's image, a valid command line.
            if c["image"].rsplit(":", 1)[1] != version:
                problem(where, f"image {c['image']} is not faden {version}")
            if sc.get("readOnlyRootFilesystem") is not True:
                problem(where, "faden runs with a read-only root filesystem")
            args = c.get("args", [])
            check_command(where, args, ref)
            env_names = [e["name"] for e in c.get("env", [])]
            for src in c.get("envFrom", []):
                key = (w["metadata"]["namespace"], src["configMapRef"]["name"])
                if key not in configmaps:
                    problem(where, f"envFrom names a ConfigMap that is not here: {key[1]}")
                env_names += list(configmaps.get(key, {}))
            if args and args[0] in ref:
                check_env(where, args[0], env_names, ref)
            declared = set(env_names)
            for arg in args:
                for var in re.findall(r"\$\(([A-Z_]+)\)", arg):
                    if var not in declared:
                        problem(where, f"{arg} uses $({var}), which the container does not define")
            pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
            grace = spec.get("terminationGracePeriodSeconds", 30)
            if args and args[0] in ("server", "gateway") and grace <= pre_stop + drain_seconds(args):
                problem(where, f"terminationGracePeriodSeconds {grace} <= preStop {pre_stop} s + drain {drain_seconds(args)} s")

    for path, s in services:
        where = f"{path} Service/{s['metadata']['name']}"
        targets = pods(s["metadata"]["namespace"], s["spec"].get("selector"))
        if not targets:
            problem(where, "selects no workload")
        for port in s["spec"]["ports"]:
            if isinstance(port.get("targetPort"), str) and any(port["targetPort"] not in port_names(t) for t in targets):
                problem(where, f"targetPort {port['targetPort']} not declared by the pods it selects")

    for path, d in docs:
        where = f"{path} {d['kind']}/{d['metadata']['name']}"
        if d["kind"] == "PodDisruptionBudget" and not pods(d["metadata"]["namespace"], d["spec"]["selector"]["matchLabels"]):
            problem(where, "selects no workload")
        if d["kind"] == "HorizontalPodAutoscaler":
            t = d["spec"]["scaleTargetRef"]
            if not any(w["kind"] == t["kind"] and w["metadata"]["name"] == t["name"] and w["metadata"]["namespace"] == d["metadata"]["namespace"] for _, w in workloads):
                problem(where, f"scales {t['kind']}/{t['name']}, which is not here")
        if d["kind"] == "ServiceMonitor":
            namespaces = d["spec"].get("namespaceSelector", {}).get("matchNames", [d["metadata"]["namespace"]])
            selected = [s for _, s in services if s["metadata"]["namespace"] in namespaces and matches(d["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
            for endpoint in d["spec"]["endpoints"]:
                if not any(endpoint["port"] == p.get("name") for s in selected for p in s["spec"]["ports"]):
                    problem(where, f"no selected Service has a port named {endpoint['port']}")
    return len(docs)


def compose(ref):
    path = DEPLOY / "compose" / "compose.yaml"
    services = yaml.safe_load(path.read_text())["services"]
    for name, svc in services.items():
        where = f"{path.relative_to(ROOT)} service {name}"
        if "healthcheck" not in svc:
            problem(where, "no healthcheck")
        for dep in svc.get("depends_on", {}):
            if dep not in services:
                problem(where, f"depends on {dep}, which is not a service")
        mode = svc.get("network_mode", "")
        if mode.startswith("service:") and mode.split(":", 1)[1] not in services:
            problem(where, f"network_mode {mode}: no such service")
        if "faden" not in svc.get("image", ""):
            continue
        command = svc.get("command", [])
        check_command(where, command, ref)
        if command and command[0] in ref:
            check_env(where, command[0], svc.get("environment", {}), ref)
        test = svc.get("healthcheck", {}).get("test", [])
        if test[:3] != ["CMD", "/usr/local/bin/faden", "probe"]:
            problem(where, "a faden container's health check is `faden probe URL` (no shell, no curl)")
        grace = duration_seconds(svc.get("stop_grace_period", "10s"))
        if command and command[0] in ("server", "gateway") and grace <= drain_seconds(command):
            problem(where, f"stop_grace_period {grace} s <= drain {drain_seconds(command)} s")
    return len(services)


def systemd(ref):
    units = sorted((DEPLOY / "systemd").glob("*.service"))
    for unit in units:
        where = str(unit.relative_to(ROOT))
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.optionxform = str
        parser.read_string(unit.read_text())
        service = parser["Service"]
        exec_start = service["ExecStart"].split()
        if exec_start[0] != "/usr/local/bin/faden":
            problem(where, f"ExecStart runs {exec_start[0]}")
            continue
        command = exec_start[1:]
        check_command(where, command, ref)
        example = DEPLOY / "systemd" / f"{command[0]}.env.example"
        env = {}
        if example.exists():
            for line in example.read_text().splitlines():
                if "=" in line and not line.startswith("#"):
                    key, value = line.split("=", 1)
                    env[key] = value
            check_env(str(example.relative_to(ROOT)), command[0], env, ref)
        else:
            problem(where, f"no {example.name} beside it")
        if service.get("LimitNOFILE") is None:
            problem(where, "no LimitNOFILE")
        stop = duration_seconds(service.get("TimeoutStopSec", "90s"))
        if command[0] in ("server", "gateway") and stop <= drain_seconds(command, env):
            problem(where, f"TimeoutStopSec {stop} s <= drain {drain_seconds(command, env)} s")
    return len(units)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    binary = sys.argv[1]
    version = subprocess.run([binary, "--version"], check=True, capture_output=True, text=True).stdout.split()[1]
    ref = cli_reference(binary)
    counts = (kubernetes(ref, version), compose(ref), systemd(ref))
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        sys.exit(f"validate-deploy.py: {len(problems)} problem(s)")
    print(f"deploy/ consistent: {counts[0]} Kubernetes objects, {counts[1]} compose services, {counts[2]} systemd units")


if __name__ == "__main__":
    main()
