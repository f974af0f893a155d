"""Events: the durable event log, the streams that fan it out, webhook deliveries and replication events."""

__all__: list[str] = []
