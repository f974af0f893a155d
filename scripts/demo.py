"""The main job on the embedded defaults: the service on SQLite + local storage, a short Keras
training that is SIGKILLed mid-epoch, and a rerun that resumes from the last good position.

    python scripts/demo.py [WORKDIR]

Prints what happened: the positions saved, the resume position, the service's REST answer for the
last good epoch, and where the blobs are. Everything lives under WORKDIR (default: a temp dir).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

JOB, EPOCHS, KILL_AT = "demo", 6, (3, 14)  # killed before epoch 3's 15th of 16 batches


def train(service: str, storage: str, kill_at: tuple[int, int] | None, job: str = JOB, node: str = "worker-0") -> None:
    """One training process (run as a child, or as a container's command: deploy/): Keras fit with
    ckptstore's BackupAndRestore."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    from ckptstore.client.keras import BackupAndRestore

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 32)).astype("float32")
    y = (x @ rng.standard_normal((32, 1))).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    backup = BackupAndRestore(
        service=service, storage=storage, job=job, node=node, save_freq=4, delete_checkpoint=False
    )

    class Report(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            where = backup.resume_position
            print(
                f"[train] {'fresh start' if where is None else f'resumed from {where}'} "
                f"(attempt {backup.checkpointer.attempt})",
                flush=True,
            )

        def on_epoch_end(self, epoch, logs=None):
            print(f"[train] epoch {epoch} done, loss {logs['loss']:.4f}", flush=True)

        def on_train_batch_begin(self, batch, logs=None):
            if kill_at is not None and (self.epoch, batch) == kill_at:
                print(f"[train] preempted: SIGKILL at epoch {kill_at[0]} batch {kill_at[1]}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    model.fit(x, y, batch_size=32, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[backup, Report()])


def get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ckptstore-demo-")
    storage = os.path.join(work, "checkpoints")
    port = free_port()
    service = f"http://127.0.0.1:{port}"
    env = os.environ | {
        "CKPTSTORE_DB_URL": f"sqlite:///{work}/ckptstore.db",
        "CKPTSTORE_STORAGE": storage,
        "CKPTSTORE_PORT": str(port),
        "CKPTSTORE_LOG_LEVEL": "warning",
    }
    print(f"[demo] starting the service on {service} (SQLite: {work}/ckptstore.db, storage: {storage})")
    server = subprocess.Popen([sys.executable, "-m", "ckptstore.server"], env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                get(f"{service}/readyz")
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("[demo] the service did not start")
                time.sleep(0.1)
        me = [sys.executable, __file__, "--train", service, storage]
        first = subprocess.run([*me, f"{KILL_AT[0]},{KILL_AT[1]}"])
        print(f"[demo] first run ended by signal {-first.returncode}")
        records = get(f"{service}/v1/jobs/{JOB}/checkpoints")
        saved = [f"({r['epoch']}, {r['batch']})" for r in records]
        print(f"[demo] positions saved before the crash: {' '.join(saved)}")
        answer = get(f"{service}/v1/jobs/{JOB}/last-good-epoch")
        print(f"[demo] GET /v1/jobs/{JOB}/last-good-epoch -> {json.dumps(answer)}")
        subprocess.run([*me, "-"], check=True)
        answer = get(f"{service}/v1/jobs/{JOB}/last-good-epoch")
        print(f"[demo] after the rerun: last good epoch {answer['epoch']}, resume position {answer['resume']}")
        for attempt in get(f"{service}/v1/jobs/{JOB}/attempts"):
            print(f"[demo] attempt {attempt['attempt']} of {attempt['node']} resumed from {attempt['resumed_from']}")
        location = answer["nodes"]["worker-0"]["location"]
        print(f"[demo] blobs of the last good checkpoint: {location}")
        for name in sorted(os.listdir(location)):
            print(f"         {name}  {os.path.getsize(os.path.join(location, name))} bytes")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        print("[demo] service stopped")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--train":
        # --train SERVICE STORAGE KILL|- [JOB [NODE]]
        service, storage, kill, *names = sys.argv[2:]
        train(service, storage, None if kill == "-" else tuple(int(v) for v in kill.split(",")), *names)
    else:
        main()
