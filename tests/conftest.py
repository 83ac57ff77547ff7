import pytest

import mx_lbsgd  # noqa: F401  (registers 'lbsgd')


@pytest.fixture(autouse=True)
def _no_fused_env(monkeypatch):
    """Tests choose the kernel path themselves."""
    monkeypatch.delenv('MX_LBSGD_FUSED', raising=False)
