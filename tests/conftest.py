"""Shared test setup: `gpu` tests skip cleanly without CUDA."""
import os

import pytest
import torch

# Tests that compare accelerated pipelines with diffusers' own need the same attention kernel on both
# sides: runners made from the environment here (and in Ray workers started by the tests) use PyTorch's
# SDPA. Tests of the kernel choice set TransformerOptions.attention_backend themselves.
os.environ.setdefault("BCG_ATTENTION_BACKEND", "sdpa")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU host: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def saved_figures(monkeypatch):
    """Every matplotlib figure saved while the test runs, in order (the figure object, after ``savefig``)."""
    from matplotlib.figure import Figure

    figures, savefig = [], Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures
