"""Turn the harness's JSON into ``bench/RESULTS.md``: the figures, the machine and the command."""

from __future__ import annotations

from pathlib import Path

from bench.common import median
from bench.flops import iteration_gflops

GOALS = "PPO iteration >= 1.5x faster than TRL at equal work; pipeline tax < 10%; generation >= 30% of roofline"


def _pair(wall_cpu: list[float] | tuple[float, float]) -> str:
    return f"{wall_cpu[0]:.3f} ({wall_cpu[1]:.3f})"


def _trl_section(trl: dict) -> list[str]:
    lines = [
        "## 1. Ours vs TRL `PPOTrainer` at equal work",
        "",
        "One iteration = B prompts, B x R sampled tokens, reference/value/reward forward passes, GAE, then",
        "4 PPO epochs of one minibatch of B (4 optimizer steps of actor and critic). Seconds per iteration,",
        "wall (CPU in parentheses), medians over the steady iterations of all runs (first iteration of each",
        "run left out). Ratio = TRL / ours (above 1: ours is faster).",
        "",
        "| size | model | B x R | opt. steps | TRL s/iter | ours s/iter | ratio wall | ratio CPU |"
        " TRL gen / rollout / update CPU | ours gen / rollout / update CPU | peak RSS TRL / ours |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in trl.items():
        size, ours, peer = row["size"], row["ours"], row["trl"]
        model = (
            f"GPT-2 {size['n_layer']}L x {size['n_embd']}, V {size['vocab_size']} ({ours['parameters'] / 1e6:.2f} M)"
        )
        work = (
            f"{size['rollout_batch']} x {size['response_length']} (positions {peer['positions']} / {ours['positions']})"
        )
        steps = f"{peer['optimizer_steps']} / {ours['optimizer_steps']}"
        phases = " / ".join(f"{peer[p][1]:.2f}" for p in ("generation", "rollout", "update"))
        our_phases = " / ".join(f"{ours[p][1]:.2f}" for p in ("generation", "rollout", "update"))
        lines.append(
            f"| {name} | {model} | {work} | {steps} | {_pair(peer['iteration'])} | {_pair(ours['iteration'])} | "
            f"{peer['iteration'][0] / ours['iteration'][0]:.2f}x | {peer['iteration'][1] / ours['iteration'][1]:.2f}x | "
            f"{phases} | {our_phases} | {peer['peak_rss_mib']:.0f} / {ours['peak_rss_mib']:.0f} MiB |"
        )
    lines += _flops_lines(trl)
    return lines


def _flops_lines(trl: dict) -> list[str]:
    """Matmul FLOPs per iteration of each side (:mod:`bench.flops`) and the rate each achieves."""
    from bench.artifacts import prompt_columns
    from bench.common import SCRATCH, Size

    lines = [
        "",
        "Matmul work per iteration (`bench/flops.py`: weights, attention and LM head; P = left-padded prompt"
        " width) and the rate it was done at (GFLOP / CPU seconds):",
        "",
        "| size | P | TRL GFLOP gen / rollout / update / iteration | ours GFLOP gen / rollout / update / iteration |"
        " TRL GFLOP/s | ours GFLOP/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in trl.items():
        width = prompt_columns(SCRATCH / f"artifacts-{name}", Size(**row["size"]))
        work = {side: iteration_gflops(row["size"], width, side) for side in ("trl", "ours")}
        cells = {side: " / ".join(f"{work[side][p]:.0f}" for p in ("generation", "rollout", "update", "iteration"))
                 for side in work}  # fmt: skip
        rates = {side: work[side]["iteration"] / row[side]["iteration"][1] for side in work}
        lines.append(
            f"| {name} | {width:.1f} | {cells['trl']} | {cells['ours']} | {rates['trl']:.0f} | {rates['ours']:.0f} |"
        )
    lines.append("")
    return lines


def _roofline_section(peaks: dict, trl: dict) -> list[str]:
    best = max(peaks.values())
    lines = [
        "## 2. Generation against the roofline",
        "",
        "Peak: fp32 `a @ b` on one thread, best of 5 timed loops per shape:",
        "",
        "| matmul | GFLOP/s |",
        "| --- | --- |",
        *[f"| {name} | {value:.1f} |" for name, value in peaks.items()],
        "",
        f"Roofline = 2 x N x tokens / peak, N = parameters except the position table (the tied LM head"
        f" counts once). Peak = the best shape above, {best:.1f} GFLOP/s. Generation time is the sampler alone"
        " (CPU seconds).",
        "",
        "| size | N | side | gen tokens/s | achieved GFLOP/s | % of peak | % of same-size decode matmul peak |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in trl.items():
        size = row["size"]
        n = row["ours"]["parameters"] - size["n_positions"] * size["n_embd"]
        decode_peak = median(
            [v for k, v in peaks.items() if k.startswith(f"{name} decode")]
        )  # the model's own decode shapes
        for side in ("trl", "ours"):
            tokens = size["rollout_batch"] * size["response_length"] / row[side]["generation"][1]
            achieved = 2 * n * tokens / 1e9
            lines.append(
                f"| {name} | {n / 1e6:.2f} M | {side} | {tokens:,.0f} | {achieved:.1f} | {100 * achieved / best:.0f}% |"
                f" {100 * achieved / decode_peak:.0f}% |"
            )
    lines.append("")
    return lines


def _tax_section(tax: dict) -> list[str]:
    flow, plain = tax["flow"]["phases"], tax["plain"]["phases"]
    flow_steady = median([p[0] for p in flow["iteration"][1:]])
    plain_steady = median([p[0] for p in plain["iteration"][1:]])
    flow_cpu = median([p[1] for p in flow["iteration"][1:]])
    plain_cpu = median([p[1] for p in plain["iteration"][1:]])
    lines = [
        "## 3. Pipeline tax",
        "",
        "The real `rlhf_iteration` flow (Prefect ephemeral server, MLflow on SQLite, Parquet shards, checkpoints,"
        " manifests; a temporary run root and `PREFECT_HOME`) against the same `rlhf_core` calls in one plain loop"
        " with models in memory, both on `configs/demo.yaml` (the RLHF demo). Steady = median of iterations 1..n.",
        "",
        "| | flow | plain loop | tax (flow - plain) / flow |",
        "| --- | --- | --- | --- |",
        f"| steady iteration, wall s | {flow_steady:.2f} | {plain_steady:.2f} | {100 * (flow_steady - plain_steady) / flow_steady:.0f}% |",
        f"| steady iteration, CPU s | {flow_cpu:.2f} | {plain_cpu:.2f} | {100 * (flow_cpu - plain_cpu) / flow_cpu:.0f}% |",
        f"| first iteration, wall s (server start, DB creation, initialize) | {flow['iteration'][0][0]:.2f} |"
        f" {plain['iteration'][0][0]:.2f} | |",
        f"| importing flows (prefect, mlflow, ...), wall s | {flow['import'][0][0]:.2f} | | |",
        "",
        "Per stage, steady iteration, wall s (flow: the stage's own `produce`, i.e. loading and saving included,"
        " MLflow logging and Prefect not):",
        "",
        "| stage | flow produce | plain loop |",
        "| --- | --- | --- |",
    ]
    stage_seconds = tax["flow"]["stage_seconds"][1:]
    for stage in (
        "sample_candidates",
        "collect_preferences",
        "train_reward_model",
        "rollout",
        "compute_advantages",
        "ppo_update",
        "evaluate",
    ):
        flow_stage = median([s.get(stage, float("nan")) for s in stage_seconds])
        plain_stage = median([p[0] for p in plain[stage][1:]])
        lines.append(f"| {stage} | {flow_stage:.2f} | {plain_stage:.2f} |")
    buckets = tax["flow"].get("profile_buckets") or {}
    if buckets:
        total = sum(buckets.values())
        lines += [
            "",
            "Where the flow's last iteration spends its time (cProfile self time by package; the profiler adds"
            " overhead to Python-heavy code, so read shares, not seconds):",
            "",
            "| package | share |",
            "| --- | --- |",
            *[f"| {k} | {100 * v / total:.0f}% |" for k, v in sorted(buckets.items(), key=lambda kv: -kv[1])],
        ]
    causes = dict(tax["flow"].get("profile_causes") or {})
    if causes:
        profiled = causes.pop("profiled iteration")
        lines += [
            "",
            "What the tax is made of: the work the flow does and the plain loop does not, in the same profiled"
            " iteration (cumulative seconds of the functions that do it, under cProfile, and their share of the"
            " profiled iteration; the rest is the stages' compute, which both do, and Prefect's task engine):",
            "",
            "| what | profiled s | share |",
            "| --- | --- | --- |",
            *[f"| {label} | {seconds:.2f} | {100 * seconds / profiled:.0f}% |" for label, seconds in causes.items()],
            f"| the profiled iteration | {profiled:.2f} | 100% |",
        ]
    lines.append("")
    return lines


def _replay_section(tax: dict) -> list[str]:
    flow, plain = tax["flow"]["phases"], tax["plain"]["phases"]
    flow_steady = median([p[0] for p in flow["iteration"][1:]])
    plain_steady = median([p[0] for p in plain["iteration"][1:]])
    replayed = ("compute_advantages", "ppo_update", "evaluate")
    plain_replay = median([sum(plain[s][i][0] for s in replayed) for i in range(1, len(plain["iteration"]))])
    lines = [
        "## 5. Replay against the full iteration",
        "",
        "| | replay | full iteration | ratio |",
        "| --- | --- | --- | --- |",
    ]
    if "replay" in flow:
        replay = flow["replay"][0][0]
        lines.append(
            f"| flow: `rlhf_replay` of the last iteration with `kl_coef` 0.1 vs a steady `rlhf_iteration`, wall s |"
            f" {replay:.2f} | {flow_steady:.2f} | {replay / flow_steady:.2f} |"
        )
    lines.append(
        f"| plain loop: compute_advantages + ppo_update + evaluate vs the whole iteration, wall s |"
        f" {plain_replay:.2f} | {plain_steady:.2f} | {plain_replay / plain_steady:.2f} |"
    )
    lines.append("")
    return lines


def _scaling_section(scaling: dict) -> list[str]:
    lines = [
        "## 4. Scaling (ours, size S model, one thread)",
        "",
        "Seconds per iteration, wall (CPU), median of steady iterations. B = prompts (sequences), R = response length.",
        "",
        "| B x R | iteration | rollout | update | CPU vs 16 x 32 |",
        "| --- | --- | --- | --- | --- |",
    ]
    base = scaling.get("16x32", {}).get("iteration", (1.0, 1.0))[1]
    for key, row in scaling.items():
        lines.append(
            f"| {key.replace('x', ' x ')} | {_pair(row['iteration'])} | {_pair(row['rollout'])} | {_pair(row['update'])} |"
            f" {row['iteration'][1] / base:.2f}x |"
        )
    lines.append("")
    return lines


def _scale_section(scale: dict) -> list[str]:
    first = next(iter(scale.values()))
    lines = [
        "## 6. Model scale: full fine-tuning against LoRA, fp32 against bf16",
        "",
        f"`.venv/bin/python -m bench.run --only scale`: a GPT-2 of 12 layers x 768 ({first['parameters'] / 1e6:.1f} M "
        f"parameters, {first['model_bytes'] / 2**20:.0f} MiB in fp32), random init, the demo tokenizer and prompts; two "
        "iterations of 16 preference prompts x 2 candidates, 16 rollouts of 8 tokens, 8 held-out prompts, one epoch "
        "of reward-model and PPO training; one thread. Seconds and peak memory (growth of resident memory) per stage "
        "from the stage manifests, summed (seconds) or maxed (memory) over the two iterations. Disk: everything under "
        "the run root after the two iterations (stage outputs, the MLflow store), over the model's bytes.",
        "",
        "| variant | wall s | " + " | ".join(STAGE_COLUMNS) + " | disk / model |",
        "| --- | --- | " + " | ".join("---" for _ in STAGE_COLUMNS) + " | --- |",
    ]
    for variant, run in scale.items():
        cells = []
        for stage in STAGE_COLUMNS:
            row = run["stages"].get(stage)
            cells.append("-" if row is None else f"{sum(row['seconds']):.1f} s / {max(row['peak_memory_mb']):.0f} MB")
        lines.append(
            f"| {variant} | {run['wall_seconds']:.0f} | "
            + " | ".join(cells)
            + f" | {run['disk_bytes'] / run['model_bytes']:.2f}x |"
        )
    lines += [
        "",
        "Goals (issue 10): disk at most 12x the model's bytes with full fine-tuning, at most 1x with LoRA.",
        "",
    ]
    return lines


STAGE_COLUMNS = (
    "initialize",
    "sample_candidates",
    "train_reward_model",
    "rollout",
    "ppo_update",
    "evaluate",
)


def _noop_section(noop: dict) -> list[str]:
    parts = noop["breakdown"]
    per_iteration = parts["decision_s"] / parts["iterations"]
    return [
        "## 7. No-op run: the finished demo campaign again",
        "",
        "`.venv/bin/python -m bench.run --only noop`: `rlhf run --config configs/demo.yaml` (8 iterations) once, then"
        " the same command again in fresh processes, timed as whole commands. Goal (issue 13): at most 8 s,"
        " at most 2 s of it per finished iteration.",
        "",
        "| | seconds |",
        "| --- | --- |",
        f"| the campaign (first run) | {noop['first_run_s']:.1f} |",
        f"| no-op run, median of {len(noop['noop_wall_s'])} (wall) | {noop['noop_median_s']:.2f} |",
        f"| of it, in one more process: importing the command's modules (MLflow, pyarrow, pydantic; neither torch"
        f" nor Prefect) | {parts['import_s']:.2f} |",
        f"| of it: config, base inputs located and fingerprinted (cached) | {parts['config_and_base_s']:.2f} |",
        f"| of it: opening the MLflow store | {parts['mlflow_store_s']:.2f} |",
        f"| of it: the reuse decision, {parts['iterations']} iterations ({parts['finished']} finished) |"
        f" {parts['decision_s']:.2f} ({per_iteration:.3f} per iteration) |",
        f"| of it: every output of the finished iterations checked against its digest (sha256s cached) |"
        f" {parts['outputs_checked_s']:.2f} |",
        "",
        f'Every no-op run printed "nothing to run": {"yes" if noop["nothing_to_run"] else "NO"}.',
        "",
    ]


def _kept_sections(path: Path) -> dict[str, str]:
    """``## N.`` sections of an existing results file, by number, so a partial run keeps the others."""
    if not path.is_file():
        return {}
    sections, current = {}, None
    for line in path.read_text().splitlines(keepends=True):
        if line.startswith("## ") and line[3:4].isdigit():
            current = line[3 : line.index(".")]
            sections[current] = ""
        elif line.startswith("## "):
            current = None
        if current is not None:
            sections[current] += line
    return sections


def write_results(results: dict, path: Path, *, command: str, keep: Path | None = None) -> None:
    """Write the results file; sections whose part was not run come from ``keep`` (the file as it was)."""
    kept = _kept_sections(keep) if keep is not None else {}
    lines = [
        "# Benchmark results",
        "",
        f"Regenerate: `{command}` (writes this file; raw figures in `bench/.scratch/results.json`).",
        "",
        f"Goals (issue 6): {GOALS}.",
        "",
        "Machine: " + "; ".join(f"{k}: {v}" for k, v in results["machine"].items()) + f"; run {results['started']}.",
        "One torch thread everywhere; runs one at a time; the machine is shared, so CPU seconds are the steadier figure.",
        "",
    ]
    parts = [
        ("1", "trl", lambda: _trl_section(results["trl"])),
        ("2", "roofline", lambda: _roofline_section(results["roofline"], results["trl"])),
        ("3", "tax", lambda: _tax_section(results["tax"])),
        ("4", "scaling", lambda: _scaling_section(results["scaling"])),
        ("5", "tax", lambda: _replay_section(results["tax"])),
        ("6", "scale", lambda: _scale_section(results["scale"])),
        ("7", "noop", lambda: _noop_section(results["noop"])),
        ("8", "vllm", lambda: []),  # written by bench/vllm_engine.py (its own environment and models): kept here
    ]
    for number, part, section in parts:
        if part in results and (part != "roofline" or "trl" in results):
            lines += section()
        elif number in kept:
            lines += kept[number].rstrip("\n").split("\n") + [""]
    for number in sorted(set(kept) - {number for number, _, _ in parts}, key=int):  # written by other commands
        lines += kept[number].rstrip("\n").split("\n") + [""]
    notes = Path(__file__).with_name("NOTES.md")
    if notes.is_file():
        lines += [notes.read_text().rstrip(), ""]
    path.write_text("\n".join(lines))
