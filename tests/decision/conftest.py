import pytest

from tests.support import synthetic


@pytest.fixture
def syn(tmp_path):
    """The synthetic study (tests/support/synthetic.py) in `tmp_path`: (study, config, tmp_path)."""
    study, config = synthetic.build(tmp_path)
    return study, config, tmp_path
