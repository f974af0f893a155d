"""The presigned data path, the client's side (issue 31): training processes whose environment holds no
cloud credentials — only the service's address and their job's token — save, are killed, resume
bit-exactly and fall back past a corrupt copy, on S3 (moto) through URLs the service (its own process,
holding the credentials) signs; the service moves none of the checkpoint's bytes (its own I/O counters
say so); URLs are refreshed before they expire; a fenced process gets no URL.

moto checks neither signatures nor expiry (tests/test_presign.py re-derives signatures); so here the
client is checked never to send a URL past its expiry, by reading every URL it sends."""

from __future__ import annotations

import calendar
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from urllib.parse import parse_qsl, urlsplit

import httpx
import numpy as np
import pytest

from ckptstore import Position, Store
from ckptstore.errors import FencedError
from tests.conftest import service_settings
from tests.live import LiveService, start_service_process
from tests.servers import ROOT, free_port

torch = pytest.importorskip("torch", reason="the [torch] extra is not installed")

ADMIN = "admin-token-" + "a" * 16


def signing_service(tmp_path, moto, jobs: list[str]) -> tuple[subprocess.Popen, str, dict[str, str]]:
    """The service in its own process, holding moto's credentials; a token per job."""
    tokens = {job: f"token-{uuid.uuid4().hex}" for job in jobs}
    port = free_port()
    process = start_service_process(
        tmp_path,
        port,
        storage_roots=f"{tmp_path}/storage,s3://{moto.bucket}",
        storage_options=json.dumps({f"s3://{moto.bucket}": moto.options}),
        job_tokens=json.dumps(tokens),
        token=ADMIN,
    )
    return process, f"http://127.0.0.1:{port}", tokens


def without_credentials(tmp_path, url: str, token: str) -> dict[str, str]:
    """A training process's environment: no AWS_*/GOOGLE_* variable, no ~/.aws; the service and a job token."""
    cloud = ("AWS_", "GOOGLE_", "GCS", "CKPTSTORE_", "BOTO")
    env = {name: value for name, value in os.environ.items() if not name.startswith(cloud)}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return env | {
        "HOME": str(home),
        "CKPTSTORE_URL": url,
        "CKPTSTORE_TOKEN": token,
        "CKPTSTORE_PRESIGNED": "1",
        "CKPTSTORE_NODE": "n0",
    }


def run(env: dict[str, str], *args: str, killed: bool = False) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == (-9 if killed else 0), done.stderr[-3000:]
    return done


def torch_job(env: dict[str, str], tmp_path, storage: str, job: str, *extra: str, killed: bool = False):
    out = tmp_path / f"final-{uuid.uuid4().hex[:6]}.npz"
    done = run(
        env, "-m", "tests.torch_job", "--storage", storage, "--job", job, "--out", str(out), *extra, killed=killed
    )
    if killed:
        return done, None
    with np.load(out) as archive:
        return done, {key: archive[key] for key in archive.files}


def assert_bit_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k].dtype != want[k].dtype or got[k].tobytes() != want[k].tobytes()] == []


def test_a_job_without_credentials_is_killed_resumes_bit_exactly_and_falls_back(tmp_path, moto_s3):
    base, job = f"base-{uuid.uuid4().hex[:6]}", f"signed-{uuid.uuid4().hex[:6]}"
    service, url, tokens = signing_service(tmp_path, moto_s3, [base, job])
    storage = f"s3://{moto_s3.bucket}/presigned-{uuid.uuid4().hex[:6]}"
    try:
        env = without_credentials(tmp_path, url, tokens[job])
        probe = f"import s3fs; s3fs.S3FileSystem(endpoint_url={moto_s3.endpoint_url!r}).ls({moto_s3.bucket!r})"
        direct = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        assert direct.returncode != 0 and "NoCredentialsError" in direct.stderr, "the environment holds no credentials"

        _, baseline = torch_job(without_credentials(tmp_path, url, tokens[base]), tmp_path, storage, base)
        torch_job(env, tmp_path, storage, job, "--kill-epoch", "1", "--kill-batch", "7", killed=True)
        resumed, got = torch_job(env, tmp_path, storage, job)
        assert resumed.stdout.splitlines()[0] == "RESUMED 1 6"
        assert "resume audit: exact" in resumed.stderr
        assert_bit_equal(got, baseline)

        store = Store(storage, storage_options=moto_s3.options)  # the test's own credentials, to damage a copy
        positions = store.list_positions(job, "n0")
        assert positions[-1] == Position(2)
        damage_own_blob_on(store, job, positions[-1], positions[-2])
        again, got = torch_job(env, tmp_path, storage, job)
        assert again.stdout.splitlines()[0] == f"RESUMED 2 {positions[-2].batch}", again.stderr[-2000:]
        assert "skipped" in again.stderr and "corrupt" in again.stderr
        assert_bit_equal(got, baseline)
    finally:
        service.kill()
        service.wait()


def damage_own_blob_on(store: Store, job: str, newest: Position, previous: Position) -> None:
    """Flip a byte in the largest blob the copy at `newest` holds and the one at `previous` does not."""
    manifest = store.manifest(store.copies(job, "n0", newest)[-1])
    before = {s.file for s in store.manifest(store.copies(job, "n0", previous)[-1]).shards}
    shard = max((s for s in manifest.shards if s.file not in before), key=lambda s: s.bytes)
    storage = store._storage
    data = bytearray(storage.read_object(shard.file))
    data[-3] ^= 0x10
    storage.fs.pipe_file(storage.path(shard.file), bytes(data))


SAVE_OR_CHECK = """
import hashlib, sys, torch
from ckptstore.client.torch import CheckpointManager
torch.manual_seed(5)
model = torch.nn.Linear(2048, 4096)  # 32 MiB of weights that do not compress
manager = CheckpointManager(objects={"model": model}, storage=sys.argv[1], job=sys.argv[2], async_save=False)
start = manager.restore_or_initialize()
if start == 0:
    with torch.no_grad():
        model.weight.add_(torch.randn_like(model.weight))
    manager.save(0)
manager.close()
print(start, hashlib.sha256(model.weight.detach().numpy().tobytes()).hexdigest())
"""


def io_of(process: subprocess.Popen) -> int:
    """Bytes the process has read and written through system calls (files, sockets, pipes) so far."""
    with open(f"/proc/{process.pid}/io") as counters:
        values = dict(line.split(": ") for line in counters.read().splitlines())
    return int(values["rchar"]) + int(values["wchar"])


def test_the_service_moves_none_of_the_checkpoint_bytes(tmp_path, moto_s3):
    job = f"bytes-{uuid.uuid4().hex[:6]}"
    service, url, tokens = signing_service(tmp_path, moto_s3, [job])
    storage = f"s3://{moto_s3.bucket}/bytes-{uuid.uuid4().hex[:6]}"
    try:
        env = without_credentials(tmp_path, url, tokens[job])
        before = io_of(service)
        saved = run(env, "-c", SAVE_OR_CHECK, storage, job).stdout.split()
        restored = run(env, "-c", SAVE_OR_CHECK, storage, job).stdout.split()
        moved = io_of(service) - before
    finally:
        service.kill()
        service.wait()
    assert saved[0] == "0" and restored[0] == "1" and restored[1] == saved[1], (saved, restored)
    stored = Store(storage, storage_options=moto_s3.options)
    copy = stored.copies(job, "n0", Position(0))[-1]
    assert stored.manifest(copy).total_bytes > 32 << 20  # 32 MiB went up to the store and came back down
    # 64 MiB crossed between the node and the store; the service's requests and database took ~5 MB here
    assert moved < 8 << 20, f"the service's own I/O during a 32 MiB save and a 32 MiB restore: {moved} bytes"


def presigned_manager(service: str, storage: str, job: str, model: torch.nn.Module, **options):
    from ckptstore.client.torch import CheckpointManager

    return CheckpointManager(
        objects={"model": model}, storage=storage, service=service, job=job, node="n0", presigned=True, **options
    )


def save_rereading(manager, model: torch.nn.Module, job: str, epochs: int, pause_s: Callable[[int], float]) -> None:
    """Save `epochs` positions of a changing model, after each reading epoch 0's manifest back (the same
    GET URL, kept while fresh) and waiting `pause_s(epoch)`; every save must commit, none skipped."""
    store = manager.checkpointer.store
    for epoch in range(epochs):
        with torch.no_grad():
            model.weight.add_(1.0)
        manager.save(epoch)
        manager.wait()
        assert store.manifest(store.copies(job, "n0", Position(0))[-1]).position == Position(0)
        time.sleep(pause_s(epoch))
    assert manager.checkpointer.saves.committed == epochs and manager.checkpointer.skipped_saves == 0


@pytest.fixture
def short_lived_urls(tmp_path, moto_s3):
    options = {f"s3://{moto_s3.bucket}": moto_s3.options}
    live = LiveService(
        service_settings(
            str(tmp_path), f"sqlite:///{tmp_path}/db.sqlite", storage_options=options, url_expiry_seconds=2
        )
    )
    yield live
    live.stop()


def test_urls_are_asked_for_again_before_they_expire_and_no_save_fails(short_lived_urls, moto_s3):

    sent: list[tuple[float, str, str]] = []
    storage, job = f"s3://{moto_s3.bucket}/expiry-{uuid.uuid4().hex[:6]}", f"expiry-{uuid.uuid4().hex[:6]}"
    model = torch.nn.Linear(64, 64)
    manager = presigned_manager(short_lived_urls.url, storage, job, model, async_save=False)
    fs = manager.checkpointer.store._storage.fs
    fs.http.event_hooks["request"].append(lambda request: sent.append((time.time(), request.method, str(request.url))))
    assert manager.restore_or_initialize() == 0
    save_rereading(manager, model, job, 3, lambda epoch: 2.2)  # every URL asked for so far has expired
    manager.close()
    rereads = {url for _, method, url in sent if method == "GET" and "/0000000000/1/MANIFEST.json?" in url}
    assert len(rereads) >= 3, "epoch 0's manifest read again after each expiry, each time with a new URL"
    for when, _, sent_url in sent:
        query = dict(parse_qsl(urlsplit(sent_url).query))
        signed = calendar.timegm(time.strptime(query["X-Amz-Date"], "%Y%m%dT%H%M%SZ"))
        assert when < signed + int(query["X-Amz-Expires"]), f"{sent_url} sent after it expired"


def test_a_fenced_process_gets_no_url_and_stops(short_lived_urls, moto_s3):
    from ckptstore.client.torch import CheckpointManager

    storage, job = f"s3://{moto_s3.bucket}/fenced-{uuid.uuid4().hex[:6]}", f"fenced-{uuid.uuid4().hex[:6]}"
    model = torch.nn.Linear(8, 8)

    def manager() -> CheckpointManager:
        return presigned_manager(short_lived_urls.url, storage, job, model, async_save=False)

    older = manager()
    assert older.restore_or_initialize() == 0
    older.save(0)
    newer = manager()
    assert newer.restore_or_initialize() == 1
    with pytest.raises(FencedError):
        older.save(1)
        older.wait()
    answer = httpx.post(
        f"{short_lived_urls.url}/v1/jobs/{job}/nodes/n0/urls",
        json={"attempt": "1", "objects": [{"method": "GET", "key": f"{job}/n0/x"}]},
    )
    assert answer.status_code == 409 and answer.json()["error"] == "fenced"
    newer.save(1)
    newer.close()


KERAS_ARGS = ["--mode", "keras", "--save-freq", "4", "--spe", "1"]  # tests/test_training.py's baseline is shared


def keras_job(env, tmp_path, storage: str, job: str, *extra: str, killed: bool = False):
    out = tmp_path / f"keras-{uuid.uuid4().hex[:6]}.npz"
    local = str(tmp_path / f"local-{job}")
    args = ["-m", "tests.train_job", "--storage", storage, "--local-storage", local, "--job", job, "--out", str(out)]
    done = run(env, *args, *KERAS_ARGS, *extra, killed=killed)
    if killed:
        return done, None
    with np.load(out) as archive:
        return done, {key: archive[key] for key in archive.files}


def test_keras_with_a_local_tier_replicates_and_a_new_machine_resumes_through_urls(tmp_path, moto_s3):
    pytest.importorskip("tensorflow", reason="the [tf] extra is not installed")
    from tests.test_training import baseline

    job = f"keras-{uuid.uuid4().hex[:6]}"
    service, url, tokens = signing_service(tmp_path, moto_s3, [job])
    storage = f"s3://{moto_s3.bucket}/keras-{uuid.uuid4().hex[:6]}"
    try:
        env = without_credentials(tmp_path, url, tokens[job])
        keras_job(env, tmp_path, storage, job, "--kill-epoch", "2", "--kill-batch", "7", killed=True)
        local = tmp_path / f"local-{job}"
        assert any(local.rglob("MANIFEST.json")), "the killed run saved on its local tier"
        shutil.rmtree(local)  # a new machine: only the durable copies, reached through URLs
        resumed, got = keras_job(env, tmp_path, storage, job)
    finally:
        service.kill()
        service.wait()
    assert resumed.stdout.splitlines()[0] == "RESUMED 2 4", resumed.stderr[-2000:]
    assert "durable copy" in resumed.stderr
    assert_bit_equal(got, baseline(tmp_path, KERAS_ARGS))  # an uninterrupted run with credentials, on local disk


def test_the_documented_callback_takes_the_presigned_path(monkeypatch, moto_s3):
    pytest.importorskip("tensorflow", reason="the [tf] extra is not installed")
    from ckptstore.client.service.presigned import PresignedFileSystem
    from tests.job_runs import documented_block

    monkeypatch.setenv("CKPTSTORE_URL", "http://127.0.0.1:9")  # never asked: nothing is read before fit
    code = documented_block("docs/operations.md", "**What a node needs**", {'"s3://bucket/runs"': '"s3://ckpt/runs"'})
    namespace: dict = {}
    exec(compile(textwrap.dedent(code), "docs/operations.md", "exec"), namespace)
    store = namespace["backup"].manager.checkpointer.store
    assert store.url == "s3://ckpt/runs" and isinstance(store._storage.fs, PresignedFileSystem)


def test_retention_deletes_copies_and_their_blobs_through_urls(short_lived_urls, moto_s3, tmp_path):
    from ckptstore.blobs import referenced

    storage, job = f"s3://{moto_s3.bucket}/kept-{uuid.uuid4().hex[:6]}", f"kept-{uuid.uuid4().hex[:6]}"
    model = torch.nn.Linear(32, 32)
    manager = presigned_manager(
        short_lived_urls.url, storage, job, model, max_to_keep=2, local_storage=str(tmp_path / "local")
    )
    manager.restore_or_initialize()
    for epoch in range(5):
        with torch.no_grad():
            model.weight.add_(1.0)
        manager.save(epoch)
        manager.wait()
    manager.close()
    durable = Store(storage, storage_options=moto_s3.options)
    assert durable.list_positions(job, "n0") == [Position(3), Position(4)]
    live = referenced(durable.manifest(copy) for p in (3, 4) for copy in durable.copies(job, "n0", Position(p)))
    pool = {f"{job}/n0/.blobs/{f.relpath}" for f in durable._storage.find(f"{job}/n0/.blobs")}
    assert pool == set(live), "the blobs only deleted copies used went with them"


class ExpiringFront:
    """An HTTP front for moto that refuses an expired presigned URL as S3 does (403, `Request has
    expired`) by its own clock, `skew_s` ahead of everyone else's (moto itself checks no expiry)."""

    def __init__(self, upstream: str, skew_s: float):
        import http.server
        import threading

        front = self
        self.refused = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self) -> None:
                query = dict(parse_qsl(urlsplit(self.path).query))
                if "X-Amz-Date" in query:
                    signed = calendar.timegm(time.strptime(query["X-Amz-Date"], "%Y%m%dT%H%M%SZ"))
                    if time.time() + skew_s > signed + int(query["X-Amz-Expires"]):
                        front.refused += 1
                        body = b"<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"
                        self.send_response(403)
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body)
                        return
                length = int(self.headers.get("Content-Length") or 0)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                answer = httpx.request(
                    self.command, upstream + self.path, headers=headers, content=self.rfile.read(length)
                )
                self.send_response(answer.status_code)
                for name, value in answer.headers.items():
                    if name.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_url_the_store_finds_expired_is_asked_for_again_and_the_save_goes_through(tmp_path, moto_s3):

    front = ExpiringFront(moto_s3.endpoint_url, skew_s=4)  # the store's clock runs 4 s ahead
    options = {f"s3://{moto_s3.bucket}": moto_s3.options | {"endpoint_url": front.url}}
    settings = service_settings(str(tmp_path), f"sqlite:///{tmp_path}/db.sqlite", storage_options=options)
    live = LiveService(settings.model_copy(update={"url_expiry_seconds": 10}))
    storage, job = f"s3://{moto_s3.bucket}/skew-{uuid.uuid4().hex[:6]}", f"skew-{uuid.uuid4().hex[:6]}"
    model = torch.nn.Linear(64, 64)
    try:
        manager = presigned_manager(live.url, storage, job, model, async_save=False)
        assert manager.restore_or_initialize() == 0
        # The URLs kept are fresh by the node's clock (8 s) after 6.5 s, expired by the store's (6 s).
        save_rereading(manager, model, job, 2, lambda epoch: 6.5 if epoch == 0 else 0)
        manager.close()
    finally:
        live.stop()
        front.server.shutdown()
    assert front.refused > 0, "the store refused URLs it found expired"
    assert Store(storage, storage_options=moto_s3.options).list_positions(job, "n0") == [Position(0), Position(1)]


def test_with_the_service_away_a_start_refuses_rather_than_train_from_scratch(moto_s3):
    """With no service to sign, the node cannot list its copies on storage: it refuses to start fresh
    (ResumeRefusedError naming why; `fresh_start=True` overrides it as any refusal), never training from
    scratch over copies it cannot see."""
    from ckptstore.errors import ResumeRefusedError

    away, storage = f"http://127.0.0.1:{free_port()}", f"s3://{moto_s3.bucket}/away-{uuid.uuid4().hex[:6]}"
    job = f"away-{uuid.uuid4().hex[:6]}"
    manager = presigned_manager(away, storage, job, torch.nn.Linear(4, 4), storage_wait_s=1)
    with pytest.raises(ResumeRefusedError, match="neither answers now"):
        manager.restore_or_initialize()
