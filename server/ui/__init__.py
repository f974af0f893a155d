"""The web dashboard: server-rendered pages, what they show, and the aggregate view of large jobs."""

__all__: list[str] = []
