"""Checks of the deployment files that need no Docker engine or cluster.

What the Dockerfile's images are and do (non-root, what each holds, the pinned CPU torch, no build secret left,
serving and training) is checked by building and running them: ``make docker-smoke`` (deploy/docker_smoke.py).
Here: compose and the Kubernetes manifests parse, name the right images, commands, ports and probes, point at
modules and flags that exist, the manifests validate against the Kubernetes API's own schemas (offline,
kubernetes-validate), and the health-check one-liners they and the Dockerfile embed really probe a running
service.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from scheduler_service import cli

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "deploy" / "k8s"
SCHEDULER_IMAGE = "skrull-scheduler:0.1.0"
TRAINER_IMAGE = "skrull-trainer:0.1.0"
PORT = 8000

TRAINER_ARGS = ["--dp", "2", "--cp", "2", "--model", "tiny", "--data", "synthetic:lmsys", "--global-batch", "16",
                "--steps", "20", "--scheduler", "skrull"]


# ---- a tiny Dockerfile reader ----------------------------------------------------------------------------------

def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name → its (INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, arguments = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            name = arguments.split(" AS ")[-1].strip() if " AS " in arguments else f"stage{len(stages)}"
            current = stages.setdefault(name, [])
        current.append((instruction, arguments.strip()))
    return stages


def instruction(stage: list[tuple[str, str]], name: str) -> list[str]:
    return [arguments for kind, arguments in stage if kind == name]


def exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(part, str) for part in value), arguments
    return value


# ---- compose -----------------------------------------------------------------------------------------------------

def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return document


def test_compose_builds_both_targets_of_the_dockerfile() -> None:
    services = compose()["services"]
    assert set(services) == {"scheduler", "trainer"}
    stages = dockerfile_stages()
    for name, image in (("scheduler", SCHEDULER_IMAGE), ("trainer", TRAINER_IMAGE)):
        build = services[name]["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
        assert build["target"] in stages
        assert services[name]["image"] == image


def test_compose_runs_one_scheduler_worker() -> None:
    assert compose()["services"]["scheduler"]["environment"]["SKRULL_WORKERS"] == "1"


def test_compose_trainer_waits_for_healthy_scheduler_and_uses_its_name() -> None:
    services = compose()["services"]
    trainer = services["trainer"]
    assert trainer["depends_on"] == {"scheduler": {"condition": "service_healthy"}}
    command = trainer["command"]
    assert command[:5] == ["torchrun", "--nproc-per-node", "4", "-m", "trainer_client.train"]
    assert command[5:] == [*TRAINER_ARGS, "--scheduler-url", f"http://scheduler:{PORT}", "--bucket-size", "4096"]
    assert importlib.util.find_spec("trainer_client.train") is not None
    scheduler = services["scheduler"]
    args = cli.build_parser().parse_args(["serve", *scheduler["command"]])
    assert (args.host, args.port) == ("0.0.0.0", PORT)
    assert scheduler["ports"] == [f"127.0.0.1:${{SKRULL_HOST_PORT:-{PORT}}}:{PORT}"]
    test = scheduler["healthcheck"]["test"]
    assert test[0] == "CMD" and f"127.0.0.1:{PORT}/readyz" in test[-1]


def test_compose_trainer_flags_exist_in_the_trainer() -> None:
    from trainer_client.train import build_parser  # the flags are generated from TrainConfig's fields

    known = {flag for action in build_parser()._actions for flag in action.option_strings}
    flags = [part for part in compose()["services"]["trainer"]["command"][5:] if part.startswith("--")]
    missing = [flag for flag in flags if flag not in known]
    assert not missing, f"trainer_client.train has no {missing}"


# ---- Kubernetes ----------------------------------------------------------------------------------------------------

def k8s_documents() -> dict[str, list[dict[str, Any]]]:
    return {path.name: list(yaml.safe_load_all(path.read_text())) for path in sorted(K8S.glob("*.yaml"))}


def pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for name, documents in k8s_documents().items():
        for document in documents:
            spec = document["spec"]
            if document["kind"] in ("Job", "Deployment"):
                yield f"{name}:{document['kind']}", spec["template"]["spec"]
            elif document["kind"] == "PyTorchJob":
                for role, replica in spec["pytorchReplicaSpecs"].items():
                    yield f"{name}:{role}", replica["template"]["spec"]


def assert_http_probe(probe: dict[str, Any], path: str) -> None:
    assert probe["httpGet"]["path"] == path
    assert probe["httpGet"]["port"] in (PORT, "http")


def assert_scheduler_container(container: dict[str, Any]) -> None:
    assert container["image"] == SCHEDULER_IMAGE
    args = cli.build_parser().parse_args(["serve", *container["args"]])
    assert args.port == PORT
    assert {"containerPort": PORT, "name": "http"} in container["ports"]
    assert_http_probe(container["startupProbe"], "/readyz")
    assert_http_probe(container["readinessProbe"], "/readyz")
    assert_http_probe(container["livenessProbe"], "/healthz")
    assert container["securityContext"]["runAsNonRoot"] is True
    # One worker per container (the default follows the host's cores): scale with replicas.
    assert {"name": "SKRULL_WORKERS", "value": "1"} in container["env"]


def test_k8s_files_parse_and_name_their_kinds() -> None:
    kinds = {name: [d["kind"] for d in documents] for name, documents in k8s_documents().items()}
    assert kinds == {"pytorchjob.yaml": ["PyTorchJob"], "redis.yaml": ["Deployment", "Service"],
                     "scheduler-deployment.yaml": ["Deployment", "Service"], "trainer-job.yaml": ["Job"]}
    for documents in k8s_documents().values():
        for document in documents:
            assert document["apiVersion"] and document["metadata"]["name"]


def test_k8s_training_pods_carry_the_scheduler_as_native_sidecar() -> None:
    training = {where: spec for where, spec in pod_specs() if "Deployment" not in where}
    assert set(training) == {"trainer-job.yaml:Job", "pytorchjob.yaml:Master", "pytorchjob.yaml:Worker"}
    for where, spec in training.items():
        [sidecar] = spec["initContainers"]
        assert sidecar["restartPolicy"] == "Always", where
        assert_scheduler_container(sidecar)
        [trainer] = spec["containers"]
        assert trainer["image"] == TRAINER_IMAGE
        command = trainer["command"]
        assert command[0] == "torchrun" and "trainer_client.train" in command
        assert f"--scheduler-url=http://localhost:{PORT}" in command, where


def test_k8s_shared_scheduler_is_a_deployment_behind_a_service() -> None:
    deployment, service = k8s_documents()["scheduler-deployment.yaml"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["replicas"] >= 2
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert_scheduler_container(container)
    assert service["spec"]["ports"] == [{"name": "http", "port": PORT, "targetPort": "http"}]
    grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    env = {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}
    assert grace_s > float(env["SKRULL_CPSAT_MAX_TIME_LIMIT_S"])
    # replicas share jobs through the Redis of redis.yaml; the token comes from a Secret that may not exist
    redis_deployment, redis_service = k8s_documents()["redis.yaml"]
    assert env["SKRULL_STATE_URL"] == f"redis://{redis_service['metadata']['name']}:6379/0"
    redis_labels = redis_deployment["spec"]["template"]["metadata"]["labels"]
    assert redis_service["spec"]["selector"].items() <= redis_labels.items()
    assert env["SKRULL_API_TOKEN"] == {"secretKeyRef": {"name": "skrull-scheduler", "key": "api-token",
                                                        "optional": True}}


# Kubernetes versions the manifests must be valid for: the first with native sidecars on by default, and the newest
# kubernetes-validate ships schemas for.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())


def k8s_resources() -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object the API server would validate: each manifest, and each PyTorchJob replica's pod template as
    a PodTemplate (the operator is a CRD, so its own schema is not the API's; the pods it creates are)."""
    for name, documents in k8s_documents().items():
        for document in documents:
            if document["kind"] == "PyTorchJob":
                for role, replica in document["spec"]["pytorchReplicaSpecs"].items():
                    yield f"{name}:{role}", {"apiVersion": "v1", "kind": "PodTemplate",
                                             "metadata": {"name": f"{document['metadata']['name']}-{role.lower()}"},
                                             "template": replica["template"]}
            else:
                yield f"{name}:{document['kind']}", document


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_validate_against_the_kubernetes_api_schemas(version: str) -> None:
    resources = dict(k8s_resources())
    assert len(resources) == 7
    for where, resource in resources.items():
        try:  # strict: an unknown (misspelt) field fails too
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{where} against Kubernetes {version}: {'.'.join(map(str, error.path))}: {error.message}")


def test_k8s_schema_validation_catches_a_misspelt_or_mistyped_field() -> None:
    deployment = k8s_documents()["scheduler-deployment.yaml"][0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    for broken in ({**container, "livenesProbe": container["livenessProbe"]},
                   {**container, "ports": [{"name": "http", "containerPort": "8000"}]}):
        document = {**deployment, "spec": {**deployment["spec"], "template": {
            **deployment["spec"]["template"], "spec": {**deployment["spec"]["template"]["spec"],
                                                       "containers": [broken]}}}}
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(document, K8S_VERSIONS[-1], strict=True)


# ---- the embedded health checks really probe the service -------------------------------------------------------

def run_probe(command: list[str], port: int) -> int:
    assert command[:2] == ["python", "-c"], command
    code = command[2].replace(f"127.0.0.1:{PORT}", f"127.0.0.1:{port}")
    try:
        exec(compile(code, "<healthcheck>", "exec"), {})
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def test_healthcheck_commands_succeed_against_a_running_service(live_port: int) -> None:
    healthcheck = next(a for kind, a in dockerfile_stages()["scheduler"] if kind == "HEALTHCHECK")
    docker_probe = exec_form(healthcheck.split(" CMD ", 1)[1])
    assert f"127.0.0.1:{PORT}/healthz" in docker_probe[-1]
    compose_probe = compose()["services"]["scheduler"]["healthcheck"]["test"][1:]
    for probe in (docker_probe, compose_probe):
        assert run_probe(probe, live_port) == 0, shlex.join(probe)
