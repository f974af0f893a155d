"""One router per resource under /v1, plus the unversioned operations endpoints."""

from server.routes import attempts, checkpoints, gc, health, jobs, ops, stats

# The hot last-good route is matched first (routes are matched in order).
ROUTERS = [checkpoints.router, jobs.router, attempts.router, health.router, stats.router, gc.router, ops.router]

__all__ = ["ROUTERS"]
