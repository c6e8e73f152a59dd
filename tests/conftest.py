"""The test suite's worlds fork their ranks from one process that has imported the test
models (Hugging Face `transformers` and the modeling code of the models the worlds
build) and harness once (`autopart.testing.preload`): a rank that imported a model's
modeling code itself would pay for it, and for what `transformers` loads with the
first model, in every world. The server also captures the tiny models once
(`tests.first_capture`), so that a rank's own first capture finds torch's caches warm."""

from autopart.testing import preload

preload(
    "tests.models",
    "tests.harness",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.mixtral.modeling_mixtral",
    "tests.first_capture",
)
