"""The test suite's worlds fork their ranks from one process that has imported the test
models (Hugging Face `transformers`) and harness once (`autopart.testing.preload`)."""

from autopart.testing import preload

preload("tests.models", "tests.harness")
