"""Every command block of README.md and docs/*.md runs as written, against a tiny campaign (issue 26).

How a documented command is run (the rule a page's author writes against):

1. A command block is a ```` ```bash ```` fence; ```` ```text ```` and ```` ```yaml ```` fences show output or files and
   are never run. A fence right after a line ``<!-- not run: REASON -->`` is skipped: :data:`NOT_RUN` lists every
   such block, so a new one fails :func:`test_every_command_block_is_run_or_listed_as_not_run` until it is added.
   Each line is one command (a line ending in ``\\`` continues on the next); comment lines are dropped.
2. Commands run with bash in a scratch folder: ``.venv`` is this checkout's, the code is this checkout's
   (``PYTHONPATH``), ``PREFECT_HOME`` is the scratch folder's. README.md's commands start their own temporary Prefect
   server, as a newcomer's do; a docs page's commands talk to the one Prefect server this test starts
   (``PREFECT_API_URL``; issue 41: a temporary server costs a command about 10 s of CPU), but on a page that starts
   its own (``prefect server start``). ``configs/`` holds every ``configs/*.yaml``
   **shrunk to the tiny campaign's sizes**: ``configs/tiny.yaml``'s ``sizes``, ``sampling``, ``reward_model`` and
   ``ppo`` settings over each file's own, everything else (campaign, iterations, demo, labeler, reward,
   estimator) kept. So ``rlhf run --config configs/demo.yaml`` runs the demo's 8 iterations at the tiny size.
3. README.md runs first, from an empty scratch folder (its first block runs the demo campaign). Each docs page
   then runs from the state README.md left, restored in place before the page, so what one page does (a new
   campaign, ``rlhf gc``) never reaches another.
4. :data:`SUBSTITUTIONS` rewrite a few commands, each for the reason it gives; the placeholders
   ``<replay run id>`` and ``<replay run ids>`` are the replay run ids the page's commands printed so far (the
   last one, all of them), and ``<iteration run id>`` is the newest iteration run of the campaign ``demo``.
5. ``export NAME=VALUE`` sets the environment for the rest of its page. A command that serves until stopped
   (:data:`SERVERS`) runs in the background until its page ends, then gets SIGINT; the next command starts
   once it is ready (its port answers, or for ``rlhf serve`` once it says it is serving).
6. Every other command must exit 0 within :data:`TIMEOUT_S`.

Slow: CI runs it in its own step. Measured on the shared 2-core development machine under a load average of 15-20
(five other engineers' jobs): 44 minutes, of which README.md 6.6 (the demo world's pretraining and the demo campaign
4), scaling.md 10, estimators.md 7.6, operating.md 6.7, resume-replay.md 6.2.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 900
SHRUNK_SECTIONS = ("sizes", "sampling", "reward_model", "ppo")

NOT_RUN = {
    ("docs/engines.md", "the engine's own 3.5 GB environment; tests/flows/test_vllm_engine.py runs it in CI"),
    ("docs/operating.md", "the serve command above, with one more setting; the test runs that one"),
    (
        "docs/operating.md",
        "the serve command above, with the replay automation; tests/flows/test_prefect_mlflow_browser.py runs it",
    ),
    ("docs/human-labels.md", "waits for a person; tests/flows/test_human_labels.py and the browser test answer it"),
    ("docs/scaling.md", "needs other machines"),
    ("docs/scaling.md", "needs 8 GPUs and a 7 B model"),
    (
        "docs/scaling.md",
        "a server for other machines (0.0.0.0, /srv); tests/flows/test_tracking_server.py runs one locally",
    ),
    (
        "docs/real-model.md",
        "a 135 M model for several iterations, longer than a documented command may take; "
        "`python -m bench.real_model curve` runs it",
    ),
    ("docs/real-model.md", "a 135 M model's iteration, longer than a documented command may take"),
    (
        "docs/testing.md",
        "the whole default suite, longer than a documented command may take; CI's readme step runs it",
    ),
}
"""The blocks that are not run, by page and reason: keep them few."""


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


SUBSTITUTIONS = [
    (r"^bash scripts/setup\.sh && ", "", "the suite runs inside the environment setup.sh made (CI runs it first)"),
    (r"^bash scripts/test\.sh\b", None, "it runs the suite this test is part of (CI runs it)"),
    (
        r"execution\.device=cuda",
        "execution.device=cpu",
        "without a GPU, `execution.device=cuda` is refused; skipped only where torch sees none",
    ),
]
"""``(pattern, replacement, reason)``: a command matching ``pattern`` is rewritten (None: not run)."""

SERVERS = ("prefect server start", "mlflow server", "rlhf serve")
"""Commands that serve until stopped, by how they start (after environment assignments and ``.venv/bin/``)."""

PORTS = (4200, 5000)
"""The documented ports of the Prefect and MLflow servers: each page gets free ones instead, so the test never
meets a server already running on this machine."""


@dataclass
class Block:
    page: str
    commands: list[str]
    not_run: str | None = None


def command_blocks(page: Path) -> list[Block]:
    """The ```` ```bash ```` blocks of ``page``, their commands, and the reason of a ``not run`` marker."""
    name = str(page.relative_to(ROOT))
    blocks: list[Block] = []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        if lines[index].strip() != "```bash":
            index += 1
            continue
        marker = re.match(r"<!-- not run: (.+) -->", lines[index - 1].strip()) if index else None
        end = lines.index("```", index + 1)
        commands: list[str] = []
        pending = ""
        for line in lines[index + 1 : end]:
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            pending += line[:-1] + " " if line.endswith("\\") else line
            if not line.endswith("\\"):
                commands.append(pending.strip())
                pending = ""
        blocks.append(Block(name, commands, marker.group(1) if marker else None))
        index = end + 1
    return blocks


def test_every_command_block_is_run_or_listed_as_not_run():
    marked = {(block.page, block.not_run) for page in PAGES for block in command_blocks(page) if block.not_run}
    assert marked == NOT_RUN
    blocks = [block for page in PAGES for block in command_blocks(page)]
    assert all(block.commands for block in blocks)
    for block in blocks:  # a runnable command names files the checkout has (not `my.yaml`)
        for command in [] if block.not_run else block.commands:
            for path in re.findall(r"--config (\S+)", command):
                assert (ROOT / path).is_file(), f"{block.page}: `{command}` names {path}, which does not exist"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_of_the_pages_finds_its_file_and_heading():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name}: {target} does not exist"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
                assert anchor in {_anchor(heading) for heading in headings}, f"{page.name}: no heading for {target}"


def test_the_readme_stays_a_front_page():
    assert (ROOT / "README.md").stat().st_size <= 15 * 1024


# --- running them -------------------------------------------------------------------------------------------------


def _shrunk(config: dict, tiny: dict) -> dict:
    return {**config, **{section: {**config.get(section, {}), **tiny[section]} for section in SHRUNK_SECTIONS}}


def make_scratch(folder: Path) -> None:
    """The working folder of the documented commands: ``.venv`` and shrunk ``configs/`` (rule 2)."""
    folder.mkdir(parents=True)
    (folder / ".venv").symlink_to((ROOT / ".venv").resolve())
    (folder / "configs").mkdir()
    tiny = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        (folder / "configs" / path.name).write_text(yaml.safe_dump(_shrunk(config, tiny), sort_keys=False))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _answers(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Page:
    """One page's run: its environment, background servers and what its commands printed."""

    folder: Path
    env: dict[str, str]
    ports: dict[int, int] = field(default_factory=dict)
    servers: list[tuple[subprocess.Popen, Path]] = field(default_factory=list)
    replays: list[str] = field(default_factory=list)

    def prepare(self, command: str) -> str | None:
        """``command`` as it runs here (rules 4 and 5), or None where it is not run."""
        for pattern, replacement, _reason in SUBSTITUTIONS:
            if re.search(pattern, command):
                if replacement is None:
                    return None
                if pattern == r"execution\.device=cuda" and _has_cuda():
                    continue
                command = re.sub(pattern, replacement, command)
        for documented, port in self.ports.items():
            command = re.sub(rf"\b{documented}\b", str(port), command)
        if "<replay run id>" in command:
            command = command.replace("<replay run id>", self.replays[-1])
        if "<replay run ids>" in command:
            command = command.replace("<replay run ids>", " ".join(self.replays))
        if "<iteration run id>" in command:
            command = command.replace("<iteration run id>", self.newest_iteration("demo"))
        assert "<" not in command.split("#")[0].replace("<<", ""), f"a placeholder this test does not know: {command}"
        return command

    def newest_iteration(self, campaign: str) -> str:
        from campaign.config import load_config
        from campaign.store import resolve_run

        return resolve_run(load_config(None, [f"run_root={self.folder / '.rlhf'}"], store_only=True), campaign)

    def run(self, command: str) -> None:
        if command.startswith("export "):
            name, _, value = command.removeprefix("export ").partition("=")
            self.env[name] = shlex.split(value)[0] if value else ""
            return
        head = re.sub(r"^(\w+=\S+ )*(\.venv/bin/)?", "", command)
        if head.startswith(SERVERS):
            self.start_server(command, head)
            return
        started = time.monotonic()
        result = subprocess.run(
            ["bash", "-c", command], cwd=self.folder, env=self.env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
        output = result.stdout + result.stderr
        self.replays += re.findall(r"^Replay run (\w+);", result.stdout, flags=re.M)
        assert result.returncode == 0, f"`{command}` exited {result.returncode}:\n{output[-3000:]}"
        print(f"{time.monotonic() - started:6.1f} s  {command}")

    def start_server(self, command: str, head: str) -> None:
        log = self.folder / f"server-{len(self.servers)}.log"
        with log.open("w") as sink:
            process = subprocess.Popen(
                ["bash", "-c", command], cwd=self.folder, env=self.env, stdout=sink, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.servers.append((process, log))
        port = re.search(r"--port (\d+)", command)
        deadline = time.monotonic() + 180
        while not (_answers(int(port.group(1))) if port else "serving " in log.read_text()):
            assert process.poll() is None, f"`{command}` ended:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"`{command}` not ready in 180 s:\n{log.read_text()[-3000:]}"
            time.sleep(1)

    def stop_servers(self) -> None:
        for process, _log in reversed(self.servers):  # rlhf serve first: it pauses its deployments on the server
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


def starts_a_prefect_server(page: Path) -> bool:
    commands = [command for block in command_blocks(page) if not block.not_run for command in block.commands]
    return any("prefect server start" in command for command in commands)


def run_page(page: Path, folder: Path, prefect_api: str | None = None) -> None:
    """Run the page's commands in ``folder`` (rules 2-6), against the Prefect server at ``prefect_api`` if given."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(folder / "prefect-home"))
    if prefect_api is not None:
        env["PREFECT_API_URL"] = prefect_api
    state = Page(folder, env, ports={documented: _free_port() for documented in PORTS})
    try:
        for block in command_blocks(page):
            if block.not_run:
                continue
            for command in block.commands:
                if (prepared := state.prepare(command)) is not None:
                    state.run(prepared)
    finally:
        state.stop_servers()


@pytest.fixture(scope="module")
def prefect_api():
    """The one Prefect server of the docs pages' commands (rule 2), its database in the test run's PREFECT_HOME."""
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start(timeout=180)
    yield server.api_url
    server.stop()


@pytest.fixture(scope="module")
def after_readme(tmp_path_factory):
    """A scratch folder where README.md's commands ran, and a copy of it to restore before each docs page."""
    folder = tmp_path_factory.mktemp("documented") / "work"
    make_scratch(folder)
    run_page(ROOT / "README.md", folder)
    snapshot = folder.with_name("after-readme")
    shutil.copytree(folder, snapshot, symlinks=True)
    return folder, snapshot


@pytest.mark.slow
def test_the_readme_commands_run(after_readme):
    folder, _snapshot = after_readme
    assert (folder / ".rlhf" / "demo").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES[1:], ids=lambda page: page.name)
def test_the_commands_of_a_docs_page_run(page, after_readme, prefect_api):
    folder, snapshot = after_readme
    shutil.rmtree(folder)
    shutil.copytree(snapshot, folder, symlinks=True)
    run_page(page, folder, None if starts_a_prefect_server(page) else prefect_api)
