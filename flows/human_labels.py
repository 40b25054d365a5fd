"""Human labels: the iteration flow pauses and a person labels candidate pairs, on the labelling page the waiting
run serves (:mod:`flows.label_page`) or in the Prefect UI's Resume form.

Choices:

1. ``pause_flow_run`` blocks the *flow run*, so asking is a flow-level step (a plain function the
   iteration flow calls when ``labeler`` is ``human``), not a task. The paused run shows a
   **Resume** button in the Prefect UI that opens the form.
2. The answers are a stage output of their own, ``human_labels`` (one row per pair: ``A``, ``B``
   or ``tie/skip``), written through :func:`runtime.stage.run_stage` like any stage. Its input key
   is the candidates' digest plus ``human.relabel``, so a re-run (after a crash, or of a finished
   iteration) finds the answers and asks nothing. The preference stage takes the output as an
   upstream, so the answers are part of its input key.
3. One form holds ``human.pairs_per_form`` pairs; an iteration's pairs are asked over several
   forms in a row, each with its own timeout. Each form's answers are saved as soon as they arrive
   (a mid-stage checkpoint beside the output, as training stages keep theirs), so after a crash or
   a timeout the next attempt asks only what is still unanswered.
6. The iteration keeps holding the campaign's lock while it waits for a person: the lock is what
   keeps two iterations of a campaign apart, and any other iteration would have to wait for these
   same answers anyway. A second ``rlhf run`` is refused at once, naming the waiting process,
   rather than left waiting.
4. Each pair is one required field ``pair_<n>`` (``n`` counts from 1) with the choices ``A``,
   ``B`` and ``tie/skip``, drawn by Prefect's UI as a short dropdown titled "Pair n of N". The pairs
   themselves are the form's markdown description (field descriptions are shown unrendered): each
   prompt once, then its pairs' responses A and B as block quotes, one above the other (the UI's
   modal is 512 pixels wide and never wraps a markdown table cell, so A and B side by side would
   cut long responses off). The server checks answers against the form's JSON schema, so a
   missing, unknown or misspelt answer is refused and the run stays paused.
5. A form left unanswered for ``human.timeout_seconds`` fails the flow run with
   :class:`HumanLabelTimeout` (a ``FlowPauseTimeout``) saying what to do.
8. With ``asking.select`` random or uncertain the person is asked about only ``asking.pairs`` of the pairs
   (:func:`tasks.collect_preferences.asked_pairs_of`): the held-out share drawn at random first, then the pairs the
   previous reward model is least sure of. The answers' ``pair_id`` is then the pair's index among all of them, and
   the metric ``held_out_head`` says how many of the first answers are held-out pairs.
7. While it waits, the run also serves the same form as a page of its own (:mod:`flows.label_page`,
   ``human.page_host`` / ``human.page_port``): A and B side by side, one click per pair. Its address is
   in the run's log and at the top of the Resume form; sending it resumes the run exactly as the form does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import pyarrow as pa
from prefect import get_run_logger, pause_flow_run
from prefect.context import FlowRunContext
from prefect.exceptions import FlowPauseTimeout
from prefect.input import RunInput
from prefect.utilities.urls import url_for
from pydantic import Field, create_model

from campaign.config import PipelineConfig
from flows.label_page import LabelForm, LabelPage, resume_when_paused, serving
from rlhf_core.errors import UserError
from runtime.context import StageContext
from runtime.declaration import StageResult, settings_from
from runtime.events import STAGE_EVENT
from runtime.job import Job
from runtime.stage import Stage, run_stage
from storage.progress import latest_progress, save_progress
from storage.schemas import CHOICE, HUMAN_LABELS, PAIR_ID
from storage.shards import read_table
from tasks.collect_preferences import asked_pairs_of, candidate_pairs
from tasks.labelers import SKIP, CandidatePair, HumanChoice
from tasks.pairing import HELD_OUT_HEAD
from tasks.settings import HumanLabelsSettings

ANSWERS_FILE = "answers.json"


class HumanLabelTimeout(UserError, FlowPauseTimeout):
    """No answer arrived on a labelling form within ``human.timeout_seconds``."""

    exit_code = 3


def work(job: Job[HumanLabelsSettings]) -> dict[str, float]:
    """Ask for the answers still missing (a crashed attempt's saved forms are not asked again) and write them."""
    settings, context, out = job.settings, job.context, job.out
    pairs = candidate_pairs(read_table(settings.candidates.directory, "candidates"))
    asked, metrics = list(range(len(pairs))), {}
    if settings.asking.select != "all":
        chosen = asked_pairs_of(job, pairs, seed=job.seed())
        asked, metrics = [*chosen.held_out, *chosen.chosen], {HELD_OUT_HEAD: float(len(chosen.held_out))}
    saved = latest_progress(out.final_dir)
    human = settings.human
    choices = ask_for_labels(
        [pairs[index] for index in asked],
        heading=f"Campaign `{context.campaign}`, iteration {context.iteration}",
        pairs_per_form=human.pairs_per_form,
        timeout_seconds=human.timeout_seconds,
        poll_seconds=human.poll_seconds,
        answered=json.loads((saved[1] / ANSWERS_FILE).read_text()) if saved is not None else [],
        on_form=partial(_save_answers, out.final_dir),
        page_address=(human.page_host, human.page_port),
    )
    table = pa.table({PAIR_ID: asked, CHOICE: choices}, schema=HUMAN_LABELS)
    out.write_table(human_labels.name, table, schema=HUMAN_LABELS)
    return {"pairs": float(len(choices)), "skipped": float(choices.count(SKIP)), **metrics}


human_labels = Stage(HumanLabelsSettings, work=work)


def request_human_labels(
    context: StageContext, config: PipelineConfig, candidates: StageResult, reward_model: StageResult | None = None
) -> StageResult:
    """The person's answers for this iteration's candidate pairs: stored ones, or asked for now. ``reward_model``:
    the previous one, whose margins choose the pairs with ``asking.select`` uncertain.

    Must be called from a flow: asking pauses the current flow run until each form is answered, so the stage runs
    in the flow's own process rather than as a Prefect task.

    Raises:
        HumanLabelTimeout: a form was not answered in time (the flow run fails).
    """
    inputs = {"candidates": candidates, "reward_model": reward_model}
    settings = settings_from(HumanLabelsSettings, config, context.base, inputs)
    result = run_stage(human_labels, context, settings)
    if result.reused:
        get_run_logger().info(
            "%s: using the answers stored for these candidates (%s); raise `human.relabel` to be asked again",
            human_labels.name,
            result.path,
        )
    return result


def _save_answers(final_dir: Path, choices: list[str]) -> None:
    """Save the answers so far as a mid-stage checkpoint, counted in answered pairs where training counts epochs."""
    save_progress(final_dir, len(choices), partial(_write_answers, choices=choices))


def _write_answers(folder: Path, *, choices: list[str]) -> None:
    folder.mkdir(parents=True)
    (folder / ANSWERS_FILE).write_text(json.dumps(choices))


def ask_for_labels(
    pairs: Sequence[CandidatePair],
    *,
    heading: str,
    pairs_per_form: int,
    timeout_seconds: int,
    poll_seconds: int,
    answered: Sequence[str] = (),
    on_form: Callable[[list[str]], None] | None = None,
    page_address: tuple[str, int] = ("127.0.0.1", 0),
) -> list[str]:
    """Pause the current flow run once per form of ``pairs_per_form`` pairs; one choice per pair, in order.

    Args:
        answered: choices for the first pairs, given before (they are not asked again).
        on_form: called with every choice so far after each form is answered (to save them).
        page_address: host and port of the labelling page served while the run waits (port 0: any free one).

    Raises:
        HumanLabelTimeout: a form was not answered within ``timeout_seconds``.
    """
    choices: list[str] = list(answered)
    starts = range(len(choices), len(pairs), pairs_per_form)
    if not starts:
        return choices
    flow_run = FlowRunContext.get().flow_run
    submit = resume_when_paused(flow_run.id)
    plain_heading = heading.replace("`", "")  # the page is HTML, not markdown
    ui = url_for(flow_run)  # None where Prefect knows no UI address
    in_ui = f"press Resume on the run in the Prefect UI, {ui}" if ui else "press Resume on the run in the Prefect UI"
    page = LabelPage()
    with serving(page, host=page_address[0], port=page_address[1]) as url:
        for number, start in enumerate(starts, start=1):
            where = f"form {number} of {len(starts)}"
            batch = pairs[start : start + pairs_per_form]
            form = label_form(batch, first=start, total=len(pairs))
            page.show(
                LabelForm(title=f"{plain_heading}: {where}", pairs=batch, fields=list(form.model_fields), submit=submit)
            )
            description = (
                form_description(heading, where, timeout_seconds, page=url)
                + "\n\n"
                + pairs_markdown(batch, first=start)
            )
            get_run_logger().info(
                "%s: waiting for a person to answer %s (%d pairs): label them at %s, or %s",
                plain_heading,
                where,
                len(batch),
                url,
                in_ui,
                extra={STAGE_EVENT: "notice"},  # on the console too
            )
            try:
                answer = pause_flow_run(
                    wait_for_input=form.with_initial_data(description=description),
                    timeout=timeout_seconds,
                    poll_interval=poll_seconds,
                )
            except FlowPauseTimeout as error:
                raise HumanLabelTimeout(
                    f"{heading}: {where} was not answered within human.timeout_seconds={timeout_seconds} s, so the "
                    "flow run failed. Run the same command again to be asked again (answers to earlier forms of "
                    "this iteration were kept), or raise `human.timeout_seconds`."
                ) from error
            finally:
                page.clear()
            choices.extend(getattr(answer, name) for name in form.model_fields)
            if on_form is not None:
                on_form(choices)
    return choices


def label_form(pairs: Sequence[CandidatePair], *, first: int, total: int) -> type[RunInput]:
    """A RunInput with one required field ``pair_<first + i + 1>`` per pair (choices A, B, tie/skip).

    The fields carry only their title: the pairs themselves are the form's markdown description
    (:func:`pairs_markdown`), the only text Prefect's UI renders as markdown.

    Args:
        pairs: the pairs on this form.
        first: index of the first of them among the iteration's pairs.
        total: how many pairs the iteration has (for the field titles).
    """
    fields = {
        f"pair_{first + offset + 1}": (
            HumanChoice,
            Field(title=f"Pair {first + offset + 1} of {total}", json_schema_extra={"position": offset}),
        )
        for offset in range(len(pairs))
    }
    return create_model("HumanLabels", __base__=RunInput, **fields)


def pairs_markdown(pairs: Sequence[CandidatePair], *, first: int) -> str:
    """The pairs as markdown: each prompt once, then each of its pairs' responses A and B, one above the other.

    Not a table with A and B side by side: Prefect's UI shows the form in a 512-pixel modal whose
    markdown tables never wrap a cell, so a long response would be cut off after a line.
    """
    blocks, previous = [], None
    for offset, pair in enumerate(pairs):
        if pair.prompt != previous:
            blocks.append(f"---\n\n#### Prompt\n\n{_quoted(pair.prompt.text)}")
            previous = pair.prompt
        blocks.append(
            f"**Pair {first + offset + 1}, A:**\n\n{_quoted(pair.first)}\n\n"
            f"**Pair {first + offset + 1}, B:**\n\n{_quoted(pair.second)}"
        )
    return "\n\n".join(blocks)


def _quoted(text: str) -> str:
    """``text`` as a markdown block quote, its line breaks kept (an empty text says so)."""
    lines = text.splitlines() or ["*(empty)*"]
    return "\n".join(f"> {line}  " if line else ">" for line in lines)


def form_description(heading: str, where: str, timeout_seconds: int, *, page: str) -> str:
    """The markdown shown above a form's fields; ``page`` is the labelling page's address."""
    return (
        f"### {heading}: which response is better? ({where})\n\n"
        f"**Easier with many pairs:** the same form, A and B side by side, one click each, at [{page}]({page}).\n\n"
        "Below, each prompt is followed by its pairs of responses, **A** and **B**. Under **Pair n of N** "
        "at the end of the form, choose `A` or `B` for the better one, or `tie/skip` when neither is (the "
        "pair is then left out of the preference data). Every pair needs an answer; **Submit** resumes "
        "the run.\n\n"
        f"Unanswered after {timeout_seconds} s, the flow run fails; running the same command again asks again."
    )
