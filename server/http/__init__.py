"""The HTTP edge of the service: auth, middleware, the request-head cap, origin checks, the hot paths
answered before routing, paging."""

__all__: list[str] = []
