"""Real storage servers on loopback for the tests: moto's S3 server and the GCS emulator."""

from __future__ import annotations

import os
import socket

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported (FACTS.md)
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")


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
