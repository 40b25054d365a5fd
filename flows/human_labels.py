"""Human labels: the iteration flow pauses and a person labels candidate pairs in Prefect UI forms.

Choices:

1. ``pause_flow_run`` blocks the *flow run*, so asking is a flow-level step (a plain function the
   iteration flow calls when ``labeler`` is ``human``), not a task. The paused run shows a
   **Resume** button in the Prefect UI that opens the form.
2. The answers are a stage output of their own, ``human_labels`` (one row per pair: ``A``, ``B``
   or ``tie/skip``), written through :func:`tasks.stage.run_stage` like any stage. Its input key
   is the candidates' digest plus ``human.relabel``, so a re-run (after a crash, or of a finished
   iteration) finds the answers and asks nothing. The preference stage takes the output as an
   upstream, so the answers are part of its input key.
3. One form holds ``human.pairs_per_form`` pairs; an iteration's pairs are asked over several
   forms in a row, each with its own timeout. Answers are stored when the last form is answered:
   a crash before that asks again from the first form.
4. Each pair is one required field ``pair_<n>`` (``n`` counts from 1) with the choices ``A``,
   ``B`` and ``tie/skip``; its description holds the prompt and both responses as plain text
   (Prefect's default UI shows field descriptions unrendered). The server checks answers against
   the form's JSON schema, so a missing, unknown or misspelt answer is refused and the run stays
   paused.
5. A form left unanswered for ``human.timeout_seconds`` fails the flow run with
   :class:`HumanLabelTimeout` (a ``FlowPauseTimeout``) saying what to do.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
from prefect import get_run_logger, pause_flow_run
from prefect.exceptions import FlowPauseTimeout
from prefect.input import RunInput
from pydantic import Field, create_model

from flows.config import HumanLabelConfig
from storage.manifest import StageOutput
from storage.schemas import CHOICE, HUMAN_LABELS, PAIR_ID
from storage.shards import read_table
from tasks.code import code_fingerprint
from tasks.collect_preferences import candidate_pairs
from tasks.context import StageContext
from tasks.labelers import SKIP, CandidatePair, HumanChoice
from tasks.stage import StageResult, run_stage

STAGE = "human_labels"


class HumanLabelTimeout(FlowPauseTimeout):
    """No answer arrived on a labelling form within ``human.timeout_seconds``."""


def request_human_labels(
    context: StageContext, candidates: StageResult, *, relabel: int, human: HumanLabelConfig
) -> StageResult:
    """The person's answers for this iteration's candidate pairs: stored ones, or asked for now.

    Must be called from a flow: asking pauses the current flow run until each form is answered.

    Args:
        relabel: answers are stored per value (the stage's only setting): another value asks again.
        human: how the forms are shown and waited for.

    Raises:
        HumanLabelTimeout: a form was not answered in time (the flow run fails).
    """

    def produce(out: StageOutput) -> dict[str, float]:
        pairs = candidate_pairs(read_table(candidates.directory, "candidates"))
        heading = f"Campaign `{context.campaign}`, iteration {context.iteration}"
        choices = ask_for_labels(
            pairs,
            heading=heading,
            pairs_per_form=human.pairs_per_form,
            timeout_seconds=human.timeout_seconds,
            poll_seconds=human.poll_seconds,
        )
        table = pa.table({PAIR_ID: list(range(len(choices))), CHOICE: choices}, schema=HUMAN_LABELS)
        out.write_table(STAGE, table, schema=HUMAN_LABELS)
        return {"pairs": float(len(choices)), "skipped": float(choices.count(SKIP))}

    result = run_stage(
        context,
        STAGE,
        settings={"relabel": relabel},
        upstream={"candidates": candidates},
        code=code_fingerprint(__name__),
        produce=produce,
    )
    if result.reused:
        get_run_logger().info(
            "%s: using the answers stored for these candidates (%s); raise `human.relabel` to be asked again",
            STAGE,
            result.path,
        )
    return result


def ask_for_labels(
    pairs: Sequence[CandidatePair],
    *,
    heading: str,
    pairs_per_form: int,
    timeout_seconds: int,
    poll_seconds: int,
) -> list[str]:
    """Pause the current flow run once per form of ``pairs_per_form`` pairs; one choice per pair, in order.

    Raises:
        HumanLabelTimeout: a form was not answered within ``timeout_seconds``.
    """
    choices: list[str] = []
    forms = -(-len(pairs) // pairs_per_form)
    for number, start in enumerate(range(0, len(pairs), pairs_per_form), start=1):
        where = f"form {number} of {forms}"
        form = label_form(pairs[start : start + pairs_per_form], first=start, total=len(pairs))
        form = form.with_initial_data(description=form_description(heading, where, timeout_seconds))
        get_run_logger().info(
            "%s: waiting for a person to answer %s (%d pairs): open this flow run in the Prefect UI and press Resume",
            heading,
            where,
            len(form.model_fields),
        )
        try:
            answer = pause_flow_run(wait_for_input=form, timeout=timeout_seconds, poll_interval=poll_seconds)
        except FlowPauseTimeout as error:
            raise HumanLabelTimeout(
                f"{heading}: {where} was not answered within human.timeout_seconds={timeout_seconds} s, so the "
                "flow run failed. Run the same command again to be asked again (answers to earlier forms of "
                "this iteration were not kept), or raise `human.timeout_seconds`."
            ) from error
        choices.extend(getattr(answer, name) for name in form.model_fields)
    return choices


def label_form(pairs: Sequence[CandidatePair], *, first: int, total: int) -> type[RunInput]:
    """A RunInput with one required field ``pair_<first + i + 1>`` per pair (choices A, B, tie/skip).

    Args:
        pairs: the pairs on this form.
        first: index of the first of them among the iteration's pairs.
        total: how many pairs the iteration has (for the field titles).
    """
    fields = {
        f"pair_{first + offset + 1}": (
            HumanChoice,
            Field(
                title=f"Pair {first + offset + 1} of {total}",
                description=f'Prompt: "{pair.prompt.text}"\n\nA: "{pair.first}"\n\nB: "{pair.second}"',
                json_schema_extra={"position": offset},
            ),
        )
        for offset, pair in enumerate(pairs)
    }
    return create_model("HumanLabels", __base__=RunInput, **fields)


def form_description(heading: str, where: str, timeout_seconds: int) -> str:
    """The markdown shown above a form's fields."""
    return (
        f"### {heading}: which response is better? ({where})\n\n"
        "Each pair below shows a prompt and two responses, **A** and **B**. Choose `A` or `B` for the "
        "better one, or `tie/skip` when neither is (the pair is then left out of the preference data). "
        "Every pair needs an answer; **Resume** submits the form.\n\n"
        f"Unanswered after {timeout_seconds} s, the flow run fails; running the same command again asks again."
    )
