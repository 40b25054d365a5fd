"""Environments by name: the contract's refusals, one line each, before any episode."""

from __future__ import annotations

import pytest

from runtime.references import EnvironmentClassError, EnvironmentReference, load_environment
from tests.environments import Guess


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module:Guess", "cannot import module 'no_such_module'"),
        ("tests.environments:Nothing", "has no attribute 'Nothing'"),
        ("tests.environments:NOT_A_CLASS", "is not a class"),
        ("tests.environments:NeedsArguments", "cannot be constructed with no arguments"),
        ("tests.environments:NoStep", "has no method `step(self, action: str)"),
        ("tests.environments:PositionalReset", ".reset cannot be called as `reset(self, *, seed: int, row: dict)"),
        ("tests.environments:StepWithoutAction", ".step cannot be called as `step(self, action: str)"),
        ("tests.environments:SaysMaybe", ".deterministic is 'maybe': it must be True or False"),
    ],
)
def test_a_class_not_of_the_contracts_shape_is_refused_in_one_line_naming_the_setting(name, message):
    with pytest.raises(EnvironmentClassError) as refused:
        EnvironmentReference.of(name)
    text = str(refused.value)
    assert text.startswith(f"`environment.class` {name!r}") or text.startswith("`environment.class` cannot import")
    assert message in text and "\n" not in text


def test_a_module_that_fails_as_it_imports_is_not_importable_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_env.py").write_text("class Guess:\n    pass\n\nraise RuntimeError('no\\nmore')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvironmentClassError, match="cannot import module 'broken_env' .*: RuntimeError: no \\("):
        load_environment("broken_env:Guess")


def test_a_reference_is_keyed_by_its_modules_code_and_declares_determinism():
    reference = EnvironmentReference.of("tests.environments:Guess")
    assert reference.load() is Guess and len(reference.code) == 64
    assert not load_environment("tests.environments:Coin").deterministic
