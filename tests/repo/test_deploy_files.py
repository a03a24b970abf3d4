"""deploy/: one study across hosts on Kubernetes (a KubeRay RayJob, an Indexed Job of workers) and on Slurm (a job
array), checked offline.

Built-in kinds are validated with kubernetes-validate's strict schemas (unknown fields refused, as `kubectl apply`
refuses them); the RayJob, a custom resource it does not know, against the openAPIV3Schema of KubeRay's RayJob CRD
vendored in deploy/kubernetes/schemas/, made strict the same way. Every command goes through the optimizer's own
flag parser after the substitutions that happen before it runs: Kubernetes' $(VAR) in a container's args; for the
RayJob, KubeRay's submitter bash (which lacks the Secret's variables) and then the head's shell (which has them); for
Slurm, the script itself, run by bash with a stub in place of `optimize`.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.conftest import REPO

KUBE = REPO / "deploy" / "kubernetes"
RAYJOB = KUBE / "rayjob.yaml"
WORKERS = KUBE / "workers-job.yaml"
RAYJOB_SCHEMA = KUBE / "schemas" / "ray.io_rayjobs_v1.json"
SBATCH = REPO / "deploy" / "slurm" / "optimize-array.sbatch"
KUBERNETES_VERSION = "1.37"  # the newest Kubernetes kubernetes-validate 1.37 ships schemas of
GPU = "nvidia.com/gpu"


# ---------------------------------------------------------------------------------------------- helpers


def documents(path: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, f"{path}: no YAML document"
    return docs


def the(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def parse(argv: list[str]):
    """The optimizer's own parser and validation of the flags; a refusal fails the test with argparse's message."""
    from optimizer.cli.run import build_parser, explicit_settings

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"optimize refuses {shlex.join(argv)}:\n{err.getvalue()}")
    return ns, explicit_settings(ns)


def container_env(container: dict, docs: list[dict]) -> dict[str, str]:
    """The container's environment, each secretKeyRef resolved from a Secret of the same file."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        ref = var["valueFrom"]["secretKeyRef"]
        secrets = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == ref["name"]]
        assert secrets, f"{var['name']}: no Secret {ref['name']!r} in the file"
        data = secrets[0].get("stringData", {})
        assert ref["key"] in data, f"{var['name']}: Secret {ref['name']!r} has no key {ref['key']!r}"
        env[var["name"]] = data[ref["key"]]
    return env


def gpu_request(container: dict) -> int:
    res = container["resources"]
    assert str(res["limits"][GPU]) == str(res["requests"].get(GPU, res["limits"][GPU])), \
        "an extended resource's request must equal its limit"
    return int(res["limits"][GPU])


def mounted_from(pod: dict, container: dict, path: str) -> dict:
    """The pod volume whose mount holds `path` in the container (the volume's own definition)."""
    mounts = [m for m in container.get("volumeMounts", []) if (path + "/").startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{path} is on no volume of container {container['name']}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volume = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert len(volume) == 1, f"volume {mount['name']} is not defined"
    return {**volume[0], "readOnly": mount.get("readOnly", False), "mountPath": mount["mountPath"]}


def strict(schema):
    """A CRD schema that refuses unknown fields, as the API server's strict field validation does: every object
    that lists its properties and neither sets additionalProperties nor keeps unknown fields."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: strict(sub) for name, sub in value.items()}
        else:
            out[key] = strict(value)
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def rayjob_validator() -> jsonschema.Validator:
    schema = json.loads(RAYJOB_SCHEMA.read_text())
    return jsonschema.Draft7Validator(strict(schema))


def largest_layout(space_yaml: str) -> int:
    """GPUs of the largest layout a --space file allows: tensor x pipeline x data parallel at their largest."""
    from optimizer.params.parallel import LAYOUT_ARGS
    from optimizer.params.space import parse_space_yaml

    spec = parse_space_yaml(yaml.safe_load(space_yaml))
    total = 1
    for name in LAYOUT_ARGS:
        if name in spec.fixed:
            total *= int(spec.fixed[name])
        elif name in spec.ranges:
            dist = spec.ranges[name]
            total *= int(max(dist.choices) if hasattr(dist, "choices") else dist.high)
    return total


def gpus_named(spec: str, host_gpus: int) -> int:
    from optimizer.hardware.gpu_pool import parse_gpus

    return len(parse_gpus(spec, host_gpus))


# ---------------------------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("path", [RAYJOB, WORKERS], ids=lambda p: p.name)
def test_built_in_kinds_validate_strictly(path):
    for doc in documents(path):
        if doc["apiVersion"].startswith("ray.io/"):
            continue
        # raises ValidationError, or SchemaNotFoundError for a kind or apiVersion Kubernetes does not have
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_rayjob_validates_against_kuberays_crd():
    assert json.loads(RAYJOB_SCHEMA.read_text())["$comment"].startswith("KubeRay v1.7.0 ")
    rayjob = the(documents(RAYJOB), "RayJob")
    assert rayjob["apiVersion"] == "ray.io/v1"
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in rayjob_validator().iter_errors(rayjob)]
    assert not errors, "\n".join(errors)


def test_the_validations_refuse_what_kubectl_would():
    """The checks above have teeth: a misspelled field and a wrong type fail them."""
    job = the(documents(WORKERS), "Job")
    bad = copy.deepcopy(job)
    bad["spec"]["completionMod"] = bad["spec"].pop("completionMode")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    bad = copy.deepcopy(job)
    bad["spec"]["template"]["spec"]["containers"][0]["args"].append(80)  # args are strings
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)

    rayjob = the(documents(RAYJOB), "RayJob")
    validator = rayjob_validator()
    for path, change in ((("spec",), lambda s: s.update(shutdownAfterJobFinish=True)),
                         (("spec", "rayClusterSpec", "workerGroupSpecs", 0), lambda g: g.pop("groupName")),
                         (("spec", "rayClusterSpec", "workerGroupSpecs", 0, "template", "spec", "containers", 0,
                           "resources", "limits"), lambda r: r.update({GPU: [8]}))):
        bad = copy.deepcopy(rayjob)
        node = bad
        for key in path:
            node = node[key]
        change(node)
        assert list(validator.iter_errors(bad)), f"not refused: a change at {'.'.join(map(str, path))}"


def test_both_manifests_define_the_same_database_secret():
    secrets = [the(documents(path), "Secret") for path in (RAYJOB, WORKERS)]
    assert secrets[0] == secrets[1], "applying one file must not change the other's Secret"


def test_storage_is_postgresql_with_the_password_from_pgpassword():
    from sqlalchemy.engine import make_url

    secret = the(documents(WORKERS), "Secret")
    url = make_url(secret["stringData"]["url"])
    assert url.get_backend_name() == "postgresql" and url.get_driver_name() == "psycopg2", url
    assert url.password is None, "the password goes to PGPASSWORD (libpq), never into the URL"
    assert url.database and url.username and url.port == 5432


# ---------------------------------------------------------------------------------------------- the RayJob


def rayjob_parts() -> tuple[list[dict], dict, dict, dict, dict, dict]:
    docs = documents(RAYJOB)
    cluster = the(docs, "RayJob")["spec"]["rayClusterSpec"]
    head_pod = cluster["headGroupSpec"]["template"]["spec"]
    groups = cluster["workerGroupSpecs"]
    assert len(groups) == 1, "one worker group: the study's trials are compared across its nodes"
    worker_pod = groups[0]["template"]["spec"]
    return docs, head_pod, head_pod["containers"][0], groups[0], worker_pod, worker_pod["containers"][0]


def entrypoint_argv(entrypoint: str, head_env: dict[str, str]) -> list[str]:
    """What `optimize` receives from a RayJob's entrypoint. KubeRay's submitter pod splices it into
    `bash -ce -- "... ray job submit ... -- ENTRYPOINT ; ..."` (ray-operator/controllers/ray/common/job.go), without
    the head's environment; `ray job submit` joins the words it gets with subprocess.list2cmdline; the head's job
    supervisor runs that with /bin/sh (shell=True) in the head container's environment."""
    base = {"PATH": os.environ["PATH"], "LC_ALL": "C"}
    words = subprocess.run(["/bin/bash", "-ce", "--", f"printf '%s\\0' {entrypoint}"], env=base,
                           capture_output=True, text=True, timeout=30, check=True).stdout.split("\0")[:-1]
    command = subprocess.list2cmdline(words)
    out = subprocess.run(["/bin/sh", "-c", "optimize() { printf '%s\\0' \"$@\"; }; " + command],
                         env={**base, **head_env}, capture_output=True, text=True, timeout=30, check=True)
    argv = out.stdout.split("\0")[:-1]
    assert words[0] == "optimize", f"the entrypoint must run optimize, not {words[0]!r}"
    return argv


def test_rayjob_runs_one_study_and_deletes_its_cluster():
    rayjob = the(documents(RAYJOB), "RayJob")["spec"]
    assert rayjob["shutdownAfterJobFinishes"] is True
    # the quoting of '$OPTIMIZER_STORAGE' is for the submitter's bash: HTTPMode would send it to the head as it is
    assert rayjob["submissionMode"] == "K8sJobMode"
    assert "\n" not in rayjob["entrypoint"], "the submitter's bash would run a second line on its own"


def test_rayjob_entrypoint_is_the_optimizers_own_flags(tmp_path):
    docs, head_pod, head, _, worker_pod, worker = rayjob_parts()
    env = container_env(head, docs)
    argv = entrypoint_argv(the(docs, "RayJob")["spec"]["entrypoint"], env)
    assert "$" not in shlex.join(argv), f"a variable left unexpanded: {argv}"

    # --space names a file the head mounts from a ConfigMap; parse it from there
    space_path = argv[argv.index("--space") + 1]
    volume = mounted_from(head_pod, head, space_path)
    config_map = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"]]
    assert config_map, f"--space {space_path}: no ConfigMap {volume['configMap']['name']} in the file"
    space_text = config_map[0]["data"][os.path.relpath(space_path, volume["mountPath"])]
    (tmp_path / "space.yaml").write_text(space_text)
    argv[argv.index("--space") + 1] = str(tmp_path / "space.yaml")

    ns, settings = parse(argv)  # needs the --ray flag in optimizer/cli/run.py
    assert ns.ray == "auto", "join the cluster KubeRay started on this head"
    assert ns.storage == the(docs, "Secret")["stringData"]["url"], "the storage URL comes from the Secret"
    assert settings["device"] == "cuda" and settings["budget"] >= 1 and settings["limits"]["items"]
    assert ns.gpus is None, "under --ray the cluster's GPUs are the pool"
    assert settings.get("num_requests_auto") is False, "auto runs a pilot trial on the head, which has no GPU"
    assert ns.studies_dir.startswith("/")

    # the model is on the same read-only volume on the head (which plans) and on the workers (which run trials)
    on_head, on_worker = mounted_from(head_pod, head, ns.model), mounted_from(worker_pod, worker, ns.model)
    assert on_head["readOnly"] and on_worker["readOnly"]
    assert on_head["persistentVolumeClaim"]["claimName"] == on_worker["persistentVolumeClaim"]["claimName"]
    assert on_head["mountPath"] == on_worker["mountPath"]


def test_rayjob_gpus_head_has_none_workers_fit_the_largest_layout():
    docs, _, head, group, _, worker = rayjob_parts()
    head_resources = {**head["resources"].get("requests", {}), **head["resources"].get("limits", {})}
    assert GPU not in head_resources, "the head runs no trial: no GPU for it"
    assert the(docs, "RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"].get("num-gpus", "0") == "0"

    gpus = gpu_request(worker)
    assert gpus == 8
    assert group["rayStartParams"].get("num-gpus", str(gpus)) == str(gpus), "Ray must see the pod's GPUs"
    # a trial is one task on one node: the largest layout the space allows takes one whole worker pod
    assert largest_layout(the(docs, "ConfigMap")["data"]["space.yaml"]) == gpus
    # each task asks for a core per GPU (search/raycluster.py)
    assert float(worker["resources"]["limits"]["cpu"]) >= gpus
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"] and group["replicas"] >= 1


def test_rayjob_every_node_reaches_the_database():
    docs, _, head, _, _, worker = rayjob_parts()
    secret = the(docs, "Secret")["stringData"]
    for container in (head, worker):
        assert container_env(container, docs)["PGPASSWORD"] == secret["password"], container["name"]


def test_one_image_everywhere_and_pinned():
    _, _, head, _, _, worker = rayjob_parts()
    job = the(documents(WORKERS), "Job")["spec"]["template"]["spec"]["containers"][0]
    images = {head["image"], worker["image"], job["image"]}
    assert len(images) == 1, images
    image = images.pop()
    assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"pin a tag: {image}"


# ---------------------------------------------------------------------------------------------- the workers Job


def test_workers_job_is_indexed_and_runs_its_workers_at_once():
    spec = the(documents(WORKERS), "Job")["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] >= 2, "every worker runs at once"
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never", "a podFailurePolicy needs restartPolicy Never"
    names = {c["name"] for c in pod["containers"]}
    rules = spec["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert fail and fail[0]["onExitCodes"]["values"] == [2] and fail[0]["onExitCodes"]["containerName"] in names, \
        "exit 2 (a refused flag or study) fails the Job at once"
    assert pod["terminationGracePeriodSeconds"] >= 60, "SIGTERM: the running engine needs time to shut down"


def test_workers_job_command_is_the_optimizers_own_flags():
    docs = documents(WORKERS)
    pod = the(docs, "Job")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["optimize"]
    env = container_env(container, docs)
    assert env["PGPASSWORD"] == the(docs, "Secret")["stringData"]["password"]

    def kubernetes_expand(arg: str) -> str:  # $(VAR) from the container's env; a $$( escape is not used here
        assert "$$(" not in arg
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], arg)

    ns, settings = parse([kubernetes_expand(a) for a in container["args"]])
    assert ns.storage == the(docs, "Secret")["stringData"]["url"]
    assert settings["device"] == "cuda" and settings["budget"] >= 1 and settings["limits"]["items"]
    # the GPUs the command takes are the GPUs the pod asks for
    gpus = gpu_request(container)
    assert gpus_named(ns.gpus, gpus) == gpus
    assert float(container["resources"]["limits"]["cpu"]) >= gpus
    model = mounted_from(pod, container, ns.model)
    assert model["readOnly"] and "persistentVolumeClaim" in model
    mounted_from(pod, container, ns.studies_dir)
    assert mounted_from(pod, container, "/dev/shm")["emptyDir"]["medium"] == "Memory"


# ---------------------------------------------------------------------------------------------- Slurm


def sbatch_options() -> dict[str, str]:
    out = {}
    for line in SBATCH.read_text().splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.split(None, 1)[1].partition("=")
            out[key] = value
    return out


def test_sbatch_is_valid_bash():
    out = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert SBATCH.read_text().startswith("#!/bin/bash\n")


def test_sbatch_directives_come_before_any_command():
    """sbatch reads #SBATCH lines only up to the first command."""
    lines = SBATCH.read_text().splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert all(not line.strip() or line.startswith("#") for line in lines[1:last]), "a command above an #SBATCH line"


def run_sbatch(tmp_path: Path, task: int, **env: str) -> tuple[list[str], int, int]:
    """The script run as Slurm would run array task `task`, with a stub for optimize: its argv, its PID and the
    PID of the script's shell."""
    stub = tmp_path / "optimize"
    stub.write_text("#!/bin/bash\necho $$ > \"$STUB_OUT.pid\"\nprintf '%s\\0' \"$@\" > \"$STUB_OUT\"\n")
    stub.chmod(0o755)
    out = tmp_path / f"argv-{task}"
    proc = subprocess.Popen(["bash", str(SBATCH)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "OPTIMIZE": str(stub),
                                            "STUB_OUT": str(out), "SLURM_ARRAY_TASK_ID": str(task),
                                            "SLURM_ARRAY_JOB_ID": "4242", **env})
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    return out.read_text().split("\0")[:-1], int(Path(f"{out}.pid").read_text()), proc.pid


def test_sbatch_workers_share_one_study_and_take_the_nodes_gpus(tmp_path):
    options = sbatch_options()
    first, _, last = options["--array"].partition("-")
    assert int(last) > int(first), "an array of several workers"
    gres = re.fullmatch(r"gpu(?::[\w-]+)?:(\d+)", options["--gres"])
    assert gres, options["--gres"]
    gpus = int(gres.group(1))

    argvs = []
    for task in (int(first), int(last)):
        argv, stub_pid, shell_pid = run_sbatch(tmp_path, task)
        assert stub_pid == shell_pid, "exec optimize: the signal sbatch sends the batch shell must reach it"
        ns, settings = parse(argv)
        assert gpus_named(ns.gpus, gpus) == gpus, "the worker takes the GPUs the task asks Slurm for"
        assert ns.storage.startswith("postgresql"), "every node reaches the study: PostgreSQL"
        assert settings["device"] == "cuda" and settings["limits"]["items"]
        assert Path(ns.studies_dir).is_dir() and ns.studies_dir.endswith(f"task-{task}"), \
            "each task's own log folder: slot-K.log of two hosts must not collide on a shared filesystem"
        without_dir = list(argv)
        del without_dir[argv.index("--studies-dir"):argv.index("--studies-dir") + 2]
        argvs.append(without_dir)
    assert argvs[0] == argvs[1], "every array task must run the same study with the same flags"

    signal = re.fullmatch(r"B:(INT|TERM)@(\d+)", options["--signal"])
    assert signal and int(signal.group(2)) >= 120, "the batch shell is signalled early enough to stop the engine"


def test_sbatch_takes_its_settings_from_the_environment(tmp_path):
    url = "postgresql+psycopg2://me@db.internal:5432/studies"
    argv, _, _ = run_sbatch(tmp_path, 0, OPTIMIZER_STORAGE=url, STUDY="other", BUDGET="12")
    ns, settings = parse(argv)
    assert (ns.storage, ns.study, settings["budget"]) == (url, "other", 12)


# ---------------------------------------------------------------------------------------------- docs


def test_docs_say_how_to_use_each_file():
    text = (REPO / "docs" / "many-gpus.md").read_text()
    assert "\n## Kubernetes and Slurm\n" in text
    section = text.split("\n## Kubernetes and Slurm\n", 1)[1]
    for path in (RAYJOB, WORKERS, SBATCH):
        assert str(path.relative_to(REPO)) in section, path
    assert "kubectl apply -f deploy/kubernetes/" in section and "sbatch deploy/slurm/" in section
