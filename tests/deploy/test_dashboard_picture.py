"""What the dashboard shows for the demo (dashboards/picture.py; issue 34, "See the dashboard").

No Grafana runs here: the script runs every panel's queries against a real Prometheus scraping
`kvguard serve --demo` and draws the panels where the dashboard's grid puts them. Tested here on a short
run: every panel has data (the demo's engines give the vLLM and budget-time panels theirs), and the picture is drawn;
the
committed picture (docs/dashboard-demo.png) has the size the current dashboard's grid gives it.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time

import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "dashboards"))
import picture  # noqa: E402  (dashboards/picture.py)

with open(picture.DASHBOARD, encoding="utf-8") as _handle:
    DASHBOARD = json.load(_handle)


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as handle:
        head = handle.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_every_panel_query_expands_with_every_variable_at_all():
    for panel in picture.panels(DASHBOARD):
        for target in panel.get("targets", []):
            assert "$" not in picture.expand(target["expr"], DASHBOARD), target["expr"]


def test_a_short_demo_run_draws_every_panel_with_data(tmp_path):
    with picture.demo_and_prometheus(str(tmp_path)) as url:
        start = time.time()
        time.sleep(6)
        drawn = picture.series_of(url, DASHBOARD, start, time.time())
    titles = {p["id"]: p["title"] for p in picture.panels(DASHBOARD)}
    assert set(drawn) == set(titles)
    empty = {titles[panel_id] for panel_id, lines in drawn.items() if not lines}
    assert not empty
    output = tmp_path / "board.png"
    picture.draw(DASHBOARD, drawn, 6, str(output))
    assert png_size(output)[0] == 24 * picture.DPI


def test_the_committed_picture_is_of_the_current_dashboard_grid():
    path = os.path.join(ROOT, "docs", "dashboard-demo.png")
    if not os.path.exists(path):
        pytest.fail("docs/dashboard-demo.png is missing: run python dashboards/picture.py")
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in DASHBOARD["panels"] + picture.panels(DASHBOARD))
    assert png_size(path) == (24 * picture.DPI, int(bottom * picture.ROW_INCHES * picture.DPI))
    docs = open(os.path.join(ROOT, "docs", "dashboards.md"), encoding="utf-8").read()
    assert "](dashboard-demo.png)" in docs and "dashboards/picture.py" in docs
