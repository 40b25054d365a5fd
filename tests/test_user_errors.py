"""User errors are recognised by type: every layer's own subclasses :class:`rlhf_core.errors.UserError`, and the
command line reports them in one line with their exit code, without importing the modules that raise them."""

from __future__ import annotations

import pytest

from flows.cli import _user_error
from rlhf_core.errors import UserError


@pytest.mark.parametrize(
    "name",
    [
        "campaign.config:ConfigError",
        "flows.inputs:InputError",
        "flows.prefect_server:PrefectServerError",
        "flows.human_labels:HumanLabelTimeout",
        "storage.importers:ImportFormatError",
        "storage.manifest:CorruptOutputError",
        "storage.tracking:MissingOutputError",
        "storage.locks:LockHeld",
        "storage.locks:UnsafeLockFile",
        "tasks.train_reward_model:TooFewPairs",
        "tasks.reward_function:RewardFunctionError",
        "runtime.references:EnvironmentClassError",
        "tasks.episodes:EveryEpisodeFailed",
        "tasks.reference_logprobs:NoDecisivePair",
        "tasks.sft:NothingToLearn",
        "tasks.sft:PackingUnsupported",
        "tasks.sft_text:ChatTemplateError",
        "campaign.model_sources:ModelSourceError",
        "flows.inspection:InspectError",
    ],
)
def test_each_layers_user_errors_are_user_errors(name):
    import importlib

    module, _, attribute = name.partition(":")
    error_type = getattr(importlib.import_module(module), attribute)
    assert issubclass(error_type, UserError)


def test_the_command_line_tells_user_errors_from_bugs_by_type():
    from flows.human_labels import HumanLabelTimeout
    from storage.locks import LockHeld

    assert _user_error(LockHeld("campaign `demo` is running")) and LockHeld.exit_code == 2
    assert HumanLabelTimeout.exit_code == 3
    assert not _user_error(KeyError("a bug")) and not _user_error(TypeError("a bug"))
