"""One router per resource under /v1, plus the unversioned operations endpoints."""

from server.routes import attempts, checkpoints, gc, health, jobs, ops, stats

ROUTERS = [jobs.router, attempts.router, checkpoints.router, health.router, stats.router, gc.router, ops.router]

__all__ = ["ROUTERS"]
