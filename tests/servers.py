"""Real servers on loopback for the tests: moto's S3 server, the GCS emulator and nginx (a round-robin
proxy of the service, and a proxy of moto that logs every S3 request)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import textwrap
import time

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported (FACTS.md)
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MotoS3:
    """moto's ThreadedMotoServer on 127.0.0.1 with one bucket."""

    bucket = "ckpt"

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        self.options = {"endpoint_url": self.endpoint_url, "key": "testing", "secret": "testing"}
        import s3fs

        try:  # moto's backends are process-global: a second server in this process sees the bucket
            s3fs.S3FileSystem(skip_instance_cache=True, **self.options).mkdir(self.bucket)
        except FileExistsError:
            pass

    def stop(self) -> None:
        self.server.stop()


class GcsEmulator:
    """gcp-storage-emulator in memory on 127.0.0.1 with one bucket."""

    bucket = "ckpt"

    def __init__(self) -> None:
        from gcp_storage_emulator.server import create_server

        port = free_port()
        self.server = create_server("127.0.0.1", port, in_memory=True, default_bucket=self.bucket)
        self.server.start()
        self.endpoint_url = f"http://127.0.0.1:{port}"
        os.environ["STORAGE_EMULATOR_HOST"] = self.endpoint_url
        self.options = {"endpoint_url": self.endpoint_url, "token": "anon"}

    def stop(self) -> None:
        self.server.stop()


@contextlib.contextmanager
def tmpfs(mountpoint: str, size: str):
    """A tmpfs of `size` mounted at `mountpoint` for the block (a disk that fills up, or can turn
    read-only: root ignores chmod). Mounting needs root, as CI runs."""
    import pytest

    os.makedirs(mountpoint)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mountpoint], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", mountpoint], check=False)


def nginx_location() -> str:
    """The `location /` block of docs/operations.md ("Scaling out"): the tested config is the documented one."""
    with open(os.path.join(ROOT, "docs", "operations.md"), encoding="utf-8") as handle:
        block = re.search(r"```nginx\n.*?(    location / \{.*?\n    \})", handle.read(), re.S)
    assert block, "docs/operations.md shows the nginx config with its `location /` block"
    return block.group(1)


class NginxProcess:
    """Debian's nginx on a free loopback port (`port`), its files under `prefix`: `start` writes its config
    around the body of an `http` block and waits until it `answers`."""

    def start(self, prefix: str, http_block: str, *, worker_connections: int = 1024) -> None:
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        if not os.path.exists(binary):
            raise RuntimeError("nginx is not installed: scripts/test.sh installs Debian's nginx")
        os.makedirs(os.path.join(prefix, "logs"), exist_ok=True)
        config = os.path.join(prefix, "nginx.conf")
        with open(config, "w", encoding="utf-8") as handle:
            handle.write(
                f"worker_processes 1;\nerror_log {prefix}/logs/error.log;\npid {prefix}/nginx.pid;\n"
                f"events {{ worker_connections {worker_connections}; }}\nhttp {{\n"
                f"    client_body_temp_path {prefix}/body;\n    proxy_temp_path {prefix}/proxy;\n{http_block}}}\n"
            )
        self.process = subprocess.Popen([binary, "-p", prefix, "-c", config, "-g", "daemon off;"])
        deadline = time.monotonic() + 20
        while not self.answers():
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"nginx did not start (see {prefix}/logs/error.log)")
            time.sleep(0.05)

    def answers(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=20)


class Nginx(NginxProcess):
    """A round-robin proxy (the documented `location /`) in front of `upstreams` ("127.0.0.1:port")."""

    def __init__(self, prefix: str, upstreams: list[str], *, worker_connections: int = 1024):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        servers = "\n".join(f"        server {u};" for u in upstreams)
        http_block = (
            "    access_log off;\n"
            "    client_body_buffer_size 1m;  # a 4,096-node job's declaration stays in memory\n"
            f"    upstream ckptstore {{\n{servers}\n        keepalive 64;\n    }}\n"
            f"    server {{\n        listen 127.0.0.1:{self.port};\n"
            + textwrap.indent(nginx_location(), "    ")
            + "\n    }\n"
        )
        self.start(prefix, http_block, worker_connections=worker_connections)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                return sock.recv(12).startswith(b"HTTP/1.1 200")
        except OSError:
            return False


class S3RequestLog(NginxProcess):
    """A proxy in front of moto (`upstream`, "127.0.0.1:port") that writes one line per S3 request to
    `requests()`: "<method> <path> <status>" — what a job read from the durable tier, counted."""

    def __init__(self, prefix: str, upstream: str):
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.log = os.path.join(prefix, "logs", "s3.log")
        http_block = textwrap.indent(
            textwrap.dedent(
                f"""\
                log_format requests '$request_method $uri $status';
                access_log {self.log} requests;
                server {{
                    listen 127.0.0.1:{self.port};
                    client_max_body_size 0;
                    location / {{
                        proxy_pass http://{upstream};
                        proxy_http_version 1.1;
                        proxy_set_header Host $http_host;
                        proxy_set_header Connection "";
                        proxy_request_buffering off;
                        proxy_buffering off;
                    }}
                }}
                """
            ),
            "    ",
        )
        self.start(prefix, http_block)

    def requests(self) -> list[str]:
        """Every request logged so far (nginx writes each line as the request ends)."""
        with open(self.log, encoding="utf-8") as handle:
            return handle.read().splitlines()
