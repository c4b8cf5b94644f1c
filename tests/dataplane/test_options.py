"""SchedulerOptions: checked once, at construction, with errors that name the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ppipe.dataplane.options import SchedulerOptions
from ppipe.errors import UserError


def test_defaults_and_queue_bounds():
    assert SchedulerOptions().queue_bound("m") is None
    assert SchedulerOptions(max_queue=3).queue_bound("m") == 3
    per_model = SchedulerOptions.from_kwargs({"max_queue": {"a": 2}})
    assert (per_model.queue_bound("a"), per_model.queue_bound("b")) == (2, None)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"max_queue": 0}, "max_queue must be a positive integer per model, got 0"),
        ({"max_queue": {"a": 0}}, "max_queue must be a positive integer per model, got 0"),
        ({"max_queue": True}, "max_queue"),
        ({"local_transfer_gbps": 0.0}, "local_transfer_gbps: Input should be greater than 0"),
        ({"inflight_grace_us": -1.0}, "inflight_grace_us: Input should be greater than or equal to 0"),
        ({"prune_threshold": 0}, "prune_threshold: Input should be greater than or equal to 1"),
        ({"min_batch_on_overload": -1}, "min_batch_on_overload: Input should be greater than or equal to 0"),
        ({"max_queeu": 3}, "did you mean 'max_queue'"),
    ],
)
def test_bad_options_are_user_errors_naming_the_field(options, message):
    with pytest.raises(UserError, match=message):
        SchedulerOptions.from_kwargs(options)


def test_frozen_and_checked_when_built_directly():
    opts = SchedulerOptions()
    with pytest.raises(ValidationError):
        opts.prune_threshold = 3
    with pytest.raises(ValidationError):
        SchedulerOptions(prune_threshold=0)
