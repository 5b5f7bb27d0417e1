"""Rendered RayJobs: derived from job.yaml, and valid for KubeRay v1.7.0 - the CRD's v1 schema
with defaults applied and unknown fields rejected (``kubectl --validate=strict``), plus the
operator's own rules."""

from __future__ import annotations

import copy
import shlex

import pytest
import yaml
from conftest import REPO

from ci import jobspec, kuberay

JOBS = jobspec.job_names()


@pytest.fixture(scope="module")
def schema():
    return kuberay.rayjob_schema()


@pytest.fixture(scope="module", params=JOBS)
def rendered(request):
    job = request.param
    configmap, rayjob = kuberay.render(job)
    return job, configmap, rayjob


@pytest.fixture(scope="module")
def ddp_rayjob():
    return kuberay.render("ddp")[1]


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
    assert rj["activeDeadlineSeconds"] == spec.config.timeout_s
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
    _, rayjob = kuberay.render(job, profile="full", image=image)
    kuberay.validate(rayjob, schema)
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["replicas"] == pods and group["rayStartParams"]["num-gpus"] == str(gpus)
    container = group["template"]["spec"]["containers"][0]
    assert container["image"] == image
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
    assert "pip" not in yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])  # baked into the image


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
    assert f"jobs/{job}/main.py" in paths and "shared/loop.py" in paths
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
