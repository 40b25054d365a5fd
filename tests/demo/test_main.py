"""``python -m demo``: build (or reuse) the demo world and show what its model writes (issue 26: it crashed)."""

from __future__ import annotations

import functools

import demo.__main__ as demo_main
from demo.build import build_default_world
from tests.demo.test_build import TINY


def test_issue26_python_m_demo_prints_samples_and_their_mean_gold_score(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo_main, "build_default_world", functools.partial(build_default_world, config=TINY))
    demo_main.main(["--cache-dir", str(tmp_path / "world")])
    output = capsys.readouterr().out
    assert "prompt | response" in output
    assert f"mean gold score of {TINY.num_eval_prompts} samples" in output
