"""Shared fixtures: real storage backends (local disk, moto S3, GCS emulator) as session servers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.servers import GcsEmulator, MotoS3  # noqa: I001  (sets env before gcsfs is imported)


@dataclass
class Backend:
    """A storage root URL on one backend plus the options to open it; a fresh prefix per test."""

    name: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    server = MotoS3()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GcsEmulator]:
    server = GcsEmulator()
    yield server
    server.stop()


@pytest.fixture(params=["local", "s3", "gcs"])
def backend(request: pytest.FixtureRequest, tmp_path) -> Backend:
    """Each contract test runs on every backend, against a real server where there is one."""
    prefix = uuid.uuid4().hex
    if request.param == "local":
        return Backend("local", str(tmp_path / prefix))
    if request.param == "s3":
        server = request.getfixturevalue("moto_s3")
        return Backend("s3", f"s3://{server.bucket}/{prefix}", dict(server.options))
    server = request.getfixturevalue("gcs_emulator")
    return Backend("gcs", f"gs://{server.bucket}/{prefix}", dict(server.options))


# -- the metadata service, on SQLite and on PostgreSQL ------------------------------------------


@dataclass
class Service:
    """A live service plus what tests need to know about it."""

    name: str
    live: Any
    storage: str

    def client(self, **kwargs):
        return self.live.client(**kwargs)


def service_settings(tmp: str, db_url: str, **overrides) -> Any:
    from ckptstore.server.settings import Settings

    storage = f"{tmp}/storage"
    return Settings(
        **{"db_url": db_url, "storage": storage, "storage_roots": f"{storage},s3://ckpt,memory://ckpt"} | overrides
    )


@pytest.fixture(scope="session")
def sqlite_service(tmp_path_factory) -> Iterator[Service]:
    from tests.live import LiveService

    tmp = str(tmp_path_factory.mktemp("sqlite-service"))
    live = LiveService(service_settings(tmp, f"sqlite:///{tmp}/service.db"))
    yield Service("sqlite", live, f"{tmp}/storage")
    live.stop()


@pytest.fixture(scope="session")
def postgres_service(tmp_path_factory) -> Iterator[Service]:
    from tests.live import LiveService, ScratchPostgres, postgres_available

    if not postgres_available():
        pytest.fail("PostgreSQL is not reachable on 127.0.0.1:5432 and could not be started")
    database = ScratchPostgres()
    tmp = str(tmp_path_factory.mktemp("pg-service"))
    live = LiveService(service_settings(tmp, database.url))
    yield Service("postgres", live, f"{tmp}/storage")
    live.stop()
    database.drop()


@pytest.fixture(params=["sqlite", "postgres"])
def service(request) -> Service:
    """Each service test runs against SQLite and PostgreSQL."""
    return request.getfixturevalue(f"{request.param}_service")


@pytest.fixture
def job_name() -> str:
    return f"job-{uuid.uuid4().hex[:12]}"


# Long variants of checks whose other variants stay in the default run (another Keras backend, another
# storage or loader of the same loop, a second DCP world size, a second compose/deploy/presigned
# scenario): marked slow here so the default run keeps near 30 minutes on 2 cores (the slowest 40 of
# `bash scripts/test.sh --durations`); `bash scripts/test.sh -m slow` runs them.
LONG_VARIANTS = {
    "tests/test_resume_matrix.py::test_a_resume_is_called_exact_only_when_bit_equal_and_a_bit_equal_one_never_drift[torch-docs-after-epoch-end]",
    "tests/test_resume_matrix.py::test_a_resume_is_called_exact_only_when_bit_equal_and_a_bit_equal_one_never_drift[torch-stateful-after-epoch-end]",
    "tests/test_resume_matrix.py::test_a_resume_is_called_exact_only_when_bit_equal_and_a_bit_equal_one_never_drift[torch-shuffle-gen-after-epoch-end]",
    "tests/test_resume_matrix.py::test_a_resume_is_called_exact_only_when_bit_equal_and_a_bit_equal_one_never_drift[torch-plain-last-batch]",
    "tests/test_resume_matrix.py::test_a_resume_is_called_exact_only_when_bit_equal_and_a_bit_equal_one_never_drift[torch-stateful-last-batch]",
    "tests/test_resume_matrix.py::test_a_resume_is_called_exact_only_when_bit_equal_and_a_bit_equal_one_never_drift[torch-shuffle-gen-last-batch]",
    "tests/test_training.py::test_keras_on_the_jax_and_pytorch_backends_resumes_mid_epoch_bit_equal[jax]",
    "tests/test_training.py::test_keras_on_the_jax_and_pytorch_backends_resumes_mid_epoch_bit_equal[torch]",
    "tests/test_training.py::test_keras_as_users_write_it_shuffled_with_unseeded_dropout_resumes_bit_equal[mid-epoch-torch]",
    "tests/test_training.py::test_keras_as_users_write_it_shuffled_with_unseeded_dropout_resumes_bit_equal[mid-epoch-jax]",
    "tests/test_training.py::test_keras_as_users_write_it_shuffled_with_unseeded_dropout_resumes_bit_equal[epoch-end-torch]",
    "tests/test_training.py::test_keras_as_users_write_it_shuffled_with_unseeded_dropout_resumes_bit_equal[epoch-end-jax]",
    "tests/test_training.py::test_killed_and_resumed_training_is_bit_equal_to_uninterrupted[keras-every-4-batches-spe-2]",
    "tests/test_training.py::test_killed_and_resumed_training_is_bit_equal_to_uninterrupted[custom-loop]",
    "tests/test_training.py::test_multi_worker_only_the_chief_writes_and_both_restore_the_same_position[restore-outside-the-scope]",
    "tests/test_torch.py::test_a_loop_killed_mid_epoch_resumes_bit_exactly[s3-stateful-False]",
    "tests/test_torch.py::test_a_loop_killed_mid_epoch_resumes_bit_exactly[s3-plain-True]",
    "tests/test_torch.py::test_a_loop_killed_mid_epoch_resumes_bit_exactly[local-stateful-True]",
    "tests/test_torch.py::test_dcp_saved_by_two_ranks_loads_exactly_on_one_and_on_four[4]",
    "tests/test_torch.py::test_per_rank_state_a_rank_dying_before_its_commit_leaves_the_position_not_good",
    "tests/test_exact_resume.py::test_ddp_with_replicated_state_restores_every_rank_its_own_rng[per-rank seeds]",
    "tests/test_compose.py::test_the_trainer_holds_no_credentials_and_is_killed_and_resumed_through_signed_urls",
    "tests/test_presigned_path.py::test_keras_with_a_local_tier_replicates_and_a_new_machine_resumes_through_urls",
    "tests/test_deploy.py::test_the_slurm_script_saves_on_sigterm_requeues_resumes_and_never_requeues_a_refusal",
    "tests/test_fallback.py::test_three_nodes_with_one_corrupt_part_all_resume_from_the_same_older_position",
    "tests/test_manifest.py::test_mutated_real_manifests_are_refused_or_identical",
    "tests/test_training_polish.py::test_health_says_ok_after_storage_recovers_and_for_nodes_that_never_failed",
    "tests/test_replica_agreement.py::test_an_hsdp_replica_that_differs_is_named_its_save_is_not_good_and_loads_go_to_the_save_before",
    "tests/test_lightning.py::test_a_fit_killed_resumes_bit_exactly[epoch-end-stateful-loader]",
    "tests/test_lightning.py::test_saves_due_at_an_epochs_last_batch_are_epoch_ends_and_every_kill_point_resumes_exactly[killed-at-an-epochs-last-batch-stateful]",
    "tests/test_lightning.py::test_saves_due_at_an_epochs_last_batch_are_epoch_ends_and_every_kill_point_resumes_exactly[killed-right-after-an-epoch-end-stateful]",
    "tests/test_lightning.py::test_saves_due_at_an_epochs_last_batch_are_epoch_ends_and_every_kill_point_resumes_exactly[killed-right-after-an-epoch-end-plain]",
    "tests/test_hf.py::test_a_trainer_killed_on_a_machine_that_is_gone_resumes_bit_exactly[right-after-an-epoch-end]",
    "tests/test_elastic_resume.py::test_a_restart_on_another_world_size_trains_every_sample_of_the_epoch_once[4-to-2]",
    "tests/test_elastic_resume.py::test_a_trainer_restarted_on_another_world_size_trains_every_sample_once[hf-1-to-2]",
    "tests/test_elastic_resume.py::test_a_trainer_restarted_on_another_world_size_trains_every_sample_once[lightning-1-to-2]",
    "tests/test_training.py::test_killed_and_resumed_training_is_bit_equal_to_uninterrupted[keras-every-4-batches]",
    "tests/test_docs_code.py::test_a_documented_loop_killed_mid_epoch_resumes_bit_exactly[jax-loop]",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in LONG_VARIANTS:
            item.add_marker(pytest.mark.slow)
    # A variant renamed or gone would silently run in the default run again: in a run of whole files
    # (no -k, no test ids), each one named for a collected file must be there.
    if config.option.keyword or any("::" in arg for arg in config.args):
        return
    ids, files = {item.nodeid for item in items}, {item.nodeid.split("::")[0] for item in items}
    stale = sorted(v for v in LONG_VARIANTS if v.split("::")[0] in files and v not in ids)
    if stale:
        raise pytest.UsageError(f"LONG_VARIANTS names tests that are not collected: {stale}")
