"""A labelling page served by the waiting flow: the pairs side by side, one click per choice.

Prefect's Resume form is a 512-pixel modal with a dropdown per pair, fine for a few pairs and tiring for
twenty. While a flow run waits for labels (:func:`flows.human_labels.ask_for_labels`), its process also
serves this page: each prompt once, then each of its pairs with responses A and B side by side (long
responses wrap and scroll within their box), and under each pair three buttons, "A is better", "tie / skip"
and "B is better". **Send** checks that every pair has an answer and resumes the paused run with them, exactly
as the Resume form would (:func:`prefect.flow_runs.resume_flow_run`: the server checks them against the same
form schema); the run then asks its next form on the same page.

Choices:
1. The page belongs to the flow process, started when the first form is asked and stopped when the last is
   answered, so it exists exactly while there is something to label and needs no server of its own. Either
   way of answering resumes the run; the other one then finds it no longer paused.
2. Plain HTML and a few lines of script (a running count of the answers); every text is escaped, so a
   response holding markup shows as text. No authentication: it listens on ``human.page_host``, 127.0.0.1
   by default (a person on another machine reaches it through an SSH tunnel, or with a host they trust).
"""

from __future__ import annotations

import contextvars
import html
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

from tasks.labelers import HUMAN_CHOICES, SKIP, CandidatePair

logger = logging.getLogger(__name__)

Submit = Callable[[dict[str, str]], None]
"""Sends a form's answers (field name -> choice) to the waiting run; raises with a message if it cannot."""

_BUTTONS = {"A": "A is better", SKIP: "tie / skip", "B": "B is better"}
_STYLE = """
body { font: 16px/1.5 system-ui, sans-serif; color: #1d2129; background: #f4f5f7; margin: 0; }
main { max-width: 1280px; margin: 0 auto; padding: 1rem 2rem 6rem; }
h1 { font-size: 1.4rem; margin: 1rem 0 .25rem; }
.help { color: #4a5160; margin: 0 0 1rem; }
.error { background: #fde8e8; border: 1px solid #e0a0a0; border-radius: 6px; padding: .75rem 1rem; }
.prompt { background: #fff; border-left: 4px solid #5b6b85; border-radius: 6px; padding: .75rem 1rem; margin: 2rem 0 .75rem; }
.prompt h2 { font-size: .8rem; text-transform: uppercase; letter-spacing: .05em; color: #5b6b85; margin: 0; }
.pair { margin: 0 0 1.5rem; }
.pair h3 { font-size: .95rem; margin: .5rem 0; }
.sides { display: grid; grid-template-columns: 1fr 1fr; gap: 1rem; }
.response { font: inherit; background: #fff; border: 2px solid #d5d9e0; border-radius: 6px; padding: .5rem .75rem;
            white-space: pre-wrap; overflow-wrap: anywhere; max-height: 22rem; overflow-y: auto; margin: 0; }
.response b { display: block; font-size: .8rem; color: #5b6b85; }
.pair:has(input[value="A"]:checked) .a, .pair:has(input[value="B"]:checked) .b { border-color: #2f6fde; }
.choices { display: flex; justify-content: center; gap: .5rem; margin-top: .5rem; }
.choices input { position: absolute; opacity: 0; }
.choices span { display: inline-block; padding: .35rem 1.1rem; border: 1px solid #9aa3b2; border-radius: 999px;
                background: #fff; cursor: pointer; user-select: none; }
.choices input:checked + span { background: #2f6fde; border-color: #2f6fde; color: #fff; }
.choices input:focus-visible + span { outline: 2px solid #2f6fde; outline-offset: 2px; }
footer { position: fixed; bottom: 0; left: 0; right: 0; background: #fff; border-top: 1px solid #d5d9e0; }
footer div { max-width: 1280px; margin: 0 auto; padding: .75rem 2rem; display: flex; gap: 1rem; align-items: center; }
footer button { font: inherit; padding: .45rem 1.5rem; border: 0; border-radius: 6px; background: #2f6fde; color: #fff; cursor: pointer; }
"""
_COUNT_SCRIPT = """
const form = document.querySelector("form"), count = document.getElementById("count");
const update = () => { count.textContent = form.querySelectorAll("input:checked").length; };
form.addEventListener("change", update); update();
"""


@dataclass(frozen=True)
class LabelForm:
    """One form as the page shows it: its pairs, their field names (``pair_<n>``, as the Resume form has them)
    and how to send the answers."""

    title: str
    pairs: Sequence[CandidatePair]
    fields: Sequence[str]
    submit: Submit


def page_html(form: LabelForm, *, chosen: dict[str, str] | None = None, error: str | None = None) -> str:
    """The page of ``form``: each prompt once, then each of its pairs, A and B side by side, and three buttons.

    Args:
        chosen: answers to show as already chosen (after a refused send, the person's choices are kept).
        error: shown above the pairs.
    """
    chosen = chosen or {}
    blocks, previous = [], None
    for pair, field in zip(form.pairs, form.fields, strict=True):
        if pair.prompt != previous:
            blocks.append(f'<section class="prompt"><h2>Prompt</h2>{_text(pair.prompt.text)}</section>')
            previous = pair.prompt
        number = field.removeprefix("pair_")
        buttons = "".join(
            f'<label><input type="radio" name="{field}" value="{html.escape(choice)}"'
            f"{' checked' if chosen.get(field) == choice else ''}><span>{label}</span></label>"
            for choice, label in _BUTTONS.items()
        )
        blocks.append(
            f'<section class="pair"><h3>Pair {number}</h3><div class="sides">'
            f'<pre class="response a"><b>A</b>{_text(pair.first)}</pre>'
            f'<pre class="response b"><b>B</b>{_text(pair.second)}</pre></div>'
            f'<div class="choices">{buttons}</div></section>'
        )
    notice = f'<p class="error">{html.escape(error)}</p>' if error else ""
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(form.title)}</title>'
        f"<style>{_STYLE}</style></head><body><main><h1>{html.escape(form.title)}</h1>"
        '<p class="help">Which response is better? Choose A or B for each pair, or "tie / skip" when neither is '
        "(the pair is then left out of the preference data). <b>Send</b> resumes the run.</p>"
        f'{notice}<form method="post">{"".join(blocks)}'
        f'<footer><div><button type="submit">Send</button><span><span id="count">0</span> of {len(form.fields)} '
        f"answered</span></div></footer></form></main><script>{_COUNT_SCRIPT}</script></body></html>"
    )


def _text(text: str) -> str:
    return html.escape(text) if text else "<i>(empty)</i>"


def answers_from_form(body: str, fields: Sequence[str]) -> dict[str, str]:
    """The answers an ``application/x-www-form-urlencoded`` send holds, one per field.

    Raises:
        ValueError: a pair without an answer (named by number), an answer that is not a choice, or a field
            this form does not have.
    """
    sent = parse_qs(body, keep_blank_values=True)
    unknown = sorted(set(sent) - set(fields))
    if unknown:
        raise ValueError(f"this form has no {', '.join(unknown)}: reload the page to see the current form")
    missing = [field.removeprefix("pair_") for field in fields if not sent.get(field)]
    if missing:
        raise ValueError(
            f"every pair needs an answer; pair {', '.join(missing)} {'has' if len(missing) == 1 else 'have'} none"
        )
    answers = {field: sent[field][-1] for field in fields}
    bad = {field: answer for field, answer in answers.items() if answer not in HUMAN_CHOICES}
    if bad:
        raise ValueError(f"not a choice: {bad} (choices: {', '.join(HUMAN_CHOICES)})")
    return answers


class LabelPage:
    """The page's state: the form being asked (None between forms), shared with the server's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._form: LabelForm | None = None
        self.url = ""

    def show(self, form: LabelForm) -> None:
        with self._lock:
            self._form = form

    def clear(self) -> None:
        with self._lock:
            self._form = None

    def get(self) -> tuple[HTTPStatus, str]:
        with self._lock:
            form = self._form
        return (HTTPStatus.OK, page_html(form)) if form is not None else (HTTPStatus.OK, _waiting_html())

    def post(self, body: str) -> tuple[HTTPStatus, str]:
        """Check and send one form's answers; the form leaves the page once they are sent."""
        with self._lock:
            form = self._form
        if form is None:
            return HTTPStatus.CONFLICT, _waiting_html("These answers were not sent: no form is waiting for them.")
        try:
            answers = answers_from_form(body, form.fields)
        except ValueError as error:
            chosen = {field: values[-1] for field, values in parse_qs(body).items()}
            return HTTPStatus.BAD_REQUEST, page_html(form, chosen=chosen, error=str(error))
        try:
            form.submit(answers)
        except Exception as error:  # noqa: BLE001 - whatever Prefect says, the person must read it
            return HTTPStatus.CONFLICT, page_html(form, chosen=answers, error=f"not sent: {error}")
        with self._lock:
            if self._form is form:
                self._form = None
        logger.info("%s: %d answers sent from the labelling page", form.title, len(answers))
        return HTTPStatus.OK, _waiting_html(f"Sent {len(answers)} answers. The run resumes.")


def _waiting_html(message: str = "No form is waiting for answers right now.") -> str:
    """Between forms: reloads itself every 2 s, so the next form appears on its own."""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">'
        f"<title>Labelling</title><style>{_STYLE}</style></head><body><main><h1>{html.escape(message)}</h1>"
        '<p class="help">The next form, if the run asks one, appears here by itself.</p></main></body></html>'
    )


@contextmanager
def serving(page: LabelPage, *, host: str, port: int) -> Iterator[str]:
    """Serve ``page`` on ``host:port`` (0: any free port) in a thread until the block ends; yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
            self._reply(*page.get())

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            self._reply(*page.post(self.rfile.read(length).decode("utf-8", errors="replace")))

        def _reply(self, status: HTTPStatus, body: str) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
            logger.debug("label page: " + format, *args)

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as error:  # a port another program (or another waiting run) holds, a host not of this machine
        raise OSError(
            error.errno,
            f"the labelling page cannot listen on {host}:{port} ({error.strerror}): set `human.page_port` to a free "
            "port, or 0 for any, and `human.page_host` to an address of this machine",
        ) from error
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="label-page", daemon=True)
    thread.start()
    shown_host = "127.0.0.1" if host in ("", "0.0.0.0") else host
    page.url = f"http://{shown_host}:{server.server_address[1]}/"
    try:
        yield page.url
    finally:
        server.shutdown()
        server.server_close()


def resume_when_paused(flow_run_id: object, *, wait_seconds: float = 15.0) -> Submit:
    """A :data:`Submit` that resumes the flow run with the answers, waiting up to ``wait_seconds`` for it to be
    paused (answers sent the moment a form appears can arrive before the run has paused on it)."""
    from prefect.exceptions import NotPausedError
    from prefect.flow_runs import resume_flow_run

    flow_context = contextvars.copy_context()  # the flow's Prefect settings (its API), for the page's threads

    def submit(answers: dict[str, str]) -> None:
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                flow_context.copy().run(resume_flow_run, flow_run_id, run_input=answers)
                return
            except NotPausedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    return submit
