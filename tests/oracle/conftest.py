"""The oracle tier runs only where asked for (``make oracle``: ``-m oracle``), like e2e: it needs
the Megatron-LM snapshots and imports torch in two processes."""

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "oracle" in (config.option.markexpr or ""):
        return
    here = [
        item for item in items if item.path.is_relative_to(config.rootpath / "tests" / "oracle")
    ]
    if here:
        config.hook.pytest_deselected(items=here)
        items[:] = [item for item in items if item not in here]
