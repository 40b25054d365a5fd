"""Human labels end to end: an iteration with labeler ``human`` pauses on Prefect forms, the test
answers them through the Prefect API (what the UI's Resume form sends), and the answers become
preference data; plus the form's validation, the timeout, and the config section."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from uuid import UUID

import pytest
from pydantic import ValidationError

from campaign.config import ConfigError, load_config
from flows.console import StageConsole
from flows.human_labels import HumanLabelTimeout, ask_for_labels, label_form, pairs_markdown
from flows.label_page import LabelForm, answers_from_form, page_html
from storage.manifest import read_manifest
from storage.shards import read_table
from tasks.collect_preferences import candidate_pairs
from tasks.labelers import CandidatePair
from tasks.text import Prompt
from tests.flows.conftest import flow_runs_in_state

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TAG = "test-human-labels"
# 8 pairs on two forms (5 + 3); the two tie/skip answers must not become preferences.
ANSWERS = ["A", "B", "tie/skip", "B", "A", "A", "tie/skip", "B"]
PAIRS_PER_FORM = 5


def _pair(index: int) -> CandidatePair:
    return CandidatePair(
        prompt=Prompt(f"prompt {index}"), first=f"a{index}", second=f"b{index}", first_ids=[1], second_ids=[2]
    )


def test_form_has_one_required_choice_per_pair_and_refuses_anything_else():
    form = label_form([_pair(0), _pair(1)], first=4, total=6)
    schema = form.model_json_schema()
    assert list(schema["properties"]) == ["pair_5", "pair_6"]
    assert schema["required"] == ["pair_5", "pair_6"]
    field = schema["properties"]["pair_5"]
    assert field["enum"] == ["A", "B", "tie/skip"]
    assert field["title"] == "Pair 5 of 6"
    assert "description" not in field  # the pair is in the form's markdown, which the UI renders
    assert form(pair_5="A", pair_6="tie/skip").pair_6 == "tie/skip"
    for bad in ({"pair_5": "C", "pair_6": "A"}, {"pair_5": "A"}, {"pair_5": "A", "pair_6": "B", "pair_7": "A"}):
        with pytest.raises(ValidationError):
            form(**bad)


def test_form_markdown_shows_each_prompt_once_then_its_pairs():
    shared = Prompt("same prompt")
    pairs = [
        CandidatePair(prompt=shared, first="a1", second="two\nlines", first_ids=[1], second_ids=[2]),
        CandidatePair(prompt=shared, first="a2", second="", first_ids=[1], second_ids=[2]),
        _pair(7),
    ]
    assert pairs_markdown(pairs, first=2) == (
        "---\n\n#### Prompt\n\n> same prompt  \n\n"
        "**Pair 3, A:**\n\n> a1  \n\n**Pair 3, B:**\n\n> two  \n> lines  \n\n"
        "**Pair 4, A:**\n\n> a2  \n\n**Pair 4, B:**\n\n> *(empty)*  \n\n"
        "---\n\n#### Prompt\n\n> prompt 7  \n\n"
        "**Pair 5, A:**\n\n> a7  \n\n**Pair 5, B:**\n\n> b7  "
    )


def test_config_human_section_is_validated():
    config = load_config(None, ["demo=true", "labeler=human", "human.timeout_seconds=30", "human.pairs_per_form=4"])
    assert (config.human.timeout_seconds, config.human.pairs_per_form, config.human.poll_seconds) == (30, 4, 10)
    for override in ("human.timeout_seconds=0", "human.pairs_per_form=0", "human.poll_seconds=-1", "human.pairs=3"):
        with pytest.raises(ConfigError):
            load_config(None, ["demo=true", "labeler=human", override])


def test_an_unanswered_form_fails_the_run_saying_what_to_do(prefect_server):
    from prefect import flow

    @flow
    def ask_once() -> list[str]:
        return ask_for_labels([_pair(0)], heading="test", pairs_per_form=4, timeout_seconds=1, poll_seconds=1)

    # The caller gets this error; the paused run's own state message is the server's "never resumed".
    with pytest.raises(HumanLabelTimeout, match=r"human.timeout_seconds=1 s.*Run the same command again"):
        ask_once()


def _wait_for_pause(seen: set[str], *, deadline: float):
    """The tagged flow run that is PAUSED on a pause not in ``seen`` (then added to it)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilterTags

    paused = flow_runs_in_state("PAUSED", tags=FlowRunFilterTags(all_=[TAG]))
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            for run in client.read_flow_runs(flow_run_filter=paused):
                pause = f"{run.id}/{run.state.state_details.pause_key}"
                if pause not in seen:
                    seen.add(pause)
                    return run
            time.sleep(0.2)
    raise TimeoutError("no flow run paused for human labels")


def _state_type(flow_run_id: UUID) -> str:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state.type.value


def _form_schema(run) -> dict:
    return _form_input(run, "schema")


def _form_input(run, part: str):
    """What a paused run stored for its form: its ``schema`` or its markdown ``description`` (the UI reads both). A
    loaded server may show the run paused a moment before the input it stored reads back: asked again then, for up to
    120 s (30 s ran out once with the suite beside CI's steps on 2 cores; the paused run's thread then outlived the test
    with its code fingerprints pinned, and the worker's later tests of runtime/code.py saw their own edits refused)."""
    from prefect.input.actions import read_flow_run_input

    deadline = time.monotonic() + 120
    while (stored := read_flow_run_input(run.state.state_details.run_input_keyset[part], flow_run_id=run.id)) is None:
        assert time.monotonic() < deadline, f"the paused run {run.id} stored no form {part} in 120 s"
        time.sleep(0.2)
    return stored


def _run_answering(config, answers: list[str], *, try_bad_answers: bool = False):
    """Run iteration 0 in a thread and answer its forms through the API, as the UI's Resume form does.

    Returns the final state, the forms' JSON schemas, and (with ``try_bad_answers``) the refusals
    of two bad answers to the first form followed by that run's state right after them.
    """
    from prefect import tags
    from prefect.flow_runs import resume_flow_run

    from flows.rlhf_pipeline import rlhf_iteration

    outcome: dict = {}

    def run() -> None:
        with tags(TAG):
            outcome["state"] = rlhf_iteration(config, iteration=0, return_state=True)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    seen: set[str] = set()
    deadline = time.monotonic() + 150
    forms, refusals = [], []
    for start in range(0, len(answers), config.human.pairs_per_form):
        paused = _wait_for_pause(seen, deadline=deadline)
        schema = _form_schema(paused)
        forms.append({**schema, "description": _form_input(paused, "description")})
        given = {name: answers[start + offset] for offset, name in enumerate(schema["properties"])}
        if try_bad_answers and start == 0:
            for bad in ({**given, "pair_1": "C"}, {name: "A" for name in list(given)[1:]}):
                with pytest.raises(RuntimeError, match="Validation failed") as refused:
                    resume_flow_run(paused.id, run_input=bad)
                refusals.append(str(refused.value))
            refusals.append(_state_type(paused.id))
        resume_flow_run(paused.id, run_input=given)
    thread.join(timeout=max(deadline - time.monotonic(), 1))
    assert not thread.is_alive(), "the iteration did not finish after its forms were answered"
    return outcome["state"], forms, refusals


@pytest.fixture(scope="module")
def answered(prefect_server, checkpoint_world, tmp_path_factory):
    """One iteration with labeler `human`, its two forms answered (after two refused bad answers)."""
    config = load_config(
        CONFIGS / "tiny.yaml",
        [
            f"run_root={tmp_path_factory.mktemp('human-runs')}",
            f"model.policy={checkpoint_world['policy']}",
            f"data.prompts={checkpoint_world['prompts']}",
            f"data.eval_prompts={checkpoint_world['eval_prompts']}",
            "campaign=human",
            "labeler=human",
            f"sizes.preference_prompts={len(ANSWERS)}",
            "reward_model.eval_fraction=0.7",  # 6 pairs after the two tie/skip answers: 5 held out, 1 to train on
            f"human.pairs_per_form={PAIRS_PER_FORM}",
            "human.poll_seconds=1",
            "human.timeout_seconds=120",
        ],
    )
    return config, *_run_answering(config, ANSWERS, try_bad_answers=True)


def test_bad_answers_are_refused_and_the_run_stays_paused(answered):
    _, _, _, refusals = answered
    assert "'C' is not one of ['A', 'B', 'tie/skip']" in refusals[0]
    assert "'pair_1' is a required property" in refusals[1]
    assert refusals[2] == "PAUSED"


def test_forms_show_each_pair_and_answers_become_human_preferences(answered):
    config, state, forms, _ = answered
    assert state.is_completed(), state
    campaign_dir = config.run_root / config.campaign
    (candidates_dir,) = (campaign_dir / "sample_candidates").iterdir()
    pairs = candidate_pairs(read_table(candidates_dir, "candidates"))
    assert len(pairs) == len(ANSWERS)

    fields = {name: field for form in forms for name, field in form["properties"].items()}
    assert [len(form["properties"]) for form in forms] == [5, 3]
    assert list(fields) == [f"pair_{n}" for n in range(1, len(ANSWERS) + 1)]
    for field in fields.values():
        assert field["enum"] == ["A", "B", "tie/skip"]
    assert forms[0]["description"].endswith(pairs_markdown(pairs[:5], first=0))
    assert forms[1]["description"].endswith(pairs_markdown(pairs[5:], first=5))
    assert forms[1]["description"].startswith(
        "### Campaign `human`, iteration 0: which response is better? (form 2 of 2)"
    )

    preferences = state.result().preferences[-1]
    table = read_table(preferences.directory, "preferences").to_pylist()
    kept = [(pair, answer) for pair, answer in zip(pairs, ANSWERS, strict=True) if answer != "tie/skip"]
    assert [(row["prompt"], row["chosen"], row["rejected"]) for row in table] == [
        (pair.prompt.text, *((pair.first, pair.second) if answer == "A" else (pair.second, pair.first)))
        for pair, answer in kept
    ]
    assert {row["labeler"] for row in table} == {"human"} and {row["margin"] for row in table} == {0.0}
    assert preferences.metrics["pairs"] == 6 and preferences.metrics["tie_fraction"] == pytest.approx(2 / 8)

    (labels_dir,) = (campaign_dir / "human_labels").iterdir()
    assert read_table(labels_dir, "human_labels").column("choice").to_pylist() == ANSWERS
    assert read_manifest(preferences.directory).upstream["labels"] == read_manifest(labels_dir).digest


def test_running_again_reuses_the_answers_without_asking(answered):
    from prefect import get_client, tags

    from flows.rlhf_pipeline import rlhf_iteration

    config, first, _, _ = answered
    with tags(TAG):  # a pause would block until human.timeout_seconds and fail
        state = rlhf_iteration(config, iteration=0, return_state=True)
    assert state.is_completed(), state
    again, before = state.result(), first.result()
    assert again.preferences[-1].reused and again.preferences[-1].digest == before.preferences[-1].digest
    with get_client(sync_client=True) as client:  # the run never paused to ask (not a bound on its seconds)
        history = client.read_flow_run_states(state.state_details.flow_run_id)
    assert [s.name for s in history if s.is_paused()] == [], [s.name for s in history]


def test_relabel_asks_again_and_other_answers_make_other_preferences(answered):
    config, first, _, _ = answered
    relabelled = config.model_copy(update={"human": config.human.model_copy(update={"relabel": 1})})
    other = ["B" if answer == "A" else "A" for answer in ANSWERS]  # every pair flipped, none skipped
    state, forms, _ = _run_answering(relabelled, other)
    assert state.is_completed(), state
    assert len(forms) == 2
    before, after = first.result().preferences[-1], state.result().preferences[-1]
    assert not after.reused and after.digest != before.digest and after.metrics["pairs"] == len(ANSWERS)


def test_issue14_each_form_is_saved_as_it_arrives_so_a_failed_run_asks_only_the_rest(answered):
    """Form 1 answered, form 2 left to time out (the run fails); the next run asks form 2 only."""
    from prefect import tags
    from prefect.flow_runs import resume_flow_run

    from flows.rlhf_pipeline import rlhf_iteration

    config, _, _, _ = answered
    human = config.human.model_copy(update={"relabel": 2, "timeout_seconds": 6})
    relabelled = config.model_copy(update={"human": human})
    outcome: dict = {}

    def run() -> None:
        with tags(TAG):
            outcome["state"] = rlhf_iteration(relabelled, iteration=0, return_state=True)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    seen: set[str] = set()
    first = _wait_for_pause(seen, deadline=time.monotonic() + 60)
    resume_flow_run(first.id, run_input={name: "A" for name in _form_schema(first)["properties"]})
    thread.join(timeout=60)
    assert not thread.is_alive() and outcome["state"].is_failed(), "form 2 was left unanswered: the run fails"

    again = ["A"] * PAIRS_PER_FORM + ANSWERS[PAIRS_PER_FORM:]
    state, forms, _ = _run_answering(relabelled, again[PAIRS_PER_FORM:])
    assert state.is_completed(), state
    assert [list(form["properties"]) for form in forms] == [["pair_6", "pair_7", "pair_8"]]
    labels_dirs = sorted(
        (config.run_root / config.campaign / "human_labels").iterdir(), key=lambda p: p.stat().st_mtime
    )
    assert read_table(labels_dirs[-1], "human_labels").column("choice").to_pylist() == again
    assert not list((config.run_root / config.campaign / "human_labels").glob("*.partial"))


def test_the_labelling_page_shows_each_prompt_once_with_a_and_b_side_by_side():
    shared = Prompt("same <b>prompt</b>")
    pairs = [
        CandidatePair(prompt=shared, first="a1 <script>alert(1)</script>", second="", first_ids=[1], second_ids=[2]),
        CandidatePair(prompt=shared, first="a2", second="b2", first_ids=[1], second_ids=[2]),
        _pair(7),
    ]
    form = LabelForm(title="t", pairs=pairs, fields=["pair_3", "pair_4", "pair_5"], submit=lambda answers: None)
    page = page_html(form, chosen={"pair_4": "B"}, error="pair 3 has none")
    assert page.count("same &lt;b&gt;prompt&lt;/b&gt;") == 1 and page.count('class="prompt"') == 2
    assert "a1 &lt;script&gt;" in page and "<script>alert" not in page  # a response's markup shows as text
    assert '<pre class="response b"><b>B</b><i>(empty)</i></pre>' in page
    assert page.count('class="sides"') == 3 and page.count('type="radio"') == 9
    assert page.count(" checked>") == 1 and 'name="pair_4" value="B" checked' in page
    assert '<p class="error">pair 3 has none</p>' in page


def test_answers_from_the_page_need_one_choice_per_pair_of_this_form():
    fields = ["pair_1", "pair_2"]
    assert answers_from_form("pair_1=A&pair_2=tie%2Fskip", fields) == {"pair_1": "A", "pair_2": "tie/skip"}
    for body, message in [
        ("pair_1=A", "pair 2 has none"),
        ("", "pair 1, 2 have none"),
        ("pair_1=A&pair_2=C", "not a choice"),
        ("pair_1=A&pair_2=B&pair_9=A", "this form has no pair_9"),
    ]:
        with pytest.raises(ValueError, match=message):
            answers_from_form(body, fields)


def test_the_labelling_page_resumes_the_paused_run_form_after_form(prefect_server):
    """A real paused flow run, its page fetched and sent over HTTP as a browser does: a send missing a pair
    is refused and the run stays paused; each complete send resumes it, and the next form appears."""
    import io
    import logging
    import re
    import urllib.error
    import urllib.parse
    import urllib.request

    from prefect import flow, tags

    pairs = [_pair(index) for index in range(3)]
    answers = ["B", "tie/skip", "A"]
    outcome: dict = {}

    @flow
    def ask() -> list[str]:
        return ask_for_labels(pairs, heading="page test", pairs_per_form=2, timeout_seconds=120, poll_seconds=1)

    def run() -> None:
        with tags(TAG):
            outcome["choices"] = ask()

    def send(url: str, fields: dict[str, str]) -> tuple[int, str]:
        request = urllib.request.Request(url, data=urllib.parse.urlencode(fields).encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    console = StageConsole(io.StringIO())  # what `rlhf run` prints on the terminal
    logging.getLogger("prefect.flow_runs").addHandler(console)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    seen: set[str] = set()
    deadline = time.monotonic() + 120
    first = _wait_for_pause(seen, deadline=deadline)
    (url,) = set(re.findall(r"\((http://127\.0\.0\.1:\d+/)\)", _form_input(first, "description")))
    logging.getLogger("prefect.flow_runs").removeHandler(console)
    shown = console.stream.getvalue()
    assert f"  page test: waiting for a person to answer form 1 of 2 (2 pairs): label them at {url}, or press " in shown
    assert "Resume on the run in the Prefect UI, http://127.0.0.1:" in shown and f"/runs/flow-run/{first.id}" in shown
    with urllib.request.urlopen(url, timeout=30) as response:
        page = response.read().decode()
    assert "page test: form 1 of 2" in page and "prompt 0" in page and "prompt 1" in page and "prompt 2" not in page

    status, refused = send(url, {"pair_1": "B"})
    assert status == 400 and "pair 2 has none" in refused and 'name="pair_1" value="B" checked' in refused
    assert _state_type(first.id) == "PAUSED"

    status, sent = send(url, {"pair_1": "B", "pair_2": "tie/skip"})
    assert status == 200 and "Sent 2 answers" in sent
    second = _wait_for_pause(seen, deadline=deadline)
    with urllib.request.urlopen(url, timeout=30) as response:
        assert "page test: form 2 of 2" in response.read().decode()
    assert send(url, {"pair_3": "A"})[0] == 200
    thread.join(timeout=60)
    assert not thread.is_alive() and outcome["choices"] == answers
    assert _state_type(second.id) == "COMPLETED"


def test_a_taken_page_port_is_refused_naming_the_setting():
    import errno
    import socket

    from flows.cli import _user_error
    from flows.label_page import LabelPage, serving

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError, match=r"cannot listen on 127.0.0.1:\d+ .*set `human.page_port`") as refused:
            with serving(LabelPage(), host="127.0.0.1", port=taken.getsockname()[1]):
                pass
    assert refused.value.errno == errno.EADDRINUSE and _user_error(refused.value)  # one line from `rlhf`, exit 2


def test_tie_skip_answers_that_leave_too_few_pairs_fail_in_one_line_saying_how_to_be_asked_again(answered):
    """8 pairs, 7 answered tie/skip: 1 left, which 0.7 holds out, leaving none to train on (issue 43: few held-out
    pairs are not refused, none to train on is). A user error, not a bug: `rlhf` prints it in one line with exit code
    2, and the message says how to be asked again."""
    from flows.cli import _user_error
    from tasks.train_reward_model import TooFewPairs

    config, _, _, _ = answered
    relabelled = config.model_copy(update={"human": config.human.model_copy(update={"relabel": 3})})
    state, _, _ = _run_answering(relabelled, ["A", *["tie/skip"] * 7])
    assert state.is_failed()
    with pytest.raises(
        TooFewPairs, match=r"holds out 1 and leaves 0 to train on.*run the same command with a new `human.relabel`"
    ) as failed:
        state.result()
    assert _user_error(failed.value)


def test_issue43_with_asking_a_person_is_shown_only_the_asked_pairs_the_held_out_ones_first(answered):
    """`asking.select` random, 4 of the 8 pairs: the page shows those 4 (ceil(4 x 0.7) = 3 drawn to be held out,
    then 1), the answers name their pairs, and the reward model holds out the 3 and trains on the 1."""
    from runtime.seeds import stage_seed
    from tasks.pairing import HELD_OUT_HEAD, askable_pairs, asked_pairs

    config, _, _, _ = answered
    asking = config.asking.model_copy(update={"select": "random", "pairs": 4})
    state, forms, _ = _run_answering(config.model_copy(update={"asking": asking}), ["A", "B", "A", "B"])
    assert state.is_completed(), state
    campaign_dir = config.run_root / config.campaign
    (candidates_dir,) = (campaign_dir / "sample_candidates").iterdir()
    pairs = candidate_pairs(read_table(candidates_dir, "candidates"))
    askable = askable_pairs(pairs)
    drawn = asked_pairs(len(askable), None, budget=4, held_out=3, seed=stage_seed(config.seed, "human_labels", 0))
    held_out, chosen = [askable[index] for index in drawn.held_out], [askable[index] for index in drawn.chosen]
    shown = [pairs[index] for index in [*held_out, *chosen]]
    assert [len(form["properties"]) for form in forms] == [4]
    assert forms[0]["description"].endswith(pairs_markdown(shown, first=0))
    labels = state.result().preferences[-1]
    (answers,) = [
        path
        for path in (campaign_dir / "human_labels").iterdir()
        if read_manifest(path).digest == read_manifest(labels.directory).upstream["labels"]
    ]
    assert read_table(answers, "human_labels").column("pair_id").to_pylist() == [*held_out, *chosen]
    assert labels.metrics[HELD_OUT_HEAD] == 3 and labels.metrics["asked_pairs"] == 4
    assert state.result().reward_model.metrics["eval_pairs"] == 3


@pytest.mark.slow
def test_issue43_a_person_is_asked_a_page_of_fresh_pairs_while_too_few_answers_had_a_winner(
    prefect_server, checkpoint_world, tmp_path
):
    """`sizes.decisive_pairs` with labeler human: each round is a page of its own; the first page's three tie/skip
    answers leave 1 decisive pair of the 4 asked for, so a second page asks about fresh prompts' candidates."""
    config = load_config(
        CONFIGS / "tiny.yaml",
        [
            f"run_root={tmp_path / 'runs'}",
            f"model.policy={checkpoint_world['policy']}",
            f"data.prompts={checkpoint_world['prompts']}",
            f"data.eval_prompts={checkpoint_world['eval_prompts']}",
            "campaign=human-rounds",
            "labeler=human",
            "sizes.preference_prompts=4",  # x 2 candidates: 4 pairs, one page, a round
            "sizes.decisive_pairs=4",
            "sizes.max_rounds=2",
            "human.pairs_per_form=4",
            "human.poll_seconds=1",
            "human.timeout_seconds=120",
        ],
    )
    answers = ["A", "tie/skip", "tie/skip", "tie/skip", "B", "A", "tie/skip", "A"]  # 1 winner, then 3
    state, forms, _ = _run_answering(config, answers)
    assert state.is_completed(), state
    assert [form["description"].split("\n")[0] for form in forms] == [
        "### Campaign `human-rounds`, iteration 0: which response is better? (form 1 of 1)"
    ] * 2  # a page a round
    preferences = state.result().preferences
    assert [result.metrics["decisive_pairs"] for result in preferences] == [1, 3]
    assert [result.metrics["ties"] for result in preferences] == [3, 1]
    campaign_dir = config.run_root / config.campaign
    prompt_ids = sorted(
        sorted(set(read_table(folder, "candidates").column("prompt_id").to_pylist()))
        for folder in (campaign_dir / "sample_candidates").iterdir()
    )
    assert prompt_ids == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the second page's prompts are fresh
    assert len(list((campaign_dir / "human_labels").iterdir())) == 2
