"""Rendered RayJobs: derived from job.yaml, and valid for KubeRay v1.7.0 - the CRD's v1 schema
with defaults applied and unknown fields rejected (``kubectl --validate=strict``), plus the
operator's own rules."""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

from ci import jobspec, kuberay

JOBS = jobspec.job_names()


@pytest.fixture(scope="module")
def schema():
    return kuberay.rayjob_schema()


@pytest.fixture(scope="module")
def renders() -> dict[str, tuple[dict, dict]]:
    """{job: (ConfigMap, RayJob)}, rendered once per module (each render reads the job's
    resolved config in a subprocess)."""
    return {job: kuberay.render(job) for job in JOBS}


@pytest.fixture(scope="module", params=JOBS)
def rendered(request, renders):
    job = request.param
    configmap, rayjob = renders[job]
    return job, configmap, rayjob


@pytest.fixture(scope="module")
def ddp_rayjob():
    return kuberay.render("ddp")[1]


@pytest.fixture(scope="module")
def tp2d_gpu():
    """tp2d's full profile as `make render-kuberay JOB=tp2d PROFILE=full IMAGE=train-tp2d:dev`."""
    return kuberay.by_kind(kuberay.render("tp2d", profile="full", image="train-tp2d:dev"))


def test_rendered_rayjob_is_valid_for_the_crd(rendered, schema):
    _, configmap, rayjob = rendered
    kuberay.validate(rayjob, schema)
    kuberay.validate(configmap)
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"


def test_rayjob_is_derived_from_job_yaml(rendered):
    job, _, rayjob = rendered
    spec = jobspec.load(job)
    rj = rayjob["spec"]
    assert rj["submissionMode"] == "K8sJobMode" and rj["shutdownAfterJobFinishes"] is True
    assert rj["ttlSecondsAfterFinished"] > 0
    assert rj["backoffLimit"] == spec.config.max_retries
    # A smoke run gets a smoke-sized deadline, not the full profile's hours.
    assert rj["activeDeadlineSeconds"] == min(kuberay.SMOKE_DEADLINE_S, spec.config.timeout_s)
    assert rj["activeDeadlineSeconds"] < 3600
    argv = shlex.split(rj["entrypoint"])
    assert argv[:2] == ["python", f"jobs/{job}/main.py"]
    assert argv[argv.index("--profile") + 1] == "smoke"
    assert f"storage_path={kuberay.RUNS_DIR}" in argv
    env = yaml.safe_load(rj["runtimeEnvYAML"])
    assert env["working_dir"] == kuberay.APP_DIR
    assert env["env_vars"] == spec.config.env_vars
    assert set(spec.config.excludes) <= set(env["excludes"])


def test_runtime_env_passes_rays_own_validation(ddp_rayjob):
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load(ddp_rayjob["spec"]["runtimeEnvYAML"])
    assert env["working_dir"] == kuberay.APP_DIR
    env["working_dir"] = str(REPO)  # Ray checks the directory exists; in the pods it is mounted
    RuntimeEnv(**env)  # raises on a malformed pip/env_vars/excludes entry
    pins = {p.split("==")[0]: p for p in env["pip"]["packages"]}
    assert pins["torch"] == "torch==2.13.0" and "ray" not in pins  # the image brings Ray


def test_worker_group_is_sized_from_the_jobs_scaling_config(rendered):
    job, _, rayjob = rendered
    settings = jobspec.load(job).settings("smoke")
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (group,) = cluster["workerGroupSpecs"]
    per_pod = settings.get("tp", 1)  # CPU: one pod per worker, or per TP group
    assert group["replicas"] * per_pod == settings["num_workers"]
    assert group["minReplicas"] <= group["replicas"] == group["maxReplicas"]
    ray_cpus = int(group["rayStartParams"]["num-cpus"])
    assert ray_cpus >= settings["cpus_per_worker"] * per_pod + kuberay.CPUS_LEFT_FOR_DATA


@pytest.mark.parametrize(("job", "pods", "gpus"), [("ddp", 1, 4), ("tp2d", 2, 4)])
def test_gpu_profiles_get_whole_nodes_of_their_compute_config(job, pods, gpus, schema):
    image = "registry.example.com/train:dev"
    manifests = kuberay.by_kind(kuberay.render(job, profile="full", image=image))
    rayjob = manifests["RayJob"]
    kuberay.validate(rayjob, schema)
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["replicas"] == pods and group["rayStartParams"]["num-gpus"] == str(gpus)
    container = group["template"]["spec"]["containers"][0]
    assert container["image"] == image
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == str(gpus)
    assert resources["requests"] == resources["limits"]  # GPUs are never overcommitted
    node = jobspec.instance_type("g4dn.12xlarge" if job == "ddp" else "g6.12xlarge")
    assert resources["limits"]["memory"] == f"{int(node.ram_gib * 0.8)}Gi"  # 153Gi of 192
    assert "pip" not in yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])  # baked into the image
    assert rayjob["spec"]["activeDeadlineSeconds"] == jobspec.load(job).config.timeout_s


def test_gpu_render_has_shm_a_pvc_and_no_hostpath(tp2d_gpu, schema):
    rayjob, pvc = tp2d_gpu["RayJob"], tp2d_gpu["PersistentVolumeClaim"]
    kuberay.validate(rayjob, schema)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    text = kuberay.dump(rayjob)
    assert "hostPath" not in text
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    pod = group["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "38Gi"}
    assert volumes[mounts[kuberay.RUNS_DIR]]["persistentVolumeClaim"] == {
        "claimName": pvc["metadata"]["name"]
    }
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert {v["name"] for v in head["volumes"]} == {"code", "runs"}
    # The tests run with RAY_USAGE_STATS_ENABLED=0 (conftest): the pods get the same opt-out.
    usage_off = {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}
    assert usage_off in head["containers"][0]["env"]
    assert usage_off in pod["containers"][0]["env"]
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    assert f"storage_path={kuberay.RUNS_DIR}" in argv and "--profile" in argv


def test_gpu_render_with_an_object_store_has_no_runs_volume():
    manifests = kuberay.render("tp2d", "full", "train-tp2d:dev", storage="s3://bucket/runs")
    assert [m["kind"] for m in manifests] == ["ConfigMap", "RayJob"]
    rayjob = manifests[1]
    assert "storage_path=s3://bucket/runs" in shlex.split(rayjob["spec"]["entrypoint"])
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert {v["name"] for v in group["template"]["spec"]["volumes"]} == {"code", "dshm"}
    with pytest.raises(kuberay.KubeRayError, match="neither kind, pvc nor an object-store URI"):
        kuberay.render("ddp", storage="/mnt/runs")


def test_a_gpu_profile_without_image_is_refused_naming_image(capsys):
    assert kuberay.main(["render", "--job", "tp2d", "--profile", "full"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "IMAGE=" in line and "jobs/tp2d/Containerfile" in line
    assert line.count(". ") == 0  # one sentence


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (  # the old render: GPU pods on the stock CPU image
            lambda c: c.update(image=kuberay.STOCK_IMAGE),
            "requests GPUs but runs rayproject/ray:2.60.0-py311-cpu, a CPU image",
        ),
        (lambda c: c.update(volumeMounts=c["volumeMounts"][:-1]), "memory-backed /dev/shm"),
        (lambda c: c["resources"]["requests"].update(cpu="1"), "requests equal to limits"),
    ],
)
def test_broken_gpu_rayjobs_are_rejected(tp2d_gpu, schema, mutate, message):
    rayjob = copy.deepcopy(tp2d_gpu["RayJob"])
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    mutate(group["template"]["spec"]["containers"][0])
    with pytest.raises(kuberay.KubeRayError, match=message):
        kuberay.validate(rayjob, schema)


def test_gpu_pods_on_a_hostpath_and_a_non_rwx_pvc_are_rejected(tp2d_gpu, schema):
    rayjob = copy.deepcopy(tp2d_gpu["RayJob"])
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    volumes = group["template"]["spec"]["volumes"]
    (runs,) = [v for v in volumes if v["name"] == "runs"]
    runs.pop("persistentVolumeClaim")
    runs["hostPath"] = {"path": kuberay.KIND_RUNS_DIR, "type": "Directory"}
    with pytest.raises(kuberay.KubeRayError, match="hostPath, which other nodes do not see"):
        kuberay.validate(rayjob, schema)
    pvc = copy.deepcopy(tp2d_gpu["PersistentVolumeClaim"])
    pvc["spec"]["accessModes"] = ["ReadWriteOnce"]
    with pytest.raises(kuberay.KubeRayError, match="must be ReadWriteMany"):
        kuberay.validate(pvc)


def test_rendered_yaml_is_plain_without_anchors(tp2d_gpu):
    for manifest in tp2d_gpu.values():
        text = kuberay.dump(manifest)
        assert "&id" not in text and "*id" not in text
        assert yaml.safe_load(text) == manifest
    # The renderer does share dicts (the code volume in every pod); a default dump aliases them.
    assert "&id" in yaml.safe_dump(tp2d_gpu["RayJob"])


@pytest.mark.parametrize(
    ("status", "done"),
    [("Complete", True), ("Failed", True), ("ValidationFailed", True), ("Running", False),
     ("Initializing", False), ("Retrying", False), ("", False)],
)  # fmt: skip
def test_run_stops_waiting_on_every_terminal_deployment_status(status, done):
    assert kuberay.finished(status) is done


def test_configmap_carries_only_the_jobs_import_closure(rendered):
    job, configmap, rayjob = rendered
    from ci.template import needed_shared_files

    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (code,) = [v for v in head["volumes"] if "configMap" in v]
    paths = {item["path"] for item in code["configMap"]["items"]}
    expected = {f"jobs/{job}/main.py"}
    expected |= {p.relative_to(REPO).as_posix() for p in needed_shared_files(job)}
    assert paths == expected
    assert not {p for p in paths if not p.endswith(".py")}  # no README, Containerfile
    size = sum(len(k) + len(v.encode()) for k, v in configmap["data"].items())
    # Under half the 1 MiB limit: room for the user's own modules when they copy a job.
    assert size < kuberay.CONFIGMAP_LIMIT / 2
    if job == "env_check":
        assert "shared/loop.py" not in paths  # env_check never imports the training loop


# Runs each job in a directory holding only its ConfigMap's files: the repo's editable install
# is taken off the import path, so a module a ConfigMap lacks cannot come from the checkout.
# One process for all jobs (torch is imported once); the project's modules are forgotten
# between jobs.
ONLY_THE_CONFIGMAP = """
import importlib, json, os, runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "Editable" not in repr(f)]
for job, modules in json.loads(sys.argv[1]).items():
    for name in [n for n in sys.modules if n.split(".")[0] in ("shared", "jobs")]:
        del sys.modules[name]
    os.chdir(job)
    sys.path[0] = os.getcwd()
    importlib.invalidate_caches()
    sys.argv = [f"jobs/{job}/main.py", "--print-config"]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as done:
        assert not done.code, (job, done.code)
    for module in modules:
        assert importlib.import_module(module).__file__.startswith(os.getcwd()), (job, module)
    os.chdir("..")
"""


def test_each_job_starts_from_its_configmap_alone(renders, tmp_path):
    """What the pods mount is enough: the job parses its settings and every shipped module
    imports, from a directory that holds nothing else."""
    shipped = {}
    for job, (configmap, rayjob) in renders.items():
        head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
        (code,) = [v for v in head["volumes"] if "configMap" in v]
        shipped[job] = []
        for item in code["configMap"]["items"]:
            path = tmp_path / job / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(configmap["data"][item["key"]])
            if item["path"].startswith("shared/"):
                module = item["path"].removesuffix(".py").removesuffix("/__init__")
                shipped[job].append(module.replace("/", "."))
    proc = subprocess.run([sys.executable, "-c", ONLY_THE_CONFIGMAP, json.dumps(shipped)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = [json.loads(line)["job"] for line in proc.stdout.splitlines() if line.startswith("{")]
    assert printed == JOBS


def test_code_configmap_maps_back_to_the_repo_files(rendered):
    job, configmap, rayjob = rendered
    volumes = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["volumes"]
    (code,) = [v for v in volumes if "configMap" in v]
    assert code["configMap"]["name"] == configmap["metadata"]["name"]
    items = code["configMap"]["items"]
    assert {i["key"] for i in items} == set(configmap["data"])
    for item in items:
        assert configmap["data"][item["key"]] == (REPO / item["path"]).read_text()
    paths = {i["path"] for i in items}
    assert f"jobs/{job}/main.py" in paths and "shared/__init__.py" in paths
    # The submitter uploads working_dir, so it mounts the code as well as head and workers.
    submitter = rayjob["spec"]["submitterPodTemplate"]["spec"]
    assert any(
        m["mountPath"] == kuberay.APP_DIR for m in submitter["containers"][0]["volumeMounts"]
    )


def test_rendered_files_are_written_and_reload(tmp_path, monkeypatch):
    manifests = kuberay.render("ddp")
    paths = kuberay.write("ddp", manifests)
    assert [p.name for p in paths] == ["code-configmap.yaml", "rayjob.yaml"]
    assert yaml.safe_load(paths[1].read_text()) == manifests[1]
    assert kuberay.main(["validate", str(paths[1]), str(paths[0])]) == 0
    # smoke on kind: the hostPath of the single kind node, no PVC
    volumes = manifests[1]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["volumes"]
    assert {"path": kuberay.KIND_RUNS_DIR, "type": "Directory"} in [
        v.get("hostPath") for v in volumes
    ]


# ------------------------------------------------------------------------------------------
# the validator itself must catch what KubeRay would reject


def test_schema_defaults_are_applied_before_validation(ddp_rayjob, schema):
    manifest = copy.deepcopy(ddp_rayjob)
    del manifest["spec"]["submissionMode"]
    filled = kuberay.apply_defaults(copy.deepcopy(manifest), schema)
    assert filled["spec"]["submissionMode"] == "K8sJobMode"
    kuberay.validate(manifest, schema)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda s: s["rayClusterSpec"]["headGroupSpec"].update(replicas=1),
            "Additional properties",
        ),
        (lambda s: s.update(entrypont="typo"), "Additional properties"),
        (lambda s: s.update(backoffLimit="2"), "is not of type 'integer'"),
        (lambda s: s["rayClusterSpec"]["workerGroupSpecs"][0].pop("groupName"), "required"),
        (lambda s: s.update(submissionMode="BatchMode"), "submissionMode must be one of"),
        (lambda s: s.update(shutdownAfterJobFinishes=False), "needs shutdownAfterJobFinishes"),
        (
            lambda s: s.update(
                shutdownAfterJobFinishes=False, ttlSecondsAfterFinished=0, suspend=True
            ),
            "cannot be suspended",
        ),  # fmt: skip
        (
            lambda s: s["rayClusterSpec"]["workerGroupSpecs"][0].update(minReplicas=5),
            "minReplicas 5 > maxReplicas",
        ),  # fmt: skip
        (lambda s: s["rayClusterSpec"]["workerGroupSpecs"][0].update(replicas=9), "outside"),
        (lambda s: s.update(runtimeEnvYAML="pip: [unclosed"), "does not parse"),
        (lambda s: s.update(runtimeEnvYAML="- a list"), "must be a mapping"),
    ],
)
def test_invalid_rayjobs_are_rejected(ddp_rayjob, schema, mutate, message):
    manifest = copy.deepcopy(ddp_rayjob)
    mutate(manifest["spec"])
    with pytest.raises(kuberay.KubeRayError, match=message):
        kuberay.validate(manifest, schema)


def test_oversized_or_badly_keyed_configmaps_are_rejected():
    with pytest.raises(kuberay.KubeRayError, match="over the 1 MiB limit"):
        kuberay.validate({"kind": "ConfigMap", "data": {"big": "x" * (1024 * 1024 + 1)}})
    with pytest.raises(kuberay.KubeRayError, match="characters Kubernetes refuses"):
        kuberay.validate({"kind": "ConfigMap", "data": {"jobs/ddp/main.py": ""}})


def test_crd_location_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(kuberay.CRD_ENV, str(tmp_path))
    with pytest.raises(kuberay.KubeRayError, match="make kuberay-crds"):
        kuberay.crd_path()
    monkeypatch.delenv(kuberay.CRD_ENV)
    assert kuberay.crd_path() == kuberay.VENDORED_CRD_DIR / "ray.io_rayjobs.yaml"
