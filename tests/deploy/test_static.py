"""Static checks of docker/ and deploy/, without a Docker engine or a cluster.

- hadolint on both Dockerfiles, plus the properties the images promise (non-root, health
  check on /healthz, the cache volume, ``jitserve serve``, pinned installs);
- yamllint (strict) on every YAML file under deploy/;
- the compose files against the vendored compose-spec JSON schema, as written and after
  interpolation and merging, plus what the schema cannot say (Redis eviction, no
  persistence, password, health checks, GPU reservations);
- every Kubernetes manifest, rendered with kustomize (``kubectl kustomize``), against the
  Kubernetes OpenAPI schemas (kubernetes-validate, strict, offline), plus probes, Secret
  references, selectors and the GPU overlay's placement;
- the Grafana dashboard: valid JSON whose PromQL uses only the server's metric names.

Each checker comes from the [test] extra (kubectl from the machine image); a missing one
fails with how to install it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from deploy_dockerfile import Dockerfile, parse_copy
from deploy_helpers import REPO, module, promql_names, run, tool

DOCKERFILES = {"cpu": REPO / "docker/Dockerfile", "cuda": REPO / "docker/Dockerfile.cuda"}
CONSTRAINTS = {"cpu": "docker/constraints.txt", "cuda": "docker/constraints-cuda.txt"}
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
K8S_DIRS = ["base", "redis", "overlays/cpu", "overlays/gpu"]
# The oldest Kubernetes minor these manifests promise to work on, and the newest schema.
K8S_OLDEST = "1.30.0"
KUBECTL_HINT = ("kubectl renders deploy/k8s with its built-in kustomize (v4 or newer); it is "
                "on the project's machine image (apt package kubectl) or any kubectl >= 1.21")


def _pyproject() -> dict[str, Any]:
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _jax_pin() -> str:
    for req in _pyproject()["project"]["optional-dependencies"]["server"]:
        m = re.fullmatch(r"jax==(\S+)", req.replace(" ", ""))
        if m:
            return m.group(1)
    raise AssertionError("pyproject's [server] extra does not pin jax==...")


def _pins(path: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (REPO / path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"{path}: {line!r} is not pinned with =="
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


# ---------------------------------------------------------------------------- Dockerfiles


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_hadolint(kind: str) -> None:
    hadolint = tool("hadolint")
    path = DOCKERFILES[kind]
    result = run([hadolint, "--no-color", "--failure-threshold", "style", str(path)], cwd=REPO)
    assert result.returncode == 0, f"hadolint {path.name}:\n{result.stdout}{result.stderr}"


def test_hadolint_reports_problems() -> None:
    """A control: hadolint really runs and fails a bad Dockerfile."""
    hadolint = tool("hadolint")
    bad = "FROM debian:latest\nRUN apt-get update && apt-get install -y curl\n"
    result = run([hadolint, "--no-color", "-"], input=bad)
    assert result.returncode != 0 and "DL3007" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_dockerfile_runtime_contract(kind: str) -> None:
    df = Dockerfile(DOCKERFILES[kind])
    assert len(df.stages) >= 2, "multi-stage: a builder and a runtime stage"
    for stage in df.stages:
        image, _, tag = stage.base.rpartition(":")
        assert image and tag and tag != "latest", f"unpinned base image {stage.base}"
    final = df.final
    assert any(parse_copy(c).from_stage == df.stages[0].name for c in final.all("COPY")), \
        "the runtime stage copies the builder's virtual environment"

    user = final.last("USER")
    assert user is not None and user.value.split(":")[0] not in ("root", "0"), "non-root USER"
    # The last USER comes before the entrypoint runs: nothing after it switches back.
    assert final.instructions.index(user) > max(final.instructions.index(i)
                                                for i in final.all("RUN"))

    assert final.entrypoint_and_cmd()[:2] == ["jitserve", "serve"]

    env = final.env()
    assert env["JITSERVE_HOST"] == "0.0.0.0"
    exposed = final.last("EXPOSE")
    assert exposed is not None and exposed.value.split("/")[0] == env["JITSERVE_PORT"]
    volume = final.last("VOLUME")
    assert volume is not None and env["JITSERVE_CACHE_DIR"] in (volume.exec_form() or [])

    options, cmd = final.healthcheck()
    assert "/healthz" in " ".join(cmd) and "JITSERVE_PORT" in " ".join(cmd)
    assert {"interval", "timeout", "start-period", "retries"} <= options.keys()

    if kind == "cuda":
        assert df.final.base.startswith("nvidia/cuda:")
        for var in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                    "JAX_PLATFORMS"):
            assert var in env, f"{var} is not set in the CUDA image"
        assert env["JAX_PLATFORMS"].split(",")[0] == "cuda"
        assert 0 < float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) <= 1


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_dockerfile_installs_the_package_pinned(kind: str) -> None:
    df = Dockerfile(DOCKERFILES[kind])
    builder = df.stages[0]
    copied = {src.rstrip("/") for c in builder.all("COPY") for src in parse_copy(c).sources}
    # The folders the packages are mapped from (client/, compiler/, service/).
    package_dirs = _pyproject()["tool"]["setuptools"]["package-dir"].values()
    packages = {d.split("/")[0] for d in package_dirs}
    needed = packages | {"pyproject.toml", "README.md", CONSTRAINTS[kind]}
    assert needed <= copied, f"the builder does not COPY {sorted(needed - copied)}"

    runs = " ".join(r.value for r in builder.all("RUN"))
    assert f"--constraint {CONSTRAINTS[kind]}" in runs
    assert f"--build-constraint {CONSTRAINTS[kind]}" in runs
    assert "'.[server]'" in runs

    pins = _pins(CONSTRAINTS[kind])
    jax = _jax_pin()
    assert pins["jax"] == jax and pins["jaxlib"] == jax
    for dep in ("fastapi", "uvicorn", "redis", "pip", "setuptools"):
        assert dep in pins, f"{CONSTRAINTS[kind]} does not pin {dep}"
    if kind == "cuda":
        assert "'jax[cuda12]'" in runs
        assert pins["jax-cuda12-plugin"] == jax and pins["jax-cuda12-pjrt"] == jax
        assert any(name.startswith("nvidia-cudnn-cu12") for name in pins)


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_dockerignore_keeps_what_the_build_copies(kind: str) -> None:
    path = DOCKERFILES[kind]
    ignore = path.with_name(path.name + ".dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    df = Dockerfile(path)
    for c in df.stages[0].all("COPY"):
        for src in parse_copy(c).sources:
            assert src.rstrip("/") in kept, f"{src} is COPY'd but excluded from the context"
            assert (REPO / src).exists(), f"{src} is COPY'd but missing"


# ---------------------------------------------------------------------------- YAML


def _yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def test_yamllint() -> None:
    module("yamllint")
    files = _yaml_files()
    assert len(files) >= 15, files
    config = DEPLOY / ".yamllint.yaml"
    result = run([tool("yamllint"), "--strict", "-f", "parsable", "-c", str(config),
                  *map(str, files)], cwd=REPO)
    assert result.returncode == 0, f"yamllint:\n{result.stdout}{result.stderr}"


def _load_yaml(path: Path) -> Any:
    yaml = module("yaml")
    return yaml.safe_load(path.read_text())


# ---------------------------------------------------------------------------- compose

_INTERP = re.compile(r"\$(?:(?P<esc>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
                     r"(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable interpolation (``$$``, ``${V}``, ``${V:-d}``, ``${V:?e}``, ...)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def repl(m: re.Match[str]) -> str:
        if m.group("esc"):
            return "$"
        name = m.group("name") or m.group("bare")
        op, arg = m.group("op"), m.group("arg")
        unset = name not in env
        empty = unset or env[name] == ""
        missing = empty if op and op.startswith(":") else unset
        if op in (":-", "-"):
            return arg if missing else env[name]
        if op in (":?", "?"):
            if missing:
                raise KeyError(f"required variable {name}: {arg}")
            return env[name]
        if op in (":+", "+"):
            return "" if missing else arg
        return env.get(name, "")

    return _INTERP.sub(repl, value)


def merge(base: Any, override: Any) -> Any:
    """Compose's override merge, near enough for validation: mappings merge recursively."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge(base[k], v) if k in base else v
        return out
    return copy.deepcopy(override)


@pytest.fixture(scope="module")
def compose_validator() -> Any:
    jsonschema = module("jsonschema")
    path = DEPLOY / "schemas/compose-spec.json"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest in (DEPLOY / "schemas/README.md").read_text(), \
        "deploy/schemas/compose-spec.json changed: update its digest in deploy/schemas/README.md"
    schema = json.loads(path.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _errors(validator: Any, doc: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)]


COMPOSE_ENV = {"REDIS_PASSWORD": "5f0c2b7e9d1a4c3b8e6f0a2d4c6e8b1a",
               "JITSERVE_CACHE_SECRET": "0d9c8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _load_yaml(DEPLOY / "compose.yaml")


@pytest.fixture(scope="module")
def compose_gpu() -> dict[str, Any]:
    return _load_yaml(DEPLOY / "compose.gpu.yaml")


def test_compose_schema(compose_validator: Any, compose: Any, compose_gpu: Any) -> None:
    assert _errors(compose_validator, compose) == []
    assert _errors(compose_validator, compose_gpu) == []
    for doc in (compose, merge(compose, compose_gpu)):
        assert _errors(compose_validator, interpolate(doc, COMPOSE_ENV)) == []


def test_compose_schema_rejects_mistakes(compose_validator: Any, compose: Any) -> None:
    """A control: the schema validator is not a no-op."""
    bad = copy.deepcopy(compose)
    bad["services"]["redis"]["helthcheck"] = bad["services"]["redis"].pop("healthcheck")
    assert _errors(compose_validator, bad)


def test_compose_needs_a_redis_password(compose: Any) -> None:
    with pytest.raises(KeyError, match="REDIS_PASSWORD"):
        interpolate(compose, {})


def test_compose_needs_a_cache_secret(compose: Any) -> None:
    """With Redis the settings require it; compose says so before the server starts."""
    with pytest.raises(KeyError, match="JITSERVE_CACHE_SECRET"):
        interpolate(compose, {"REDIS_PASSWORD": COMPOSE_ENV["REDIS_PASSWORD"]})


def test_compose_services(compose: Any) -> None:
    doc = interpolate(compose, COMPOSE_ENV)
    app, redis = doc["services"]["jitserve"], doc["services"]["redis"]

    cmd = redis["command"]
    assert cmd[0] == "redis-server"

    def opt(name: str) -> str:
        return cmd[cmd.index(name) + 1]

    assert opt("--maxmemory-policy") == "allkeys-lru"
    assert re.fullmatch(r"\d+[kmg]b", opt("--maxmemory"))
    assert opt("--save") == "" and opt("--appendonly") == "no"  # no persistence
    password = COMPOSE_ENV["REDIS_PASSWORD"]
    assert opt("--requirepass") == password
    assert "ports" not in redis, "Redis is not published on the host"
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert redis["environment"]["REDISCLI_AUTH"] == password

    assert app["environment"]["REDIS_URL"] == f"redis://:{password}@redis:6379/0"
    assert app["environment"]["JITSERVE_CACHE_SECRET"] == COMPOSE_ENV["JITSERVE_CACHE_SECRET"]
    assert app["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "/healthz" in " ".join(app["healthcheck"]["test"])
    port = app["environment"]["JITSERVE_PORT"]
    assert f":{port}/healthz" in " ".join(app["healthcheck"]["test"])
    assert all(p.endswith(f":{port}") for p in app["ports"])
    assert app["ports"][0].startswith("127.0.0.1:"), "loopback by default"
    cache_dir = app["environment"]["JITSERVE_CACHE_DIR"]
    assert any(v.endswith(f":{cache_dir}") for v in app["volumes"])
    assert cache_dir == Dockerfile(DOCKERFILES["cpu"]).final.env()["JITSERVE_CACHE_DIR"]
    assert (DEPLOY / app["build"]["context"] / app["build"]["dockerfile"]).resolve() \
        == DOCKERFILES["cpu"]


def test_compose_gpu_variant(compose: Any, compose_gpu: Any) -> None:
    doc = interpolate(merge(compose, compose_gpu), COMPOSE_ENV)
    app = doc["services"]["jitserve"]
    assert (DEPLOY / app["build"]["context"] / app["build"]["dockerfile"]).resolve() \
        == DOCKERFILES["cuda"]
    devices = app["deploy"]["resources"]["reservations"]["devices"]
    assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    for var in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        assert var in app["environment"]
    assert doc["services"]["redis"]["command"] == \
        interpolate(compose, COMPOSE_ENV)["services"]["redis"]["command"]


# ---------------------------------------------------------------------------- Kubernetes


def _kustomization_refs(kdir: Path) -> Iterator[Path]:
    kust = _load_yaml(kdir / "kustomization.yaml")
    for entry in kust.get("resources", []):
        yield (kdir / entry).resolve()
    for patch in kust.get("patches", []):
        if "path" in patch:
            yield (kdir / patch["path"]).resolve()


def test_every_manifest_is_rendered() -> None:
    """Every YAML file under deploy/k8s is a kustomization or used by one."""
    used: set[Path] = set()
    for d in K8S_DIRS:
        used.add((K8S / d / "kustomization.yaml").resolve())
        used.update(p for p in _kustomization_refs(K8S / d) if p.is_file())
    files = {p.resolve() for p in K8S.rglob("*.yaml")}
    assert files - used == set(), f"not part of any rendered kustomization: {files - used}"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    kubectl = tool("kubectl", hint=KUBECTL_HINT)
    yaml = module("yaml")
    out: dict[str, list[dict[str, Any]]] = {}
    for d in K8S_DIRS:
        result = run([kubectl, "kustomize", str(K8S / d)], timeout=120)
        assert result.returncode == 0, f"kubectl kustomize {d}:\n{result.stderr}"
        out[d] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


@pytest.mark.parametrize("version", ["oldest", "latest"])
@pytest.mark.parametrize("kdir", K8S_DIRS)
def test_kubernetes_validate(rendered: dict[str, list[dict[str, Any]]], kdir: str,
                             version: str) -> None:
    kv = module("kubernetes_validate")
    target = K8S_OLDEST if version == "oldest" else kv.latest_version()
    failures = []
    for doc in rendered[kdir]:
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kv.validate(doc, target, strict=True)
        except kv.ValidationError as e:
            failures.append(f"{name}: {'.'.join(map(str, e.path))}: {e.message}")
        except kv.SchemaNotFoundError as e:  # an unknown kind or apiVersion is an error here
            failures.append(f"{name}: {e.message}")
    assert rendered[kdir], f"{kdir} rendered nothing"
    assert failures == [], f"{kdir} against Kubernetes {target}:\n" + "\n".join(failures)


def test_kubernetes_validate_rejects_mistakes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """A control: strict validation catches a misspelt field and a wrong type."""
    kv = module("kubernetes_validate")
    deployment = _one(rendered["base"], "Deployment")
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)
    bad = copy.deepcopy(deployment)
    bad["spec"]["revisionHistoryLimit"] = "five"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "jitserve")


def test_kubernetes_base(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["base"]
    deployment = _one(docs, "Deployment", "jitserve")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    c = _container(deployment)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}

    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ports

    config = _one(docs, "ConfigMap")
    assert c["envFrom"][0]["configMapRef"]["name"] == config["metadata"]["name"]
    assert str(ports["http"]) == config["data"]["JITSERVE_PORT"]
    secret_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]
                  if "secretKeyRef" in e.get("valueFrom", {})}
    assert secret_env["REDIS_URL"]["key"] == "redis-url"
    assert secret_env["JITSERVE_CACHE_SECRET"]["key"] == "cache-secret"
    assert secret_env["JITSERVE_API_KEYS"]["key"] == "api-keys"
    assert "Secret" not in {d["kind"] for d in docs}, "secrets are created by the operator"

    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert config["data"]["JITSERVE_CACHE_DIR"] in mounts and "/tmp" in mounts

    service = _one(docs, "Service", "jitserve")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] in ports
    # Any replica answers for any future: the Service balances plainly.
    assert service["spec"].get("sessionAffinity", "None") == "None"
    assert "sessionAffinityConfig" not in service["spec"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["JITSERVE_PEER_URL"]["value"] == "http://$(POD_IP):8000"
    # The grace period covers the preStop sleep and the drain.
    drain = float(config["data"]["JITSERVE_DRAIN_TIMEOUT_S"])
    pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pre_stop + drain + 60

    pdb = _one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = _one(docs, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "jitserve")
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    ttl = float(config["data"]["JITSERVE_FUTURE_TTL_S"])
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= ttl


def test_kubernetes_redis(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["redis"]
    sts = _one(docs, "StatefulSet")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    args = c["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert args[args.index("--save") + 1] == "" and args[args.index("--appendonly") + 1] == "no"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    env = {e["name"]: e for e in c["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"
    assert "volumeClaimTemplates" not in sts["spec"], "no persistence by default"
    service = _one(docs, "Service")
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    policy = _one(docs, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_kubernetes_overlays(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    docs = rendered[f"overlays/{overlay}"]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget",
            "HorizontalPodAutoscaler", "StatefulSet"} <= kinds
    deployment = _one(docs, "Deployment", "jitserve")
    pod = deployment["spec"]["template"]["spec"]
    c = _container(deployment)
    # The in-cluster Redis the overlay brings is the one REDIS_URL is documented to name.
    redis_service = _one(docs, "Service", "jitserve-redis")["metadata"]["name"]
    assert f"@{redis_service}:6379" in (REPO / "docs/deploy.md").read_text()
    limits = c["resources"]["limits"]
    image_tag = c["image"].rpartition(":")[2]
    if overlay == "gpu":
        assert int(limits["nvidia.com/gpu"]) >= 1
        assert any(k.startswith("nvidia.com/") for k in pod["nodeSelector"])
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert {"XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION"} <= env.keys()
        assert "cuda" in image_tag
    else:
        assert "nvidia.com/gpu" not in limits and "tolerations" not in pod
        assert "cuda" not in image_tag
    # The overlay keeps the base's probes and secrets.
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {e["name"] for e in c["env"]} >= {"REDIS_URL", "JITSERVE_CACHE_SECRET",
                                            "JITSERVE_API_KEYS"}


def test_docs_name_every_secret_key(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """docs/deploy.md's kubectl create secret command covers every key the pods read."""
    keys = set()
    for docs in rendered.values():
        text = json.dumps(docs)
        keys.update(re.findall(r'"key": "([a-z-]+)", "name": "jitserve-secrets"', text))
    assert keys == {"redis-url", "cache-secret", "api-keys", "redis-password"}, keys
    doc = (REPO / "docs/deploy.md").read_text()
    for key in keys:
        assert f"--from-literal={key}=" in doc, f"docs/deploy.md does not create {key}"


# ---------------------------------------------------------------------------- Grafana

COUNTERS = {"jitserve_requests_total", "jitserve_compilations_total", "jitserve_cache_hits_total",
            "jitserve_cache_misses_total", "jitserve_executions_total",
            "jitserve_transfer_bytes_total", "jitserve_redis_errors_total"}
HISTOGRAMS = {"jitserve_compile_seconds", "jitserve_execute_seconds"}
GAUGES = {"jitserve_futures", "jitserve_device_bytes_in_use"}
SERIES = COUNTERS | GAUGES | {f"{h}_{s}" for h in HISTOGRAMS for s in ("bucket", "sum", "count")}
LABELS = {"route", "status", "tier", "state", "direction", "le", "instance", "job"}
def test_promql_names_reader() -> None:
    metrics, labels = promql_names(
        'sum by (tier) (rate(jitserve_cache_hits_total{instance=~"$instance"}[$__rate_interval]))'
        ' / ignoring (tier) group_left () clamp_min(sum(rate(x_total[5m])), 1e-9) > bool 0.5')
    assert metrics == {"jitserve_cache_hits_total", "x_total"}
    assert labels == {"tier", "instance"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana/jitserve.json").read_text())


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows keep their panels inside
    return out


def test_grafana_dashboard_queries(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["title"]
    used: set[str] = set()
    problems = []
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        targets = panel.get("targets", [])
        if not targets:
            problems.append(f"panel {panel['title']!r} has no queries")
        for t in targets:
            metrics, labels = promql_names(t["expr"])
            if not metrics:
                problems.append(f"{panel['title']!r}: no metric in {t['expr']!r}")
            if metrics - SERIES:
                problems.append(f"{panel['title']!r}: unknown metrics {sorted(metrics - SERIES)}")
            if labels - LABELS:
                problems.append(f"{panel['title']!r}: unknown labels {sorted(labels - LABELS)}")
            used |= metrics
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+)\s*,\s*(\w+)\)", var["query"]["query"])
            assert m and m.group(1) in SERIES and m.group(2) in LABELS, var
    assert problems == [], "\n".join(problems)

    families = {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
    # The panels: request rate, latency, compile seconds, cache hits by tier, futures
    # by state, device bytes, Redis errors.
    assert {"jitserve_requests_total", "jitserve_execute_seconds", "jitserve_compile_seconds",
            "jitserve_cache_hits_total", "jitserve_cache_misses_total", "jitserve_futures",
            "jitserve_device_bytes_in_use", "jitserve_redis_errors_total"} <= families


def test_grafana_dashboard_layout(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
    assert any(v["name"] == "datasource" and v["type"] == "datasource"
               for v in dashboard["templating"]["list"])
