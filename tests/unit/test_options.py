"""One options value: every surface that takes step options takes exactly the fields of
:class:`~cyclone_mp.steps.StepOptions` (the enqueue surfaces all but the step-only ones),
so a new option that misses a surface fails here."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import cyclone_mp as cy
from cyclone_mp.async_client import AsyncClient
from cyclone_mp.client import Client
from cyclone_mp.steps import STEP_ONLY_OPTIONS, StepOptions
from cyclone_mp_cli.main import cli

OPTIONS = {field.name for field in dataclasses.fields(StepOptions)}
ENQUEUE_OPTIONS = OPTIONS - STEP_ONLY_OPTIONS


def accepted(fn) -> set[str]:
    return set(inspect.signature(fn).parameters) & OPTIONS


def test_step_only_options_are_options():
    assert STEP_ONLY_OPTIONS < OPTIONS


@pytest.mark.parametrize("fn", [cy.step, StepOptions.build], ids=["step()", "StepOptions.build"])
def test_the_step_takes_every_option(fn):
    assert accepted(fn) == OPTIONS


@pytest.mark.parametrize("fn", [Client.enqueue, Client.enqueue_many, AsyncClient.enqueue, AsyncClient.enqueue_many],
                         ids=["Client.enqueue", "Client.enqueue_many", "AsyncClient.enqueue",
                              "AsyncClient.enqueue_many"])
def test_each_enqueue_takes_the_enqueue_options(fn):
    assert accepted(fn) == ENQUEUE_OPTIONS


def test_the_cli_enqueue_takes_the_enqueue_options():
    params = {param.name for param in cli.commands["enqueue"].params}
    assert params & OPTIONS == ENQUEUE_OPTIONS
