"""Shared test setup: `gpu` tests skip cleanly without CUDA."""
import pytest
import torch


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
