"""Our DPO update against TRL's ``DPOTrainer`` at equal work: pairs per second, one run, A/B interleaved (issue 45).

``.venv/bin/python -m bench.dpo_trl --repeats 3 [--write]`` (about 10 minutes on 2 shared cores)

Both sides read one folder (``bench/.scratch/dpo-trl``): a GPT-2 (4 layers x 256, vocabulary 4,096: size M's model
of the PPO comparison, random weights, dropout 0), the demo world's word-level tokenizer, and N preference pairs of
random demo words, every prompt 16 tokens (BOS and 15 words) and every response 32 (31 words and EOS), so no row is
padded and both sides run the same (2b, 48) batches. Each measurement is its own subprocess with one torch thread;
the sides alternate (ours, TRL, TRL precomputed; the order rotates every repeat).

1. Ours (this file, ``--side ours``): :func:`rlhf_core.dpo.reference_logprobs` (what the ``reference_logprobs`` stage
   calls) over all pairs, then :func:`rlhf_core.dpo.dpo_update` (what the ``dpo_update`` stage calls) with AdamW
   (weight decay 0) prepared by ``accelerate``, in this process: no Prefect flow, no MLflow, no Parquet
   (bench section 3 measures that tax for the PPO iteration). ``update`` includes the pass over every pair that
   ``dpo_update`` makes after training to measure TRL's metrics; ``loop`` stops at the last optimizer step.
2. TRL (:mod:`bench.dpo_trl_worker`, trl 1.12.0 in ``bench/.venv-trl``): ``DPOTrainer.train()`` with the reference
   run at every step (TRL's default), and with ``precompute_ref_log_probs=True`` (the reference's pass over all
   pairs timed apart: our layout). The settings are ours: sigmoid loss, beta 0.1, b pairs per step, the same epochs
   and learning rate, AdamW (``adamw_torch``, weight decay 0), constant learning rate (TRL's default schedule decays
   linearly; ours is constant), gradient-norm clip 1.0, fp32 on the CPU; the pair order is ours (a sampler that draws
   ``torch.randperm`` from the same seeded generator every epoch, as ``dpo_update`` does).
3. Equal work is checked, not assumed: both sides log each optimizer step's loss; the table gives the largest
   difference between them over the run (same initial weights, same pairs, same order).

Pairs per second = pairs x epochs / seconds; ratio = TRL seconds / our seconds (above 1: ours is faster), medians
over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import PROJECT_PYTHON, REPO, SCRATCH, Clock, machine, median, set_threads, thread_env

FOLDER = SCRATCH / "dpo-trl"
RESULTS = REPO / "bench" / "RESULTS.md"
HEADING = "## 10. DPO update against TRL `DPOTrainer` at equal work (issue 45)"
SIDES = ("ours", "trl", "trl-precomputed")


@dataclass(frozen=True)
class Work:
    """What both sides do: the pairs, their shapes, the schedule."""

    pairs: int = 256
    prompt_words: int = 15
    """P = 1 + prompt_words (BOS)."""
    response_words: int = 31
    """R = response_words + 1 (EOS)."""
    batch_size: int = 16
    epochs: int = 2
    learning_rate: float = 5e-5
    beta: float = 0.1
    max_grad_norm: float = 1.0
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    vocab_size: int = 4096
    seed: int = 0


def build(work: Work, folder: Path = FOLDER) -> Path:
    """Write (or reuse) the shared folder: ``model/``, ``tokenizer/``, ``pairs.jsonl`` (text and ids), ``work.json``."""
    import torch
    from transformers import GPT2LMHeadModel

    from bench.artifacts import gpt2_config
    from bench.common import Size
    from demo.corpus import VOCABULARY
    from demo.tokenizer import build_tokenizer

    if (folder / "work.json").is_file() and json.loads((folder / "work.json").read_text()) == asdict(work):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(VOCABULARY, model_max_length=256)
    tokenizer.save_pretrained(folder / "tokenizer")
    size = Size("dpo", work.n_layer, work.n_embd, work.n_head, work.vocab_size, work.batch_size, 0)
    torch.manual_seed(work.seed)
    GPT2LMHeadModel(gpt2_config(size)).save_pretrained(folder / "model")
    generator = torch.Generator().manual_seed(work.seed)

    def words(count: int) -> str:
        return " ".join(VOCABULARY[i] for i in torch.randint(len(VOCABULARY), (count,), generator=generator).tolist())

    with (folder / "pairs.jsonl").open("w") as out:
        for _ in range(work.pairs):
            prompt, chosen, rejected = (
                words(work.prompt_words),
                " " + words(work.response_words),
                " " + words(work.response_words),
            )
            prompt_ids = tokenizer(prompt)["input_ids"]
            row = {"prompt": prompt, "chosen": chosen, "rejected": rejected, "prompt_ids": prompt_ids}
            for side, text in (("chosen", chosen), ("rejected", rejected)):
                row[f"{side}_ids"] = tokenizer(prompt + text + tokenizer.eos_token)["input_ids"][len(prompt_ids) :]
            out.write(json.dumps(row) + "\n")
    (folder / "work.json").write_text(json.dumps(asdict(work), indent=2))
    return folder


def read_pairs(folder: Path) -> list[dict]:
    with (folder / "pairs.jsonl").open() as lines:
        return [json.loads(line) for line in lines if line.strip()]


def run_ours(folder: Path) -> dict:
    """Our side in this process: the reference's log-probs, then the DPO update, as the two stages call them."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from rlhf_core.config import DPOConfig
    from rlhf_core.dpo import dpo_update, reference_logprobs
    from rlhf_core.models import freeze
    from tasks.tensors import preference_pairs

    work = Work(**json.loads((folder / "work.json").read_text()))
    rows = read_pairs(folder)
    pairs = preference_pairs(
        [r["prompt_ids"] for r in rows], [r["chosen_ids"] for r in rows], [r["rejected_ids"] for r in rows],
        pad_token_id=0,
    )  # fmt: skip
    config = DPOConfig(
        beta=work.beta, loss="sigmoid", epochs=work.epochs, batch_size=work.batch_size,
        learning_rate=work.learning_rate, max_grad_norm=work.max_grad_norm,
    )  # fmt: skip
    actor = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32)
    reference = freeze(AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32))
    clock, losses, last_step = Clock(), [], []
    with clock.measure("reference"):
        chosen, rejected = reference_logprobs(reference, pairs, batch_size=work.batch_size)
    pairs = pairs.with_reference(chosen, rejected)

    def on_step(step: int, metrics: dict[str, float]) -> None:
        losses.append(metrics["loss"])
        last_step[:] = [time.perf_counter(), time.process_time()]

    start = time.perf_counter(), time.process_time()
    with clock.measure("update"):
        accelerator = Accelerator(cpu=True)
        optimizer = torch.optim.AdamW(actor.parameters(), lr=config.learning_rate, weight_decay=0.0)
        actor, optimizer = accelerator.prepare(actor, optimizer)
        stats = dpo_update(
            actor, optimizer, pairs, config, accelerator=accelerator,
            generator=torch.Generator().manual_seed(work.seed), on_step=on_step,
        )  # fmt: skip
    clock.add("loop", last_step[0] - start[0], last_step[1] - start[1])
    return {
        "side": "ours",
        "versions": f"torch {torch.__version__}",
        "threads": torch.get_num_threads(),
        "optimizer_steps": stats.optimizer_steps,
        "losses": losses,
        "phases": clock.to_json(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def measure_one(side: str, folder: Path) -> dict:
    """One run of ``side`` in its own subprocess (one torch thread, a fresh datasets cache)."""
    from bench.run import ensure_trl_venv, worker

    with tempfile.TemporaryDirectory(dir=SCRATCH) as cache:
        env = thread_env(1) | {"HF_DATASETS_CACHE": cache, "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
        if side == "ours":
            return worker(PROJECT_PYTHON, "bench.dpo_trl", "--side", "ours", "--folder", str(folder), env=env)
        extra = ["--precompute"] if side == "trl-precomputed" else []
        return worker(ensure_trl_venv(), "bench.dpo_trl_worker", "--folder", str(folder), *extra, env=env)


def compare(work: Work, repeats: int) -> dict:
    folder = build(work)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for repeat in range(repeats):
        order = SIDES[repeat % len(SIDES) :] + SIDES[: repeat % len(SIDES)]
        for side in order:
            print(f"  {side} run {repeat + 1}/{repeats} (load {os.getloadavg()[0]:.2f})", flush=True)
            runs[side].append(measure_one(side, folder))
    return {"work": asdict(work), "runs": runs}


def seconds(results: list[dict], *phases: str) -> tuple[float, float]:
    """Median over runs of the wall and CPU seconds of ``phases`` summed within each run."""
    walls = [sum(run["phases"][phase][0][0] for phase in phases) for run in results]
    cpus = [sum(run["phases"][phase][0][1] for phase in phases) for run in results]
    return median(walls), median(cpus)


def section(result: dict, *, command: str, facts: dict[str, str]) -> list[str]:
    """The RESULTS.md section of one comparison."""
    work, runs = Work(**result["work"]), result["runs"]
    trained = work.pairs * work.epochs
    ours, trl, pre = runs["ours"], runs["trl"], runs["trl-precomputed"]
    steps = ours[0]["optimizer_steps"]
    rows = [
        ("reference pass + update", seconds(ours, "reference", "update"), "default: reference at every step",
         seconds(trl, "update")),
        ("reference pass + update", seconds(ours, "reference", "update"), "precomputed: reference pass + train()",
         seconds(pre, "reference", "update")),
        ("update only", seconds(ours, "update"), "precomputed: train() only", seconds(pre, "update")),
        ("training loop only", seconds(ours, "loop"), "precomputed: on_train_begin to the last step",
         seconds(pre, "loop")),
        ("reference pass", seconds(ours, "reference"), "precomputed: reference pass", seconds(pre, "reference")),
    ]  # fmt: skip
    gap = max(  # equal step counts, or zip raises
        abs(a - b) for run in trl + pre for a, b in zip(ours[0]["losses"], run["losses"], strict=True)
    )
    first, last = ours[0]["losses"][0], ours[0]["losses"][-1]
    lines = [
        HEADING,
        "",
        f"`{command}`; {facts['date']}; {facts['machine']}; load average {facts['load_start']} at the start, "
        f"{facts['load_end']} at the end (the machine was shared with other sessions: the ratios, from runs "
        "interleaved in one command, are the figures that count). "
        f"Ours: {ours[0]['versions']}; TRL: {trl[0]['versions']}. One torch thread a side, fp32, CPU.",
        "",
        f"Work: {work.pairs} pairs of random demo words (prompt {work.prompt_words + 1} tokens, every response "
        f"{work.response_words + 1}: no padding on either side), GPT-2 {work.n_layer}L x {work.n_embd}, vocabulary "
        f"{work.vocab_size}; sigmoid loss, beta {work.beta}, {work.batch_size} pairs a step, {work.epochs} epochs "
        f"({steps} optimizer steps), AdamW lr {work.learning_rate:g} constant, clip {work.max_grad_norm}. "
        f"Seconds: wall (CPU), medians of {len(ours)} runs a side; pairs/s = {trained} trained pairs / wall seconds; "
        "ratio = TRL / ours (above 1: ours is faster).",
        "",
        "| ours | ours s | ours pairs/s | TRL | TRL s | TRL pairs/s | ratio wall | ratio CPU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for ours_name, (ow, oc), trl_name, (tw, tc) in rows:
        per_pair = ("-", "-") if ours_name == "reference pass" else (f"{trained / ow:.1f}", f"{trained / tw:.1f}")
        lines.append(
            f"| {ours_name} | {ow:.2f} ({oc:.2f}) | {per_pair[0]} | {trl_name} | {tw:.2f} ({tc:.2f}) | "
            f"{per_pair[1]} | {tw / ow:.2f}x | {tc / oc:.2f}x |"
        )
    lines += [
        "",
        f"Equal work: the per-step losses of every TRL run match our first run's to within {gap:.1e} over all "
        f"{steps} steps (ours {first:.4f} at step 1, {last:.4f} at step {steps}). Peak RSS: ours "
        f"{max(r['peak_rss_mib'] for r in ours):.0f} MiB, TRL {max(r['peak_rss_mib'] for r in trl):.0f} MiB "
        f"(precomputed {max(r['peak_rss_mib'] for r in pre):.0f} MiB).",
        "",
        "Ours is `rlhf_core.dpo.reference_logprobs` then `dpo_update` in one process, as the two stages call them: "
        "the Prefect flow, MLflow and Parquet around them are not included (section 3 measures that tax for the PPO "
        "iteration). Our `update` includes the pass over every pair after training that measures TRL's metrics; "
        "`training loop only` stops at the last optimizer step on both sides. CPU seconds are the steady figure on "
        f"this shared machine: a side's runs differed by at most {spread(runs, 1):.0%} in CPU seconds, "
        f"{spread(runs, 0):.0%} in wall seconds. Not profiled; one difference in the work of a step: TRL's forward "
        f"computes the LM head and log-softmax at all {work.prompt_words + work.response_words + 2} positions of a "
        f"sequence, ours at its {work.response_words + 1} response positions only (`logits_to_keep`).",
        "",
    ]
    return lines


def spread(runs: dict[str, list[dict]], column: int) -> float:
    """The largest (max - min) / median of one phase's seconds (``column`` 0 wall, 1 CPU) over a side's runs."""
    widths = []
    for results in runs.values():
        for phase in results[0]["phases"]:
            values = [run["phases"][phase][0][column] for run in results]
            widths.append((max(values) - min(values)) / median(values))
    return max(widths)


def write_section(lines: list[str], path: Path = RESULTS) -> None:
    """Replace this comparison's section of ``path`` (up to the next ``## `` heading), or put it after the last
    numbered one: a numbered section is one that ``bench.run`` keeps when it writes the file again."""
    text = path.read_text().rstrip("\n").split("\n")
    if HEADING in text:
        start = text.index(HEADING)
        end = next((i for i in range(start + 1, len(text)) if text[i].startswith("## ")), len(text))
        text[start:end] = lines
    else:
        numbered = [i for i, line in enumerate(text) if line.startswith("## ") and line[3:4].isdigit()]
        after = numbered[-1] if numbered else len(text)
        end = next((i for i in range(after + 1, len(text)) if text[i].startswith("## ")), len(text))
        text[end:end] = [*lines, ""]
    path.write_text("\n".join(text).rstrip("\n") + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, interleaved")
    parser.add_argument("--pairs", type=int, default=Work.pairs)
    parser.add_argument("--epochs", type=int, default=Work.epochs)
    parser.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    parser.add_argument("--side", choices=("ours",), help="(worker) run one side and write --out")
    parser.add_argument("--folder", type=Path, default=FOLDER)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.side == "ours":
        set_threads(1)
        args.out.write_text(json.dumps(run_ours(args.folder), indent=2))
        return
    SCRATCH.mkdir(parents=True, exist_ok=True)
    facts = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    info = machine()
    result = compare(Work(pairs=args.pairs, epochs=args.epochs), args.repeats)
    facts["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    facts["machine"] = f"{info['cpu']}, {info['cores']} cores, commit {info['commit']}"
    (SCRATCH / "dpo-trl.json").write_text(json.dumps({"facts": facts, **result}, indent=2))
    command = ".venv/bin/python -m bench.dpo_trl" + (f" --repeats {args.repeats}" if args.repeats != 3 else "")
    command += "".join(
        f" --{name} {value}" for name, value in (("pairs", args.pairs), ("epochs", args.epochs))
        if value != getattr(Work, name)
    )  # fmt: skip
    lines = section(result, command=command + (" --write" if args.write else ""), facts=facts)
    print("\n".join(lines))
    if args.write:
        write_section(lines)


if __name__ == "__main__":
    main()
