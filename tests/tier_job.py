"""A node that saves to a local tier replicated to S3 (run as a subprocess, to be SIGKILLed).

    python -m tests.tier_job LOCAL DURABLE ENDPOINT SERVICE JOB EPOCHS

Saves EPOCHS end-of-epoch positions of `arrays_for(epoch, size=2_500_000)` (40 MB each) and prints
`LOCAL <epoch>` as soon as each is committed on the local tier (replication goes on behind), then
`DONE` once everything is replicated and recorded.
"""

from __future__ import annotations

import sys

from ckptstore import Position
from ckptstore.client.engine.node import NodeCheckpointer
from tests.builders import arrays_for

local, durable, endpoint, service, job, epochs = sys.argv[1:7]
node = NodeCheckpointer(
    job=job,
    storage=durable,
    local_storage=local,
    storage_options={"endpoint_url": endpoint, "key": "testing", "secret": "testing"},
    service=service,
    node="n0",
)
node.start()
for epoch in range(int(epochs)):
    node.save(Position(epoch), arrays_for(epoch, size=2_500_000))
    node.wait_for_write()
    print(f"LOCAL {epoch}", flush=True)
node.close()
print("DONE", flush=True)
