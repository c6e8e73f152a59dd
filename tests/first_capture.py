"""Imported once by the server that the test worlds' ranks fork from (tests/conftest.py
preloads it): it captures and analyzes the tiny test models, so that each rank starts
with what a process's first capture fills in (torch's and sympy's caches, the tables
torch.export, transformers and autopart build on first use) and pays for its own
capture alone. Nothing of the captures is kept.

It leaves no thread running, since none would survive the fork (one thread for torch,
no progress-bar monitor for the analysis's `fx.Interpreter`), and hides its warnings:
a rank that warns must warn as if it were the first to."""

from __future__ import annotations

import warnings

import torch
from tqdm import tqdm

from autopart.api import captured_for_planning
from tests.models import tiny_gpt2, tiny_llama, token_batch


def _capture_each() -> None:
    ids, _ = token_batch(8)
    for build in (tiny_llama, tiny_gpt2):
        captured_for_planning(build(), (ids,))


torch.set_num_threads(1)  # as in every rank
interval, tqdm.monitor_interval = tqdm.monitor_interval, 0
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _capture_each()
finally:
    tqdm.monitor_interval = interval
