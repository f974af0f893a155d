"""Presigned URLs (issue 31, the service's side): a node holding only the service's address gets
short-lived URLs to its own objects on S3 (moto) and moves the bytes itself; anything outside its
scope — another job, node, attempt, a key that climbs out — is refused before anything is signed, and
a fenced attempt gets none.

moto's server does not check SigV4 signatures or expiry (it answers a tampered or expired URL), so the
signatures are checked here by signing the same request again with the same credentials and time
(`signature_matches`): a URL changed to another key no longer matches. moto does honour
`If-None-Match: *` (412 on an existing object), which the create-only blob uploads rely on."""

from __future__ import annotations

import datetime
import json
import re
import time
import uuid
from unittest import mock
from urllib.parse import parse_qsl, urlencode, urlsplit

import httpx
import pytest

from ckptstore import CopyKey, Position
from ckptstore.format.layout import blob_key, pool_reference
from tests import builders
from tests.conftest import service_settings
from tests.live import LiveService


@pytest.fixture(scope="module")
def signing_service(tmp_path_factory, moto_s3):
    tmp = str(tmp_path_factory.mktemp("presign"))
    options = {f"s3://{moto_s3.bucket}": moto_s3.options}
    live = LiveService(service_settings(tmp, f"sqlite:///{tmp}/db.sqlite", storage_options=options))
    yield live, f"s3://{moto_s3.bucket}"
    live.stop()


def signature_matches(url: str, method: str, headers: dict[str, str]) -> bool:
    """Whether `url`'s SigV4 signature is the one the service's credentials give for this method, path
    and signed headers at the URL's own date."""
    from botocore.auth import S3SigV4QueryAuth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    when = datetime.datetime.strptime(query["X-Amz-Date"], "%Y%m%dT%H%M%SZ")
    region = query["X-Amz-Credential"].split("/")[2]
    kept = urlencode([(k, v) for k, v in parse_qsl(parts.query) if not k.startswith("X-Amz-")])
    request = AWSRequest(method=method, url=f"{parts.scheme}://{parts.netloc}{parts.path}{'?' + kept if kept else ''}")
    for name, value in headers.items():
        request.headers[name] = value
    signer = S3SigV4QueryAuth(Credentials("testing", "testing"), "s3", region, expires=int(query["X-Amz-Expires"]))
    with mock.patch("botocore.auth.get_current_datetime", return_value=when):
        signer.add_auth(request)
    return dict(parse_qsl(urlsplit(request.url).query))["X-Amz-Signature"] == query["X-Amz-Signature"]


def ask(http, job: str, node: str, attempt, *objects: tuple[str, str], expires_s: int | None = None):
    body = {"attempt": attempt, "objects": [{"method": m, "key": k} for m, k in objects]}
    if expires_s is not None:
        body["expires_s"] = expires_s
    return http.post(f"/v1/jobs/{job}/nodes/{node}/urls", json=body)


def started_job(http, root: str, nodes=("n0", "n1"), **extra) -> str:
    job = f"signed-{uuid.uuid4().hex[:8]}"
    builders.declare(http, f"{root}/{job}", job, list(nodes), **extra)
    for node in nodes:
        assert http.post(f"/v1/jobs/{job}/nodes/{node}/attempts", json={}).status_code == 201
    return job


def test_a_node_writes_and_reads_its_own_objects_through_urls(signing_service):
    live, root = signing_service
    with live.client() as http:
        job = started_job(http, root)
        manifest = f"{CopyKey(job, 'n0', Position(0), '1').relpath}/manifest.json"
        answer = ask(http, job, "n0", "1", ("PUT", manifest), ("GET", manifest), expires_s=120)
        assert answer.status_code == 200, answer.text
        put, get = answer.json()["urls"]
        assert abs(answer.json()["expires_at"] - (time.time() + 120)) < 5
        assert "X-Amz-Expires=120" in put["url"] and put["headers"] == {}
        assert urlsplit(put["url"]).path == f"/{root.removeprefix('s3://')}/{job}/{manifest}"
        assert httpx.put(put["url"], content=b"the manifest").status_code == 200
        assert httpx.get(get["url"]).content == b"the manifest"
        assert signature_matches(put["url"], "PUT", {}) and signature_matches(get["url"], "GET", {})
        elsewhere = put["url"].replace(f"/{job}/n0/", f"/{job}/n1/")
        assert not signature_matches(elsewhere, "PUT", {}), "the signature covers the key: it cannot be reused"


def test_a_blob_is_uploaded_create_only_and_never_overwritten(signing_service):
    live, root = signing_service
    with live.client() as http:
        job = started_job(http, root)
        blob = blob_key(job, "n0", "ab" * 16)
        (put,) = ask(http, job, "n0", "1", ("PUT", blob)).json()["urls"]
        assert put["headers"] == {"If-None-Match": "*"}
        assert signature_matches(put["url"], "PUT", put["headers"])
        assert not signature_matches(put["url"], "PUT", {}), "the condition is signed: it cannot be left out"
        assert httpx.put(put["url"], content=b"blob", headers=put["headers"]).status_code == 200
        again = httpx.put(put["url"], content=b"poison", headers=put["headers"])
        assert again.status_code == 412, "an existing blob is never overwritten"
        (get,) = ask(http, job, "n1", "1", ("GET", blob)).json()["urls"]
        assert httpx.get(get["url"]).content == b"blob"


def test_what_is_not_the_node_s_is_refused_and_a_fenced_attempt_gets_nothing(signing_service):
    live, root = signing_service
    with live.client() as http:
        job = started_job(http, root)
        other = started_job(http, root)
        own = f"{CopyKey(job, 'n0', Position(1), '1').relpath}/tensors.safetensors"
        refused = {
            "another node's prefix": ("PUT", own.replace("/n0/", "/n1/")),
            "another attempt": ("PUT", own.replace("/1/tensors", "/2/tensors")),
            "another job": ("GET", own.replace(job, other)),
            "another node's blobs": ("PUT", blob_key(job, "n1", "cd" * 16)),
            "the job's folder itself": ("PUT", f"{job}/n0/manifest.json"),
        }
        for why, wanted in refused.items():
            answer = ask(http, job, "n0", "1", ("GET", own), wanted)
            assert answer.status_code == 403 and answer.json()["error"] == "forbidden", (why, answer.text)
        for bad in (f"{job}/../{other}/x", f"/{job}/x", f"{job}//x", f"{job}/n0/./x"):
            assert ask(http, job, "n0", "1", ("GET", bad)).status_code == 422, bad
        assert http.post(f"/v1/jobs/{job}/nodes/n0/attempts", json={}).json()["attempt"] == "2"
        fenced = ask(http, job, "n0", "1", ("PUT", own))
        assert fenced.status_code == 409 and fenced.json()["error"] == "fenced"
        assert ask(http, job, "n0", "2", ("PUT", own.replace("/1/tensors", "/2/tensors"))).status_code == 200
        assert ask(http, job, "n0", "1-abcdef12", ("GET", own)).status_code == 409, "offline attempts sign nothing"
        assert ask(http, job, "stranger", "1", ("GET", own)).status_code == 422
        assert ask(http, "no-such-job", "n0", "1", ("GET", own)).status_code == 404
        local = f"local-{uuid.uuid4().hex[:6]}"
        builders.declare(http, live.settings.default_storage, local, ["n0"])
        http.post(f"/v1/jobs/{local}/nodes/n0/attempts", json={})
        answer = ask(http, local, "n0", "1", ("GET", f"{local}/n0/x"))
        assert answer.status_code == 422 and "s3://" in answer.text


def test_a_fork_reads_the_job_it_was_forked_from(signing_service):
    live, root = signing_service
    with live.client() as http:
        parent = started_job(http, root, nodes=("n0",))
        key = f"{CopyKey(parent, 'n0', Position(0), '1').relpath}/manifest.json"
        http.post(
            f"/v1/jobs/{parent}/nodes/n0/checkpoints", json=builders.commit_body(f"{root}/{parent}", parent, "n0", 0)
        )
        child = started_job(http, root, nodes=("n0",), parent={"job": parent, "position": {"epoch": 0}})
        assert ask(http, child, "n0", "1", ("GET", key)).status_code == 200
        assert ask(http, child, "n0", "1", ("PUT", key)).status_code == 403, "but never writes there"
        marker = pool_reference(parent, "n0", child, "n0")
        assert ask(http, child, "n0", "1", ("PUT", marker)).status_code == 200, "but for its own marker"
        stranger = started_job(http, root, nodes=("n0",))
        assert ask(http, child, "n0", "1", ("PUT", pool_reference(stranger, "n0", child, "n0"))).status_code == 403


def wants(attempt, *objects: dict) -> dict:
    return {"attempt": attempt, "objects": list(objects)}


def test_listings_deletes_and_multipart_uploads_are_scoped_like_reads_and_writes(signing_service):
    live, root = signing_service
    with live.client() as http:
        job, other = started_job(http, root), started_job(http, root)
        urls = f"/v1/jobs/{job}/nodes/n0/urls"
        own = f"{CopyKey(job, 'n0', Position(2), '1').relpath}/manifest.json"
        allowed = [
            ("1", {"method": "LIST", "key": job, "delimiter": True}),
            ("1", {"method": "LIST", "key": f"{job}/n1", "continuation": "token"}),
            ("1", {"method": "HEAD", "key": own.replace("/n0/", "/n1/")}),
            ("1", {"method": "DELETE", "key": own.replace("/1/manifest", "/0/manifest")}),  # an older attempt's copy
            ("1", {"method": "DELETE", "key": blob_key(job, "n0", "ab" * 16)}),
            ("1", {"method": "POST", "key": own}),
            ("1", {"method": "PUT", "key": own, "upload_id": "u", "part": 3}),
            ("1", {"method": "POST", "key": own, "upload_id": "u"}),
            ("1", {"method": "DELETE", "key": own, "upload_id": "u"}),
            (None, {"method": "GET", "key": own}),
            (None, {"method": "LIST", "key": f"{job}/n0"}),
            (None, {"method": "PUT", "key": f"{job}/n0/.ckptstore-probe/abc"}),
            (None, {"method": "DELETE", "key": f"{job}/n0/.ckptstore-probe/abc"}),
        ]
        for attempt, wanted in allowed:
            answer = http.post(urls, json=wants(attempt, wanted))
            assert answer.status_code == 200, (wanted, answer.text)
        refused = [
            ("1", {"method": "LIST", "key": other}, 403),
            ("1", {"method": "DELETE", "key": own.replace("/n0/", "/n1/")}, 403),
            ("1", {"method": "DELETE", "key": f"{job}/n0"}, 403),
            ("1", {"method": "POST", "key": own.replace("/n0/", "/n1/")}, 403),
            (
                "1",
                {"method": "PUT", "key": own.replace("/1/manifest", "/0/manifest"), "upload_id": "u", "part": 1},
                403,
            ),
            ("1", {"method": "PUT", "key": f"{job}/n1/.ckptstore-probe/abc"}, 403),
            (None, {"method": "PUT", "key": own}, 422),
            (None, {"method": "DELETE", "key": own}, 422),
            ("1", {"method": "GET", "key": own, "part": 1}, 422),
            ("1", {"method": "PUT", "key": own, "upload_id": "u"}, 422),
            ("1", {"method": "GET", "key": own, "delimiter": True}, 422),
        ]
        for attempt, wanted, status in refused:
            answer = http.post(urls, json=wants(attempt, wanted))
            assert answer.status_code == status, (wanted, answer.text)
        signed = http.post(urls, json=wants("1", {"method": "LIST", "key": job, "delimiter": True})).json()["urls"][0]
        query = dict(parse_qsl(urlsplit(signed["url"]).query))
        assert query["prefix"] == f"{job}/{job}/" and query["delimiter"] == "/", "a listing never reaches past the job"
        assert signature_matches(signed["url"], "GET", {})
        complete = http.post(
            urls, json=wants("1", {"method": "POST", "key": blob_key(job, "n0", "cd" * 16), "upload_id": "u"})
        )
        assert complete.json()["urls"][0]["headers"] == {"If-None-Match": "*"}, (
            "a blob's multipart upload is create-only"
        )


@pytest.fixture(scope="module")
def gcs_signing_service(tmp_path_factory, gcs_emulator):
    """The service signing for the GCS emulator with a service account of its own (a fresh RSA key)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    tmp = tmp_path_factory.mktemp("presign-gcs")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    account = {
        "type": "service_account",
        "project_id": "test",
        "private_key_id": "k1",
        "private_key": pem,
        "client_email": "ckptstore@test.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": "https://oauth2.googleapis.com/token",
    }
    path = tmp / "account.json"
    path.write_text(json.dumps(account))
    options = {f"gs://{gcs_emulator.bucket}": {"endpoint_url": gcs_emulator.endpoint_url, "token": str(path)}}
    settings = service_settings(
        str(tmp), f"sqlite:///{tmp}/db.sqlite", storage_options=options, storage_roots=f"gs://{gcs_emulator.bucket}"
    )
    live = LiveService(settings)
    yield live, f"gs://{gcs_emulator.bucket}", key.public_key()
    live.stop()


def gcs_signature_valid(url: str, method: str, headers: dict[str, str], public_key) -> bool:
    """Whether `url` carries a GOOG4-RSA-SHA256 signature of its own canonical request (GCS's V4 scheme,
    rebuilt here from the URL) by the service account's key."""
    import hashlib
    from urllib.parse import quote

    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    signature = dict(query)["X-Goog-Signature"]
    kept = sorted((k, v) for k, v in query if k != "X-Goog-Signature")
    canonical_query = "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in kept)
    signed = {"host": parts.netloc} | {k.lower(): v for k, v in headers.items()}
    names = dict(query)["X-Goog-SignedHeaders"]
    if any(name not in signed for name in names.split(";")):
        return False  # a header the signature covers is not sent
    canonical_headers = "".join(f"{name}:{signed[name]}\n" for name in names.split(";"))
    request = "\n".join([method, parts.path, canonical_query, canonical_headers, names, "UNSIGNED-PAYLOAD"])
    scope = dict(query)["X-Goog-Credential"].split("/", 1)[1]
    to_sign = "\n".join(
        ["GOOG4-RSA-SHA256", dict(query)["X-Goog-Date"], scope, hashlib.sha256(request.encode()).hexdigest()]
    )
    try:
        public_key.verify(bytes.fromhex(signature), to_sign.encode(), padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        return False
    return True


def test_gcs_urls_are_v4_signed_by_the_service_account_and_scoped_alike(gcs_signing_service):
    """GCS roots get V4 signed URLs (GOOG4-RSA-SHA256) with the same scope as S3's. The emulator here
    (gcp-storage-emulator) serves the XML API's plain GET (ranges too) and PUT of `/bucket/object`
    and checks no signature, no expiry and no precondition — and has no XML listing, HEAD, DELETE
    or multipart upload; so the signatures are checked here against the account's public key, and
    those requests only as far as their URLs."""
    live, root, public_key = gcs_signing_service
    with live.client() as http:
        job = started_job(http, root)
        manifest = f"{CopyKey(job, 'n0', Position(0), '1').relpath}/manifest.json"
        blob = blob_key(job, "n0", "ef" * 16)
        answer = ask(http, job, "n0", "1", ("PUT", manifest), ("GET", manifest), ("PUT", blob))
        assert answer.status_code == 200, answer.text
        put, get, put_blob = answer.json()["urls"]
        assert urlsplit(put["url"]).path == f"/{root.removeprefix('gs://')}/{job}/{manifest}"
        assert httpx.put(put["url"], content=b"the manifest").status_code == 200
        assert httpx.get(get["url"]).content == b"the manifest"
        assert httpx.get(get["url"], headers={"Range": "bytes=4-11"}).content == b"manifest"
        assert put_blob["headers"] == {"x-goog-if-generation-match": "0"}, "a blob's upload is create-only"
        for url, method, headers in ((put, "PUT", {}), (get, "GET", {}), (put_blob, "PUT", put_blob["headers"])):
            assert gcs_signature_valid(url["url"], method, headers, public_key), url["url"]
        assert not gcs_signature_valid(put_blob["url"], "PUT", {}, public_key), "the precondition is signed"
        elsewhere = put["url"].replace(f"/{job}/n0/", f"/{job}/n1/")
        assert not gcs_signature_valid(elsewhere, "PUT", {}, public_key), "the signature covers the object"
        forged = re.sub(r"X-Goog-Signature=[0-9a-f]+", "X-Goog-Signature=" + "0" * 512, get["url"])
        assert not gcs_signature_valid(forged, "GET", {}, public_key)
        assert httpx.get(forged).content == b"the manifest", "the emulator checks no signature: these tests do"
        listing = http.post(
            f"/v1/jobs/{job}/nodes/n0/urls",
            json=wants("1", {"method": "LIST", "key": job, "delimiter": True}, {"method": "POST", "key": blob}),
        ).json()["urls"]
        query = dict(parse_qsl(urlsplit(listing[0]["url"]).query, keep_blank_values=True))
        assert (query["list-type"], query["prefix"], query["delimiter"]) == ("2", f"{job}/{job}/", "/")
        assert gcs_signature_valid(listing[0]["url"], "GET", {}, public_key)
        assert "uploads" in dict(parse_qsl(urlsplit(listing[1]["url"]).query, keep_blank_values=True))
        assert gcs_signature_valid(listing[1]["url"], "POST", {}, public_key)
        assert ask(http, job, "n0", "1", ("PUT", manifest.replace("/n0/", "/n1/"))).status_code == 403
