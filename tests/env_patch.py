"""`EnvMonkeyPatch`: pytest's MonkeyPatch, made to tell fdlite/envs.py of every change to the environment.

fdlite reads each environment variable once, at its first use, and caches it (fdlite/envs.py); a test that sets
one before constructing things needs the next read to see it. tests/conftest.py makes the `monkeypatch` fixture
an EnvMonkeyPatch; module-scoped fixtures use `EnvMonkeyPatch.context()` in place of `pytest.MonkeyPatch.context()`.
"""

from __future__ import annotations

import pytest

from fdlite import envs


class EnvMonkeyPatch(pytest.MonkeyPatch):
    def setenv(self, name: str, value: str, prepend: str | None = None) -> None:
        super().setenv(name, value, prepend)
        envs.refresh()

    def delenv(self, name: str, raising: bool = True) -> None:
        super().delenv(name, raising)
        envs.refresh()

    def undo(self) -> None:
        super().undo()
        envs.refresh()
