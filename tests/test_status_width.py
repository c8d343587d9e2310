"""``fedpipe status`` piped to a file or another program draws wide enough for a job's
plan table (Rich alone draws 80 columns there)."""
from __future__ import annotations

import pytest

from fedpipe.observe.status import PIPED_WIDTH, status_console

pytestmark = pytest.mark.timeout(30)


def test_status_piped_draws_at_the_piped_width_unless_columns_says(monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    console = status_console()  # stdout is pytest's capture: not a terminal
    assert not console.is_terminal
    assert console.width == PIPED_WIDTH > 80
    monkeypatch.setenv("COLUMNS", "100")
    assert status_console().width == 100
