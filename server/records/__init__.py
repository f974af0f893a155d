"""The service's rules over its records: jobs and commits, attempts, the last-good judge, lineage, the
group commit, cached answers, telemetry and operations advice."""

__all__: list[str] = []
