"""docker-compose.yml: its structure (this machine has no Docker engine), and the service started
exactly as the file's command and environment say — S3 endpoint swapped for moto's — serving a
Keras job that is killed and resumed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest
import yaml

from tests.builders import assert_bit_equal
from tests.live import wait_for
from tests.servers import free_port
from tests.test_training import baseline, final_state, job_args, run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINIO = "http://minio:9000"
VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${VAR}` / `${VAR:-default}` substitution."""
    return VARIABLE.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


@pytest.fixture(scope="module")
def compose() -> dict:
    with open(os.path.join(ROOT, "docker-compose.yml")) as handle:
        return yaml.safe_load(handle)


def environment(service: dict, env: dict[str, str] | None = None) -> dict[str, str]:
    return {k: interpolate(str(v), env or {}) for k, v in service.get("environment", {}).items()}


def test_compose_file_structure(compose):
    assert "version" not in compose, "the top-level version key is obsolete"
    services = compose["services"]
    assert set(services) == {"minio", "mc", "postgres", "ckptstore", "replica-a", "replica-b", "nginx", "trainer"}
    minio, mc, postgres, ckpt = (services[s] for s in ("minio", "mc", "postgres", "ckptstore"))
    for name, service in (("minio", minio), ("mc", mc)):
        image = interpolate(service["image"], {})
        assert re.fullmatch(rf"quay\.io/minio/{'minio' if name == 'minio' else 'mc'}:RELEASE\.[\dT-]+Z", image), image
        assert service["image"].startswith("${"), f"{name}'s image can be overridden by a variable"
    assert minio["command"] == ["server", "/data", "--console-address", ":9001"]
    assert minio["healthcheck"]["test"] == ["CMD", "mc", "ready", "local"]
    assert mc["depends_on"] == {"minio": {"condition": "service_healthy"}}
    assert mc["command"][:2] == ["mb", "--ignore-existing"] and mc["restart"] == "no"
    assert postgres["profiles"] == ["postgres", "scale"] and "pg_isready" in postgres["healthcheck"]["test"]
    assert ckpt["build"] == "." and os.path.isfile(os.path.join(ROOT, "Dockerfile"))
    assert ckpt["depends_on"]["minio"] == {"condition": "service_healthy"}
    assert ckpt["depends_on"]["mc"] == {"condition": "service_completed_successfully"}
    assert ckpt["depends_on"]["postgres"] == {"condition": "service_healthy", "required": False}
    for service in services.values():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{port} must be bound to loopback"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            data = source in compose["volumes"]
            assert data or (source.startswith("./") and volume.endswith(":ro")), f"{volume}: named, or read-only config"
    assert "127.0.0.1:8080:8080" in ckpt["ports"]


def test_compose_wiring_agrees_between_services(compose):
    services = compose["services"]
    minio, mc, ckpt = environment(services["minio"]), environment(services["mc"]), environment(services["ckptstore"])
    assert ckpt["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert (ckpt["AWS_ACCESS_KEY_ID"], ckpt["AWS_SECRET_ACCESS_KEY"]) == (
        minio["MINIO_ROOT_USER"],
        minio["MINIO_ROOT_PASSWORD"],
    )
    assert mc["MC_HOST_minio"] == f"http://{minio['MINIO_ROOT_USER']}:{minio['MINIO_ROOT_PASSWORD']}@minio:9000"
    bucket = services["mc"]["command"][-1].split("/", 1)[1]
    assert (
        ckpt["CKPTSTORE_STORAGE"].startswith(f"s3://{bucket}/") and ckpt["CKPTSTORE_STORAGE_ROOTS"] == f"s3://{bucket}"
    )
    assert ckpt["AWS_REQUEST_CHECKSUM_CALCULATION"] == "when_required"
    db_volume = next(v for v in services["ckptstore"]["volumes"] if v.startswith("ckptstore-db:"))
    assert ckpt["CKPTSTORE_DB_URL"] == f"sqlite:///{db_volume.split(':')[1]}/ckptstore.db", "the DB is on the volume"
    switched = environment(services["ckptstore"], {"CKPTSTORE_DB_URL": "postgresql+psycopg://u@postgres/x"})
    assert switched["CKPTSTORE_DB_URL"] == "postgresql+psycopg://u@postgres/x", "the postgres profile's switch"
    with open(os.path.join(ROOT, "Dockerfile")) as handle:
        dockerfile = handle.read()
    assert 'pip install ".[server,s3,gcs]"' in dockerfile and "EXPOSE 8080" in dockerfile
    assert "USER ckptstore" in dockerfile, "the service does not run as root"


@contextlib.contextmanager
def compose_service(compose: dict, moto_s3, tmp_path) -> Iterator[tuple[str, dict[str, str]]]:
    """The service started exactly as the compose file's command and environment say — MinIO's
    endpoint swapped for moto's, the database volume for a temp dir —: its URL and environment."""
    service = compose["services"]["ckptstore"]
    env = environment(service)
    db_mount = next(v for v in service["volumes"] if v.startswith("ckptstore-db:")).split(":")[1]
    env["CKPTSTORE_DB_URL"] = env["CKPTSTORE_DB_URL"].replace(db_mount, str(tmp_path))  # the named volume
    for name in ("AWS_ENDPOINT_URL", "CKPTSTORE_STORAGE_OPTIONS"):
        assert MINIO in env[name], name
        env[name] = env[name].replace(MINIO, moto_s3.endpoint_url)  # minio:9000 → moto on loopback
    port = free_port()
    command = [arg if arg != "8080" else str(port) for arg in service["command"]]
    command[0] = shutil.which(command[0], path=os.path.dirname(sys.executable)) or command[0]
    process = subprocess.Popen(command, env=os.environ | env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:

        def ready():
            try:
                return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
            except httpx.TransportError:
                assert process.poll() is None, process.stderr.read().decode()[-2000:]
                return False

        wait_for(ready, timeout=60, interval=0.2, what="the compose service")
        yield url, env
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_service_started_as_compose_says_serves_a_killed_and_resumed_keras_job(compose, moto_s3, tmp_path):
    with compose_service(compose, moto_s3, tmp_path) as (url, env):
        args = ["--mode", "keras", "--save-freq", "4", "--spe", "1"]
        job = f"compose-{uuid.uuid4().hex[:6]}"
        common = job_args(env["CKPTSTORE_STORAGE"], job, *args, "--endpoint", moto_s3.endpoint_url, service=url)
        run_job(tmp_path, *common, "--kill-epoch", "3", "--kill-batch", "6", killed=True)
        resumed = run_job(tmp_path, *common)
        assert resumed.splitlines()[0] == "RESUMED 3 4"
        assert_bit_equal(final_state(resumed), baseline(tmp_path, args))
        answer = httpx.get(f"{url}/v1/jobs/{job}/last-good-epoch").json()
        assert answer["epoch"] == 5 and answer["nodes"]["n0"]["location"].startswith(env["CKPTSTORE_STORAGE"])
        health = httpx.get(f"{url}/v1/jobs/{job}/health", params={"probe": "true"}).json()
        assert health["probe"]["cp_accessible"] is True, "the service reaches S3 with the compose credentials"


def test_the_trainer_holds_no_credentials_and_is_killed_and_resumed_through_signed_urls(compose, moto_s3, tmp_path):
    trainer = compose["services"]["trainer"]
    env = environment(trainer)
    assert trainer["profiles"] == ["train"] and env["CKPTSTORE_PRESIGNED"] == "1"
    assert not [name for name in env if name.startswith("AWS_")], "no storage credentials in the trainer"
    assert trainer["depends_on"] == {"ckptstore": {"condition": "service_healthy"}}
    with open(os.path.join(ROOT, trainer["build"]["dockerfile"])) as handle:
        dockerfile = handle.read()
    assert re.findall(r'pip install "([^"]+)"', dockerfile) == [".[tf]"], "no S3 client in the trainer's image"
    assert json.loads(re.search(r"^CMD (\[.*\])$", dockerfile, re.M).group(1)) == trainer["command"]
    script, flag, service, storage, kill = trainer["command"][1:]
    assert (script, flag, kill) == ("scripts/demo.py", "--train", "-")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CKPTSTORE_"))}
    with compose_service(compose, moto_s3, tmp_path) as (url, served):
        assert service == "http://ckptstore:8080" and storage == served["CKPTSTORE_STORAGE"]
        train = [sys.executable, script, flag, url, storage]
        killed = subprocess.run(
            [*train, "3,14"], env=clean | env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert killed.returncode == -9, killed.stderr[-2000:]
        resumed = subprocess.run([*train, kill], env=clean | env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        # killed at once (the demo's SIGKILL does not wait for the save in flight): a mid-epoch-3 position
        assert re.search(r"\[train\] resumed from epoch 3 batch (4|8|12) ", resumed.stdout), resumed.stdout
        answer = httpx.get(f"{url}/v1/jobs/demo/last-good-epoch").json()
        assert answer["epoch"] == 5 and answer["nodes"]["worker-0"]["location"].startswith(storage)


def test_scale_profile_runs_two_replicas_over_postgres_behind_the_documented_nginx(compose):
    services = compose["services"]
    replicas = [services["replica-a"], services["replica-b"]]
    postgres = environment(services["postgres"])
    for replica in replicas:
        env = environment(replica)
        assert replica["profiles"] == ["scale"] and not replica.get("ports"), "only nginx is published"
        assert env["CKPTSTORE_DB_URL"] == (
            f"postgresql+psycopg://{postgres['POSTGRES_USER']}:{postgres['POSTGRES_PASSWORD']}"
            f"@postgres:5432/{postgres['POSTGRES_DB']}"
        )
        assert replica["depends_on"]["postgres"] == {"condition": "service_healthy"}
        single = environment(services["ckptstore"])
        assert {k: v for k, v in env.items() if k in single and k != "CKPTSTORE_DB_URL"} == {
            k: v for k, v in single.items() if k in env and k != "CKPTSTORE_DB_URL"
        }, "the replicas reach MinIO exactly as the single service does"
    nginx = services["nginx"]
    assert nginx["profiles"] == ["scale"] and nginx["ports"] == ["127.0.0.1:8081:80"]
    source, target = nginx["volumes"][0].split(":")[:2]
    assert target == "/etc/nginx/conf.d/default.conf"
    with open(os.path.join(ROOT, source), encoding="utf-8") as handle:
        shipped = handle.read()
    assert re.findall(r"server ([\w.-]+):8080;", shipped) == ["replica-a", "replica-b"]
    with open(os.path.join(ROOT, "docs", "operations.md"), encoding="utf-8") as handle:
        documented = re.search(r"```nginx\n(.*?)```", handle.read(), re.S).group(1)
    strip = lambda text: re.sub(r"server [\w.-]+:8080;\n", "", re.sub(r"^#.*\n", "", text, flags=re.M))  # noqa: E731
    assert strip(shipped) == strip(documented), "deploy/nginx.conf is the documented config"
