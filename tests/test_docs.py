"""The docs match the code: README's commands, the CLI's --help, every CKPTSTORE_* setting and
every REST operation of the OpenAPI document."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest

from ckptstore.client.cli.main import build_parser
from ckptstore.server.__main__ import build_parser as build_serve_parser
from ckptstore.server.settings import Settings
from tests.conftest import service_settings
from tests.live import LiveService

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        return handle.read()


def code_blocks(text: str, after: str) -> str:
    """The first ```bash block after the heading `after`."""
    section = text[text.index(after) :]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_readme_opens_with_the_two_commands():
    first = code_blocks(read("README.md"), "# ckptstore")
    commands = [line.split("#")[0].strip() for line in first.strip().splitlines()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert "bash scripts/test.sh" in read(".ci/run")
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert subprocess.run(["bash", "-n", os.path.join(ROOT, script)]).returncode == 0


def test_every_command_and_option_is_documented_and_its_help_works():
    docs = read("docs/cli.md")
    assert "`--url URL`" in docs and "`--token TOKEN`" in docs, "the service options are documented once"
    for name, parser in subcommands().items():
        heading = f"### ckptstore {name}\n"
        assert heading in docs, f"docs/cli.md lacks {heading.strip()}"
        section = docs.split(heading, 1)[1].split("\n### ", 1)[0]
        options = build_serve_parser()._actions if name == "serve" else parser._actions
        for action in options:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help" and flag not in ("--url", "--token"):
                    assert f"`{flag}`" in section, f"{flag} of `ckptstore {name}` is not in docs/cli.md"
    for argv in (["--help"], ["serve", "--help"], *[[name, "--help"] for name in subcommands() if name != "serve"]):
        result = subprocess.run([os.path.join(BIN, "ckptstore"), *argv], capture_output=True, text=True)
        assert result.returncode == 0 and "usage: ckptstore" in result.stdout, (argv, result.stderr)


def test_every_setting_is_documented_and_nothing_else():
    docs = read("docs/configuration.md")
    service_table = docs.split("## The service", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(CKPTSTORE_[A-Z_]+)`", service_table, re.M))
    assert documented == {f"CKPTSTORE_{field.upper()}" for field in Settings.model_fields}
    client_table = docs.split("## Training processes", 1)[1].split("\n## ", 1)[0]
    used = set()
    for package in ("client", "ckptstore"):
        for directory, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(directory, d))]
            for name in files:
                if name.endswith(".py"):
                    used |= set(re.findall(r"\"(CKPTSTORE_[A-Z_]+)\"", read(os.path.join(directory, name))))
    assert used and used == set(re.findall(r"^\| `(CKPTSTORE_[A-Z_]+)`", client_table, re.M))


def test_rest_docs_list_exactly_the_openapi_operations():
    from ckptstore.server.app import create_app

    spec = create_app(Settings(db_url="sqlite://")).openapi()
    actual = {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops}
    table = read("docs/rest.md").split("| method, path | purpose |", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"`(GET|PUT|POST|DELETE|PATCH) (/[^`\s]*)`", table))
    assert documented == actual, f"undocumented: {actual - documented}; not in the API: {documented - actual}"


@pytest.mark.parametrize("doc, heading", [("README.md", "### 4. REST with curl"), ("docs/rest.md", "## A session")])
def test_documented_curl_and_cli_commands_run_against_a_live_service(tmp_path, doc, heading):
    from ckptstore import Store
    from ckptstore.client.service.rest import ServiceClient

    live = LiveService(service_settings(str(tmp_path), f"sqlite:///{tmp_path}/docs.db"))
    try:
        with ServiceClient(live.url) as client:  # a job the README's commands can query: one node, one good epoch
            client.put_job("mnist", ["worker-0"], storage_root=live.settings.default_storage)
            if doc == "README.md":
                attempt = client.start_attempt("mnist", "worker-0")
                store = Store(live.settings.default_storage)
                client.commit(store.save("mnist", "worker-0", 0, {"w": [1.0, 2.0]}, attempt=attempt))
        script = code_blocks(read(doc), heading).replace("localhost:8080", f"127.0.0.1:{live.port}")
        env = os.environ | {"CKPTSTORE_URL": live.url, "PATH": f"{BIN}:{os.environ['PATH']}"}
        for line in [ln for ln in script.replace("\\\n", " ").splitlines() if ln.strip()]:
            result = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env, timeout=60)
            assert result.returncode == 0, f"{doc}: {line}\n{result.stdout}\n{result.stderr}"
    finally:
        live.stop()


def test_every_file_the_readme_links_exists():
    links = re.findall(r"\]\(((?!https?://|#)[^)]+)\)", read("README.md"))
    assert len(links) >= 15, "the README's 'Where things live' table links the files"
    missing = [link for link in links if not os.path.exists(os.path.join(ROOT, link.split("#")[0]))]
    assert not missing, missing
