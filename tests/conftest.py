import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from env_patch import EnvMonkeyPatch  # noqa: E402

from fdlite import envs  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _fdlite_cache(tmp_path_factory):
    # The built-in default model is built once per test session, never in the home folder.
    os.environ.setdefault("FDLITE_CACHE", str(tmp_path_factory.mktemp("fdlite-cache")))
    envs.refresh()


@pytest.fixture
def monkeypatch():
    """pytest's fixture, but fdlite/envs.py re-reads the environment after each setenv / delenv / undo."""
    mp = EnvMonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(autouse=True)
def _fresh_envs():
    """Every test starts from the environment as it is (fdlite/envs.py caches what it read)."""
    envs.refresh()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """family -> folder of a random-weight HF model written by transformers."""
    from hf_models import FAMILIES, write_random_model

    root = tmp_path_factory.mktemp("models")
    return {fam: write_random_model(str(root / fam), fam) for fam in FAMILIES}
