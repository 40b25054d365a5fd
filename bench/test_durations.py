"""Where the test suite's time goes (issue 41): the slowest tests and fixtures, and the seconds per module.

``.venv/bin/python -m bench.test_durations run --label after``: runs the README's test command
(``bash scripts/test.sh``) with ``--durations=0``, keeps its whole output in ``bench/.scratch/durations-<label>.log``,
and adds a section to ``bench/TEST_DURATIONS.md``: the command, its wall time, the machine's load before and after,
the commit, the 30 slowest entries and the seconds per module. Arguments after ``--`` go to pytest (``-- -n 0``,
``-- tests/flows``).

``.venv/bin/python -m bench.test_durations table LOG --label ci``: the same section from a log pytest already wrote
with ``--durations=0`` (CI keeps one per step in ``.ci/logs``), for instance the crash suite's.

An entry is one phase of one test as pytest times it: ``setup`` holds the fixtures that test was the first to need (a
module-scoped campaign shows up as the setup of its module's first test), ``call`` the test itself.
"""

from __future__ import annotations

import argparse
import re
import resource
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

from bench.common import REPO, SCRATCH

TABLE = REPO / "bench" / "TEST_DURATIONS.md"
SLOWEST = 30
_ENTRY = re.compile(r"^(?P<seconds>\d+(?:\.\d+)?)s (?P<phase>setup|call|teardown) +(?P<test>\S.*)$")
_SUMMARY = re.compile(r"^=* ?(?P<summary>\d+ (?:passed|failed|error).* in [\d.]+s.*?) ?=*$")


class Entry(NamedTuple):
    seconds: float
    phase: str
    test: str  # pytest's node id: path::name[params]


def parse_durations(log: str) -> list[Entry]:
    """The entries of pytest's ``--durations`` report in ``log``, slowest first."""
    entries = [
        Entry(float(match["seconds"]), match["phase"], match["test"].strip())
        for line in log.splitlines()
        if (match := _ENTRY.match(line.strip()))
    ]
    return sorted(entries, key=lambda entry: -entry.seconds)


def seconds_by_module(entries: list[Entry]) -> list[tuple[str, float]]:
    """Every module's seconds (all phases of all its tests), most first."""
    totals: dict[str, float] = defaultdict(float)
    for entry in entries:
        totals[entry.test.split("::", 1)[0]] += entry.seconds
    return sorted(totals.items(), key=lambda item: -item[1])


def summary_line(log: str) -> str:
    """pytest's closing line (``1302 passed, 3 skipped in 1998.41s``), or '' when the log has none."""
    lines = [match["summary"] for line in log.splitlines() if (match := _SUMMARY.match(line.strip()))]
    return lines[-1] if lines else ""


def section(label: str, log: str, *, header: list[str]) -> str:
    """A markdown section: ``header`` lines, the slowest entries and the seconds per module."""
    entries = parse_durations(log)
    if not entries:
        raise SystemExit("the log has no --durations report: run pytest with --durations=0")
    lines = [f"## {label}", "", *header, f"pytest: {summary_line(log) or 'no closing line'}.", ""]
    lines += [f"The {SLOWEST} slowest entries:", "", "| s | phase | test |", "| ---: | --- | --- |"]
    lines += [f"| {entry.seconds:.1f} | {entry.phase} | `{entry.test}` |" for entry in entries[:SLOWEST]]
    modules = seconds_by_module(entries)
    total = sum(seconds for _, seconds in modules)
    lines += ["", f"Seconds per module (sum of all phases: {total:.0f} s):", "", "| s | module |", "| ---: | --- |"]
    lines += [f"| {seconds:.1f} | `{module}` |" for module, seconds in modules if seconds >= 1.0]
    return "\n".join(lines) + "\n"


def _append(text: str) -> None:
    if not TABLE.exists():
        TABLE.write_text(
            "# Test durations\n\nWritten by `bench/test_durations.py` (its docstring says how); newest section last.\n"
        )
    with TABLE.open("a") as table:
        table.write("\n" + text)


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _children_cpu() -> float:
    """User and system seconds of every process this one has waited for (the test command and all it started, each
    counted once its parent waited for it)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(label: str, pytest_args: list[str]) -> None:
    SCRATCH.mkdir(parents=True, exist_ok=True)
    log_path = SCRATCH / f"durations-{re.sub(r'[^A-Za-z0-9]+', '-', label).strip('-')}.log"
    command = ["bash", "scripts/test.sh", "--durations=0", "-q", *pytest_args]
    load_before, started, cpu_before = _load(), time.monotonic(), _children_cpu()
    with log_path.open("w") as log:
        status = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    wall, load_after, cpu = time.monotonic() - started, _load(), _children_cpu() - cpu_before
    header = [
        f"Command: `{' '.join(command)}` (exit {status}); wall {wall / 60:.1f} min; CPU {cpu / 60:.1f} min "
        f"({cpu / wall:.2f} cores busy on average); commit {_commit().strip()}; load average before {load_before}, "
        f"after {load_after}; {time.strftime('%Y-%m-%d %H:%M')}.",
    ]
    text = section(label, log_path.read_text(), header=header)
    _append(text)
    print(text)
    sys.exit(status)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run the README's test command and add its section")
    run_parser.add_argument("--label", required=True, help="the section's title")
    run_parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    table_parser = commands.add_parser("table", help="print the section of a log pytest wrote with --durations=0")
    table_parser.add_argument("log", type=Path)
    table_parser.add_argument("--label", required=True, help="the section's title")
    table_parser.add_argument("--write", action="store_true", help=f"also add it to {TABLE.relative_to(REPO)}")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.label, args.pytest_args)
    else:
        if not args.log.is_file():
            parser.exit(2, f"error: no log at {args.log}\n")
        text = section(args.label, args.log.read_text(errors="replace"), header=[f"From `{args.log}`."])
        if args.write:
            _append(text)
        print(text)


if __name__ == "__main__":
    main()
