"""Run a job as a KubeRay ``RayJob``, derived from its job.yaml (no second hand-written spec).

    make render-kuberay JOB=ddp    # writes build/ddp/rayjob.yaml (+ the code ConfigMap)
    make run-kuberay JOB=ddp       # apply it to the current kubectl context, wait, print logs

What comes from where:
  * job.yaml: entrypoint (with the chosen profile), env vars and working_dir excludes (the
    runtime env), ``max_retries`` -> ``backoffLimit``, ``timeout_s`` -> ``activeDeadlineSeconds``;
  * the job's resolved settings (``main.py --print-config``): the worker group - how many pods,
    CPUs/GPUs each - from ``num_workers``, ``cpus_per_worker``, ``use_gpu``, ``min_workers``;
  * for GPU profiles, GPUs per pod from the instance type of the compute config job.yaml mirrors.

How code and packages reach the pods:
  * the code (the job folder and ``shared/``) is a ConfigMap mounted in the head, the workers
    and the submitter pod. The submitter runs ``ray job submit`` with ``working_dir`` = that
    mount, so the runtime env is the one ``make run-cluster`` and Anyscale use;
  * the packages: for CPU (smoke) profiles by default the stock ``rayproject/ray`` image, with
    the pinned packages the Anyscale image bakes in installed by the runtime env's ``pip`` (CPU
    torch wheels: kind); or ``--image``, the job's Containerfile built and loaded into the
    cluster (``kind load docker-image``), and no runtime ``pip``. GPU (full) profiles need
    ``--image`` (the job's CUDA image): the render refuses them without one.

Storage: Ray Train needs one path every node can read (``--storage``):
  * ``pvc`` (the default for GPU profiles): a ReadWriteMany PersistentVolumeClaim, rendered
    beside the RayJob (``--storage-class`` picks an RWX class such as EFS/Filestore/NFS);
  * ``s3://bucket/prefix`` (any URI): an object store as ``storage_path``, no volume;
  * ``kind`` (the default for CPU profiles): a directory of the single kind node
    (``ci/kind-config.yaml`` mounts it) as a hostPath - only shared because kind has one node.
GPU worker pods also get a memory-backed ``/dev/shm`` (NCCL between the GPUs of a pod needs
more than the container default of 64 MB), and request exactly what they limit.

The renderer validates what it writes (``validate``) against the KubeRay CRD's v1 schema, strictly
(unknown fields rejected, as ``kubectl --validate=strict`` does), plus the operator's own rules.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from ci.images import pinned_requirements
from ci.jobspec import CPUS_LEFT_FOR_DATA, REPO, JobSpecError, instance_type, load
from ci.template import needed_shared_files

KUBERAY_VERSION = "1.7.0"
RAY_VERSION = "2.60.0"
STOCK_IMAGE = f"rayproject/ray:{RAY_VERSION}-py311-cpu"
CRD_ENV = "KUBERAY_CRD_DIR"  # a directory holding ray.io_rayjobs.yaml
VENDORED_CRD_DIR = REPO / "ci" / "kuberay" / f"v{KUBERAY_VERSION}"
CRD_URL = (
    f"https://raw.githubusercontent.com/ray-project/kuberay/v{KUBERAY_VERSION}/"
    "ray-operator/config/crd/bases/ray.io_rayjobs.yaml"
)
APP_DIR = "/home/ray/app"  # the code, in every pod
RUNS_DIR = "/home/ray/runs"  # shared storage_path, in every pod
KIND_RUNS_DIR = "/runs"  # on the kind node (ci/kind-config.yaml mounts the host dir there)
PVC_SIZE = "200Gi"  # checkpoints of a ~500M model with optimizer state, several kept
STORAGE_KINDS = ("kind", "pvc")  # or an object-store URI
POD_RAM_FRACTION = 0.8  # of the node's RAM: the rest for the kubelet and daemon sets
# A smoke run on kind: image pull, the runtime env's pip install, ~1 min of training.
SMOKE_DEADLINE_S = 1800
# `make run-kuberay` waits the RayJob's deadline plus this (the operator marks it Failed then).
RUN_GRACE_S = 300
# KubeRay's RayJob .status.jobDeploymentStatus values after which nothing more happens
# (rayjob_types.go: Complete, Failed, ValidationFailed; the others are on the way there).
TERMINAL_DEPLOYMENT_STATUSES = ("Complete", "Failed", "ValidationFailed")
SUBMISSION_MODES = ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
CONFIGMAP_LIMIT = 1024 * 1024  # etcd's object size limit
CONFIGMAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


class KubeRayError(ValueError):
    """A manifest that KubeRay would reject; the message is one sentence."""


# ------------------------------------------------------------------------------------------
# rendering


def resource_name(job: str) -> str:
    """RFC 1123 label: lower case, digits and '-'."""
    return f"train-{job}".replace("_", "-")


def code_files(job: str) -> list[Path]:
    """What a job needs on the cluster: its ``main.py`` and the ``shared`` modules it imports,
    directly or not (the import closure ``make template`` copies): no READMEs, Containerfiles
    or modules it never loads, so the ConfigMap stays far below its 1 MiB limit."""
    return [REPO / "jobs" / job / "main.py", *needed_shared_files(job)]


def code_configmap(job: str, name: str) -> tuple[dict, list[dict]]:
    """The code as a ConfigMap; keys are flat, so each key maps back to its path on mount."""
    data, items = {}, []
    for path in code_files(job):
        relative = path.relative_to(REPO).as_posix()
        key = relative.replace("/", "__")
        data[key] = path.read_text()
        items.append({"key": key, "path": relative})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-code", "labels": {"app.kubernetes.io/name": name}},
        "data": data,
    }, items


def runs_pvc(name: str, storage_class: str = "") -> dict:
    """The shared run directory for several nodes: ReadWriteMany, so every pod mounts it."""
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": PVC_SIZE}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": f"{name}-runs", "labels": {"app.kubernetes.io/name": name}},
        "spec": spec,
    }


def worker_group(settings: dict, spec) -> dict:
    """Worker pods sized from the job's scaling config: on GPUs one pod per node of the compute
    config (all its GPUs, most of its RAM), on CPUs one pod per worker or TP group (plus a CPU
    for Ray Data)."""
    workers = settings["num_workers"]
    min_workers = settings.get("min_workers") or workers
    if settings["use_gpu"]:
        node = instance_type(spec.config.compute_config.worker_nodes[0].instance_type)
        workers_per_pod = max(1, node.gpus)
        cpus = math.ceil(settings["cpus_per_worker"] * workers_per_pod) + CPUS_LEFT_FOR_DATA
        memory_gib = int(node.ram_gib * POD_RAM_FRACTION)
        start = {"num-cpus": str(cpus), "num-gpus": str(workers_per_pod)}
        limits = {"cpu": str(cpus), "memory": f"{memory_gib}Gi",
                  "nvidia.com/gpu": str(workers_per_pod)}  # fmt: skip
        requests = dict(limits)  # GPUs cannot be overcommitted: requests equal limits
        # NCCL's shared-memory transport between the pod's GPUs; counts against the memory.
        shm = f"{memory_gib // 4}Gi"
    else:
        # One pod per training worker, or per TP group: a TP group must share a node.
        workers_per_pod = settings.get("tp", 1)
        cpus = math.ceil(settings["cpus_per_worker"] * workers_per_pod) + CPUS_LEFT_FOR_DATA
        start = {"num-cpus": str(cpus)}
        # Request little (kind runs on a 4-CPU CI machine), let the pod burst to its Ray CPUs.
        requests = {"cpu": "500m", "memory": "1536Mi"}
        limits = {"cpu": str(cpus), "memory": "3Gi"}
        shm = ""
    replicas = math.ceil(workers / workers_per_pod)
    return {
        "groupName": "workers",
        "replicas": replicas,
        "minReplicas": math.ceil(min_workers / workers_per_pod),
        "maxReplicas": replicas,
        "rayStartParams": start,
        "_resources": {"requests": requests, "limits": limits},
        "_shm": shm,
    }


def usage_stats_env() -> list[dict]:
    """The renderer's RAY_USAGE_STATS_ENABLED (CI sets 0), carried into every Ray container:
    the head's dashboard is what reports usage."""
    value = os.environ.get("RAY_USAGE_STATS_ENABLED")
    return [{"name": "RAY_USAGE_STATS_ENABLED", "value": value}] if value is not None else []


def ray_container(name: str, image: str, resources: dict, mounts: list[dict]) -> dict:
    container = {"name": name, "image": image, "resources": resources, "volumeMounts": mounts}
    if env := usage_stats_env():
        container["env"] = env
    return container


def storage_volume(name: str, storage: str) -> list[dict]:
    """The ``runs`` volume for ``storage`` (none for an object store)."""
    if storage == "kind":
        return [{"name": "runs", "hostPath": {"path": KIND_RUNS_DIR, "type": "Directory"}}]
    if storage == "pvc":
        return [{"name": "runs", "persistentVolumeClaim": {"claimName": f"{name}-runs"}}]
    return []


def runtime_env(spec, image: str) -> dict:
    env = spec.runtime_env(APP_DIR)
    # A ConfigMap mount holds its files under hidden ..data/ dirs as well: upload them once.
    env["excludes"].append("..*")
    if not image:  # the stock image has Ray only; CPU torch keeps the pods small
        env["pip"] = {
            "packages": pinned_requirements(),
            "pip_install_options": ["--extra-index-url", "https://download.pytorch.org/whl/cpu"],
        }
    return env


def deadline_s(spec, profile: str) -> int:
    """activeDeadlineSeconds: job.yaml's timeout for the profile it runs, a smoke-sized one
    for a smoke run (a hung kind run should not hold CI for hours)."""
    if profile == spec.profile:
        return spec.config.timeout_s
    return min(SMOKE_DEADLINE_S, spec.config.timeout_s)


def resolve_storage(storage: str, gpu: bool) -> str:
    storage = storage or ("pvc" if gpu else "kind")
    if storage not in STORAGE_KINDS and "://" not in storage:
        raise KubeRayError(
            f"storage '{storage}' is neither kind, pvc nor an object-store URI such as "
            "s3://bucket/runs."
        )
    return storage


def render(
    job: str, profile: str = "smoke", image: str = "", storage: str = "", storage_class: str = ""
) -> list[dict]:
    """The manifests for one job: the code ConfigMap, the run PVC (``pvc`` storage), the RayJob."""
    spec = load(job)
    name = resource_name(job)
    settings = spec.settings(profile)
    gpu = settings["use_gpu"]
    if gpu and not image:
        raise KubeRayError(
            f"PROFILE={profile} of {job} trains on GPUs and needs the job's CUDA image: build "
            f"jobs/{job}/Containerfile and pass it as IMAGE= (make kind-image JOB={job}, then "
            f"IMAGE=train-{job}:dev)."
        )
    storage = resolve_storage(storage, gpu)
    storage_path = storage if "://" in storage else RUNS_DIR
    # Fixed in the manifest, so a retry (backoffLimit) of this RayJob resumes its checkpoints;
    # new per render, so the next `make run-kuberay` trains afresh on the same storage.
    run_name = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = [f"storage_path={storage_path}", f"run_name={run_name}"]
    pod_image = image or STOCK_IMAGE
    configmap, items = code_configmap(job, name)
    code_volume = {"name": "code", "configMap": {"name": f"{name}-code", "items": items}}
    runs_volumes = storage_volume(name, storage)
    volumes = [code_volume, *runs_volumes]
    code_mount = {"name": "code", "mountPath": APP_DIR}
    mounts = [code_mount] + [{"name": "runs", "mountPath": RUNS_DIR} for _ in runs_volumes]
    workers = worker_group(settings, spec)
    worker_resources, shm = workers.pop("_resources"), workers.pop("_shm")
    worker_volumes, worker_mounts = list(volumes), list(mounts)
    if shm:
        worker_volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}})
        worker_mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    head = ray_container(
        "ray-head", pod_image,
        {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}, mounts,
    )  # fmt: skip
    rayjob = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": name}},
        "spec": {
            "submissionMode": "K8sJobMode",
            "entrypoint": shlex.join(spec.entrypoint(profile, overrides)),
            "runtimeEnvYAML": yaml.safe_dump(runtime_env(spec, image), sort_keys=False),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,  # time to read the logs before the cluster goes
            "activeDeadlineSeconds": deadline_s(spec, profile),
            "backoffLimit": spec.config.max_retries,
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "authOptions": {"mode": "token"},  # Ray 2.60's default, made explicit
                "headGroupSpec": {
                    # The head runs no training, as on Anyscale (compute configs: CPU: 0).
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": {"spec": {
                        "containers": [head],
                        "volumes": volumes,
                    }},
                },
                "workerGroupSpecs": [{
                    **workers,
                    "template": {"spec": {
                        "containers": [ray_container("ray-worker", pod_image, worker_resources,
                                                     worker_mounts)],
                        "volumes": worker_volumes,
                    }},
                }],
            },
            # The submitter needs the code too: `ray job submit` uploads working_dir from it.
            "submitterPodTemplate": {"spec": {
                "restartPolicy": "Never",
                "containers": [ray_container(
                    "ray-job-submitter", pod_image,
                    {"requests": {"cpu": "200m", "memory": "512Mi"}}, [code_mount],
                )],
                "volumes": [code_volume],
            }},
        },
    }  # fmt: skip
    manifests = [configmap]
    if storage == "pvc":
        manifests.append(runs_pvc(name, storage_class))
    manifests.append(rayjob)
    for manifest in manifests:
        validate(manifest)
    return manifests


def by_kind(manifests: list[dict]) -> dict[str, dict]:
    return {manifest["kind"]: manifest for manifest in manifests}


class _ManifestDumper(yaml.SafeDumper):
    """Multi-line strings (runtimeEnvYAML, the code) as readable ``|`` blocks; plain YAML
    without anchors/aliases (``&id001``) even where the renderer shares a dict."""

    def ignore_aliases(self, data) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, text: str):
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_ManifestDumper.add_representer(str, _represent_str)


def dump(manifest: dict) -> str:
    return yaml.dump(manifest, Dumper=_ManifestDumper, sort_keys=False, width=100)


MANIFEST_FILES = {
    "ConfigMap": "code-configmap.yaml",
    "PersistentVolumeClaim": "runs-pvc.yaml",
    "RayJob": "rayjob.yaml",
}


def write(job: str, manifests: list[dict]) -> list[Path]:
    out = REPO / "build" / job
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for manifest in manifests:
        path = out / MANIFEST_FILES[manifest["kind"]]
        path.write_text(dump(manifest))
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------
# validation


def crd_path() -> Path:
    directory = Path(os.environ.get(CRD_ENV) or VENDORED_CRD_DIR)
    path = directory / "ray.io_rayjobs.yaml"
    if not path.exists():
        raise KubeRayError(
            f"KubeRay CRD not found at {path}; run `make kuberay-crds` or set {CRD_ENV}."
        )
    return path


def rayjob_schema(path: Path | None = None) -> dict:
    """The CRD's ``v1`` openAPIV3Schema, made strict like ``kubectl --validate=strict``."""
    crd = yaml.safe_load((path or crd_path()).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(version["schema"]["openAPIV3Schema"])


def _strict(schema: dict) -> dict:
    """Reject unknown fields wherever the schema lists the known ones."""
    if isinstance(schema, dict):
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        for value in schema.values():
            if isinstance(value, dict):
                _strict(value)
            elif isinstance(value, list):
                for item in value:
                    _strict(item)
    return schema


def apply_defaults(instance, schema: dict):
    """Fill in the schema's defaults the way the API server does before validating."""
    if isinstance(instance, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in instance and "default" in sub:
                instance[key] = sub["default"]
            if key in instance:
                apply_defaults(instance[key], sub)
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for item in instance:
            apply_defaults(item, schema["items"])
    return instance


def validate(manifest: dict, schema: dict | None = None) -> None:
    """Raise KubeRayError for the first problem the API server or the operator would report."""
    if manifest.get("kind") == "ConfigMap":
        _validate_configmap(manifest)
        return
    if manifest.get("kind") == "PersistentVolumeClaim":
        _validate_pvc(manifest)
        return
    import copy

    import jsonschema

    schema = schema or _cached_schema()
    instance = apply_defaults(copy.deepcopy(manifest), schema)
    errors = sorted(
        jsonschema.Draft4Validator(schema).iter_errors(instance), key=lambda e: list(e.path)
    )
    if errors:
        where = ".".join(str(p) for p in errors[0].absolute_path) or "<root>"
        raise KubeRayError(f"RayJob {where}: {errors[0].message}")
    _validate_operator_rules(instance)
    _validate_pods(instance)


def _pod_specs(rayjob: dict) -> list[dict]:
    cluster = rayjob["spec"].get("rayClusterSpec") or {}
    pods = [cluster.get("headGroupSpec", {}).get("template", {}).get("spec", {})]
    pods += [g.get("template", {}).get("spec", {}) for g in cluster.get("workerGroupSpecs", [])]
    pods.append(rayjob["spec"].get("submitterPodTemplate", {}).get("spec", {}))
    return pods


def _validate_pods(rayjob: dict) -> None:
    """What would start but cannot train: GPUs on a CPU image, GPU pods without a large
    /dev/shm or with requests below limits, node-local storage for pods on several nodes."""
    for pod in _pod_specs(rayjob):
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in pod.get("containers", []):
            resources = container.get("resources", {})
            gpus = resources.get("limits", {}).get("nvidia.com/gpu")
            if not gpus:
                continue
            image = container["image"]
            if image.endswith("-cpu") or image == STOCK_IMAGE:
                raise KubeRayError(
                    f"container '{container['name']}' requests GPUs but runs {image}, a CPU "
                    "image; pass IMAGE= with the job's CUDA image."
                )
            if resources.get("requests") != resources.get("limits"):
                raise KubeRayError(f"container '{container['name']}': GPU pods need requests "
                                   "equal to limits.")  # fmt: skip
            shm = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
            if not shm or volumes.get(shm[0]["name"], {}).get("emptyDir", {}).get("medium") != (
                "Memory"
            ):
                raise KubeRayError(
                    f"container '{container['name']}' uses GPUs without a memory-backed "
                    "/dev/shm volume (NCCL needs more than the default 64 MB)."
                )
            if any("hostPath" in v for v in volumes.values()):
                raise KubeRayError(
                    "GPU pods store runs on a hostPath, which other nodes do not see; use "
                    "a ReadWriteMany PVC or an object store."
                )


def _validate_pvc(pvc: dict) -> None:
    if "ReadWriteMany" not in pvc["spec"].get("accessModes", []):
        raise KubeRayError(
            f"PersistentVolumeClaim {pvc['metadata']['name']} must be ReadWriteMany: pods on "
            "several nodes write the same run directory."
        )


_SCHEMA: dict | None = None


def _cached_schema() -> dict:
    global _SCHEMA
    if _SCHEMA is None:
        _SCHEMA = rayjob_schema()
    return _SCHEMA


def _validate_operator_rules(rayjob: dict) -> None:
    """The checks KubeRay's webhook/controller (ray-operator/pkg/utils/validation.go) applies
    on top of the schema."""
    spec = rayjob["spec"]
    if spec["submissionMode"] not in SUBMISSION_MODES:
        raise KubeRayError(
            f"submissionMode must be one of {', '.join(SUBMISSION_MODES)} "
            f"(got '{spec['submissionMode']}')."
        )
    if not spec.get("shutdownAfterJobFinishes"):
        if spec.get("suspend"):
            raise KubeRayError("a RayJob with shutdownAfterJobFinishes=false cannot be suspended.")
        if spec.get("ttlSecondsAfterFinished", 0) > 0:
            raise KubeRayError("ttlSecondsAfterFinished needs shutdownAfterJobFinishes=true.")
    for field in ("ttlSecondsAfterFinished", "backoffLimit"):
        if spec.get(field, 0) < 0:
            raise KubeRayError(f"{field} must be >= 0 (got {spec[field]}).")
    if spec.get("activeDeadlineSeconds") is not None and spec["activeDeadlineSeconds"] <= 0:
        raise KubeRayError("activeDeadlineSeconds must be > 0.")
    if spec["submissionMode"] == "K8sJobMode" and not spec.get("entrypoint"):
        raise KubeRayError("a K8sJobMode RayJob needs an entrypoint.")
    if "rayClusterSpec" not in spec and not spec.get("clusterSelector"):
        raise KubeRayError("a RayJob needs rayClusterSpec or clusterSelector.")
    if spec.get("runtimeEnvYAML"):
        try:
            env = yaml.safe_load(spec["runtimeEnvYAML"])
        except yaml.YAMLError as err:
            raise KubeRayError(f"runtimeEnvYAML does not parse: {err}.") from None
        if not isinstance(env, dict):
            raise KubeRayError("runtimeEnvYAML must be a mapping.")
    cluster = spec.get("rayClusterSpec") or {}
    head = cluster.get("headGroupSpec", {})
    if not head.get("template", {}).get("spec", {}).get("containers"):
        raise KubeRayError("headGroupSpec.template needs at least one container.")
    names = set()
    for group in cluster.get("workerGroupSpecs", []):
        name = group["groupName"]
        if name in names:
            raise KubeRayError(f"worker group name '{name}' is used twice.")
        names.add(name)
        low, high, replicas = group["minReplicas"], group["maxReplicas"], group["replicas"]
        if not low <= high:
            raise KubeRayError(f"worker group '{name}': minReplicas {low} > maxReplicas {high}.")
        if not low <= replicas <= high:
            raise KubeRayError(
                f"worker group '{name}': replicas {replicas} is outside [{low}, {high}]."
            )


def _validate_configmap(configmap: dict) -> None:
    size = sum(len(k) + len(v.encode()) for k, v in configmap["data"].items())
    if size > CONFIGMAP_LIMIT:
        raise KubeRayError(f"ConfigMap is {size} bytes, over the 1 MiB limit.")
    for key in configmap["data"]:
        if not CONFIGMAP_KEY.match(key):
            raise KubeRayError(f"ConfigMap key '{key}' has characters Kubernetes refuses.")


# ------------------------------------------------------------------------------------------
# running (kubectl against the current context: kind in CI)


def kubectl(*args: str, capture: bool = False) -> str:
    proc = subprocess.run(["kubectl", *args], text=True, capture_output=capture)
    if proc.returncode != 0:
        detail = (proc.stderr or "").strip().splitlines()[-1:] if capture else []
        raise SystemExit(f"error: kubectl {' '.join(args[:2])} failed {' '.join(detail)}".strip())
    return proc.stdout if capture else ""


def finished(deployment_status: str) -> bool:
    return deployment_status in TERMINAL_DEPLOYMENT_STATUSES


def run(job: str, paths: list[Path], timeout_s: float) -> int:
    """Apply, wait for the job to finish, print the submitter's logs; 0 only if SUCCEEDED."""
    name = resource_name(job)
    subprocess.run(["kubectl", "delete", "rayjob", name, "--ignore-not-found", "--wait"])
    for path in paths:
        kubectl("apply", "-f", str(path))
    deadline = time.time() + timeout_s
    deployment = ""
    while time.time() < deadline:
        deployment = kubectl("get", "rayjob", name, "-o",
                             "jsonpath={.status.jobDeploymentStatus}", capture=True)  # fmt: skip
        if finished(deployment):
            break
        time.sleep(10)
    status = kubectl("get", "rayjob", name, "-o", "jsonpath={.status.jobStatus}", capture=True)
    subprocess.run(["kubectl", "logs", f"job/{name}", "--all-containers", "--tail=-1"])
    print(f"RayJob {name}: deployment {deployment or 'unknown'}, job {status or 'unknown'}")
    if not finished(deployment):
        print(f"RayJob {name} did not finish within {timeout_s:.0f} s.", file=sys.stderr)
    if status != "SUCCEEDED":
        kubectl("describe", "rayjob", name)
        return 1
    return 0


def fetch_crds() -> None:
    """Download the pinned CRD (for a new KubeRay version: bump KUBERAY_VERSION first)."""
    import urllib.request

    target = Path(os.environ.get(CRD_ENV) or VENDORED_CRD_DIR) / "ray.io_rayjobs.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    with urllib.request.urlopen(CRD_URL, timeout=60) as response:
        target.write_bytes(response.read())
    print(f"KubeRay v{KUBERAY_VERSION} RayJob CRD -> {target}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render/validate/run a job as a KubeRay RayJob.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("render", "run"):
        p = sub.add_parser(command)
        p.add_argument("--job", required=True)
        p.add_argument("--profile", default="smoke")
        p.add_argument("--image", default="", help="CPU default: stock Ray image + runtime pip")
        p.add_argument("--storage", default="", help="kind, pvc or s3://... (default: by profile)")
        p.add_argument("--storage-class", default="", help="RWX StorageClass for --storage pvc")
        if command == "run":
            p.add_argument("--timeout", type=float, default=0,
                           help="default: the RayJob's activeDeadlineSeconds + 5 min")  # fmt: skip
    check = sub.add_parser("validate")
    check.add_argument("files", nargs="+")
    sub.add_parser("fetch-crds")
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch-crds":
            fetch_crds()
            return 0
        if args.command == "validate":
            for file in args.files:
                for manifest in yaml.safe_load_all(Path(file).read_text()):
                    validate(manifest)
                print(f"{file}: valid")
            return 0
        manifests = render(args.job, args.profile, args.image, args.storage, args.storage_class)
        paths = write(args.job, manifests)
        for path in paths:
            print(f"wrote {path.relative_to(REPO)}")
        if args.command != "run":
            return 0
        timeout = (
            args.timeout
            or by_kind(manifests)["RayJob"]["spec"]["activeDeadlineSeconds"] + RUN_GRACE_S
        )
        return run(args.job, paths, timeout)
    except (KubeRayError, JobSpecError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
