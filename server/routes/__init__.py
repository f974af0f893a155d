"""One router per resource under /v1, plus the unversioned operations endpoints."""

from ckptstore.server.routes import (
    attempts,
    checkpoint_requests,
    checkpoints,
    events,
    health,
    jobs,
    ops,
    peers,
    retention,
    stats,
    urls,
    webhooks,
)

# The hot last-good route is matched first (routes are matched in order).
ROUTERS = [
    checkpoints.router,
    jobs.router,
    attempts.router,
    checkpoint_requests.router,
    health.router,
    stats.router,
    retention.router,
    events.router,
    webhooks.router,
    urls.router,
    peers.router,
    ops.router,
]

__all__ = ["ROUTERS"]
