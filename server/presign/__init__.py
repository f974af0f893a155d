"""Short-lived URLs signed with the service's own storage credentials (S3 SigV4, GCS V4)."""

__all__: list[str] = []
