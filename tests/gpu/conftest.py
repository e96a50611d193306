"""The GPU tier runs on the end-to-end tier's sources and shares its launch cache
(tests/e2e/conftest.py): the same ``MEGATRON_LM`` or snapshots, the ``newest_release`` fixture, and
each test's report naming its source."""

from tests.e2e.conftest import _name_the_source, launches, pytest_generate_tests  # noqa: F401
