"""deploy/: the Kubernetes manifests validate strictly against the Kubernetes schemas, and their commands
and the Slurm script's run against a real service — with Kubernetes' `$(VAR)` expansion, Slurm's
variables and stand-ins for `srun` and `scontrol` (no cluster here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid

import pytest
import yaml

from ckptstore.client import ServiceClient
from tests.conftest import service_settings
from tests.live import LiveService
from tests.servers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KUBERNETES = os.path.join(ROOT, "deploy", "kubernetes")
SLURM = os.path.join(ROOT, "deploy", "slurm", "train.sbatch")
BIN = os.path.dirname(sys.executable)
NO_SCHEMA = {"Kustomization", "ServiceMonitor"}  # kustomize's and the Prometheus Operator's: no Kubernetes schema
ADMIN, JOB_TOKEN = "admin-" + uuid.uuid4().hex, "job-" + uuid.uuid4().hex


def manifests() -> list[str]:
    return sorted(
        os.path.join(folder, name)
        for folder, _, names in os.walk(KUBERNETES)
        for name in names
        if name.endswith((".yaml", ".yml"))
    )


def documents(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [d for d in yaml.safe_load_all(handle) if d]


def resource(kind: str, name: str) -> dict:
    found = [d for path in manifests() for d in documents(path) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, found)
    return found[0]


@pytest.mark.parametrize("path", manifests(), ids=lambda p: os.path.relpath(p, KUBERNETES))
def test_every_manifest_validates_strictly(path):
    result = subprocess.run(
        [os.path.join(BIN, "kubernetes-validate"), "--strict", "-k", "1.33.0", path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = {d["kind"] for d in documents(path)}
    if kinds <= NO_SCHEMA:
        assert "Couldn't find schema" in result.stdout
    else:
        assert "passed" in result.stdout and "WARN" not in result.stdout, result.stdout


def test_the_manifests_hang_together_and_hold_no_secret():
    for path in manifests():
        for document in documents(path):
            assert document["kind"] != "Secret", f"{path}: secrets are created by hand, never kept in files"
            if document["kind"] == "Kustomization":
                for listed in document["resources"]:
                    assert os.path.exists(os.path.join(os.path.dirname(path), listed)), (path, listed)
    deployment = resource("Deployment", "ckptstore")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert resource("Service", "ckptstore")["spec"]["selector"].items() <= labels.items()
    assert resource("ServiceMonitor", "ckptstore")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e for e in container["env"]}
    assert env["CKPTSTORE_DB_URL"]["valueFrom"]["secretKeyRef"]["name"] == "ckptstore"
    rules = resource("Job", "lm-train")["spec"]["podFailurePolicy"]["rules"]
    fail = next(r for r in rules if r["action"] == "FailJob")
    assert fail["onExitCodes"] == {"containerName": "train", "operator": "In", "values": [78, 79, 80]}
    init = resource("Job", "lm-train")["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"][:2] == ["ckptstore", "prestage"]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion (an unknown variable stays as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(container: dict, configmap: dict, index: int, overrides: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom (the ConfigMap; Secrets are the
    test's `overrides`), then env in order, each value expanded with what came before."""
    env = dict(configmap["data"]) | overrides
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = expand(variable["value"], env)
        elif "job-completion-index" in variable["valueFrom"]["fieldRef"]["fieldPath"]:
            env[variable["name"]] = str(index)
        elif variable["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP":
            env[variable["name"]] = "127.0.0.1"  # every pod here is on this machine's loopback
    return env


@pytest.fixture(scope="module")
def secured_service(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("deploy-service"))
    live = LiveService(
        service_settings(tmp, f"sqlite:///{tmp}/service.db", token=ADMIN, job_tokens={"lm-deploy": JOB_TOKEN})
    )
    yield live, f"{tmp}/storage"
    live.stop()


def command_of(container: dict, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    command = [expand(part, env) for part in [*container["command"], *container.get("args", [])]]
    return command, os.environ | env | {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "TF_CPP_MIN_LOG_LEVEL": "3"}


def run_container(container: dict, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command, process_env = command_of(container, env)
    return subprocess.run(command, cwd=ROOT, env=process_env, capture_output=True, text=True, timeout=300)


def run_pods(job: dict, configmap: dict, overrides: dict[str, str], local: str) -> list[tuple[str, str]]:
    """Every pod of the Job at once, as the Job controller starts them: its init container, then its
    training (the nodes of a job restore together: they agree on one position). (stdout, stderr) each."""
    pod = job["spec"]["template"]["spec"]
    (init,), (train,) = pod["initContainers"], pod["containers"]
    trainings = []
    for index in range(job["spec"]["completions"]):
        # Pods have a network namespace each; here they share one: each gets a port of its own.
        own = {"CKPTSTORE_LOCAL_STORAGE": f"{local}/pod{index}", "CKPTSTORE_PEER_PORT": str(free_port())}
        env = container_env(init, configmap, index, overrides | own)
        staged = run_container(init, env)
        assert staged.returncode == 0, staged.stdout + staged.stderr
        command, process_env = command_of(train, container_env(train, configmap, index, env))
        training = subprocess.Popen(
            command, cwd=ROOT, env=process_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        trainings.append((staged.stdout, training))
    results = []
    for staged_out, training in trainings:
        out, err = training.communicate(timeout=300)
        assert training.returncode == 0, out + err[-3000:]
        results.append((staged_out + out, err))
    return results


def test_the_training_example_stages_and_resumes_against_a_real_service(secured_service, tmp_path):
    pytest.importorskip("keras")
    live, storage = secured_service
    job = resource("Job", "lm-train")
    configmap = resource("ConfigMap", "lm-train")
    overrides = {"CKPTSTORE_JOB": "lm-deploy", "CKPTSTORE_URL": live.url, "CKPTSTORE_STORAGE": storage}
    overrides["CKPTSTORE_TOKEN"] = JOB_TOKEN  # the Secret ckptstore-job-lm
    for out, _ in run_pods(job, configmap, overrides, str(tmp_path / "first")):
        assert "nothing to stage" in out and "fresh start" in out, out
    # The pods come back on new machines: each init container stages the copy its node resumes from.
    for index, (out, err) in enumerate(run_pods(job, configmap, overrides, str(tmp_path / "second"))):
        assert "verified" in out and "resumed from epoch 5" in out, out
        assert f"lm-deploy/node-{index} resumed from epoch 5 (local copy" in err, err[-2000:]
        assert os.path.isdir(tmp_path / "second" / f"pod{index}" / "lm-deploy" / f"node-{index}")
    with ServiceClient(live.url, token=ADMIN) as client:
        assert client.get_job("lm-deploy").nodes == ["node-0", "node-1"]
        for node in ("node-0", "node-1"):
            restarted = [a for a in client.list_attempts("lm-deploy") if a.node == node][-1]
            assert restarted.resumed_from is not None and restarted.resumed_from.epoch == 5


def test_the_gc_cronjob_runs_its_commands_against_a_real_service(secured_service):
    live, _ = secured_service
    cron = resource("CronJob", "ckptstore-gc")
    (container,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    env = {"CKPTSTORE_URL": live.url, "CKPTSTORE_TOKEN": ADMIN}
    with ServiceClient(live.url, token=ADMIN) as client:  # a job the loop must reach, besides the example's
        declared = f"gc-{uuid.uuid4().hex[:6]}"
        client.put_job(declared, nodes=["n0"])
    result = run_container(container, env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"retention and verification of {declared}" in result.stdout, result.stdout
    assert "corrupt copies of" not in result.stdout, "a job with nothing to verify is not a corrupt one"


def slurm_bin(tmp_path) -> str:
    """Stand-ins for srun (one task after another, SLURM_PROCID set; SIGTERM to a task that printed
    $TERM_ON, as `--signal=TERM@300` would) and scontrol (records what it was asked)."""
    folder = tmp_path / "slurm-bin"
    folder.mkdir()
    (folder / "srun").write_text(
        f"#!{sys.executable}\n"
        "import os, signal, subprocess, sys\n"
        "command = [a for a in sys.argv[1:] if not a.startswith('--')]\n"
        "code = 0\n"
        "for rank in range(int(os.environ['SLURM_NTASKS'])):\n"
        "    task = subprocess.Popen(command, env=os.environ | {'SLURM_PROCID': str(rank)},"
        " stdout=subprocess.PIPE, text=True)\n"
        "    for line in task.stdout:\n"
        "        print(line, end='', flush=True)\n"
        "        if line.strip() == os.environ.get('TERM_ON'):\n"
        "            task.send_signal(signal.SIGTERM)\n"
        "    returned = task.wait()\n"
        "    code = max(code, 128 - returned if returned < 0 else returned)\n"
        "sys.exit(code)\n"
    )
    (folder / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    for name in ("srun", "scontrol"):
        (folder / name).chmod(0o755)
    return str(folder)


def sbatch(tmp_path, bin: str, live, storage: str, job: str, **extra: str) -> subprocess.CompletedProcess[str]:
    train = f"python -m tests.request_job --framework torch --node node-$SLURM_PROCID --job {job}"
    train += f" --storage {storage} --service {live.url}"
    env = (
        os.environ
        | {
            "PATH": os.pathsep.join([bin, BIN, os.environ["PATH"]]),
            "SLURM_JOB_ID": "4242",
            "SLURM_NTASKS": "1",
            "CKPTSTORE_URL": live.url,
            "CKPTSTORE_JOB": job,
            "CKPTSTORE_STORAGE": storage,
            "CKPTSTORE_LOCAL_STORAGE": str(tmp_path / "node-local"),
            "CKPTSTORE_TOKEN": ADMIN,
            "TRAIN_COMMAND": train,
        }
        | extra
    )
    return subprocess.run(["bash", SLURM], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_slurm_script_saves_on_sigterm_requeues_resumes_and_never_requeues_a_refusal(secured_service, tmp_path):
    pytest.importorskip("torch")
    live, storage = secured_service
    job, bin = f"slurm-{uuid.uuid4().hex[:6]}", slurm_bin(tmp_path)
    stopped = sbatch(tmp_path, bin, live, storage, job, TERM_ON="TRAINING")
    assert stopped.returncode == 143, stopped.stdout + stopped.stderr[-3000:]
    assert "requeued" in stopped.stdout and (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    with ServiceClient(live.url, token=ADMIN) as client:
        saved = client.list_checkpoints(job)
    assert [r.node for r in saved] and all(r.node == "node-0" for r in saved), "the SIGTERM save"
    resumed = sbatch(tmp_path, bin, live, storage, job, SLURM_RESTART_COUNT="1")
    assert resumed.returncode == 0 and "training finished" in resumed.stdout, resumed.stdout + resumed.stderr[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n", "a finished run is not requeued"
    under_a_file = tmp_path / "a-file"
    under_a_file.write_text("not a folder")
    refused = sbatch(tmp_path, bin, live, str(under_a_file / "ckpt"), f"refused-{uuid.uuid4().hex[:6]}")
    assert refused.returncode == 78 and "not requeued" in refused.stdout, refused.stdout + refused.stderr[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
