"""The plain rule files' runbook links, as a real Prometheus 2.42 renders them (issue 34): every alert's
runbook_url opens, without scrape credentials, a page that exists, at the alert's own section; and
KVGuardExporterDown's never points at the exporter that is down.

Prometheus gets one external label, kvguard_runbook_url, naming the runbook page (dashboards/rules.py
RUNBOOK_URL reads it as $externalLabels in the annotation template); `python dashboards/runbook.py --pages`
writes the pages, and Python's http.server serves them on loopback, standing in for the static site.
The one scrape target is a free loopback port nothing listens on, so up == 0: KVGuardExporterDown fires
on its own expression, and every other alert, its expression swapped for that one, fires beside it with
its annotations as the committed file writes them. Alerts are read from Prometheus' /api/v1/alerts.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml
from conftest import ROOT
from monitoring import ALERTS_FILE, alerts, load_yaml
from sidecar_fixtures import free_port
from test_prometheus_e2e import PROMETHEUS, STARTUP_DEADLINE, Stack, poll, stop

sys.path.insert(0, os.path.join(ROOT, "dashboards"))
import rules  # noqa: E402  (dashboards/rules.py)
import runbook  # noqa: E402  (dashboards/runbook.py)

DOWN = 'up{job=~".*kvguard.*"} == 0'


def every_alert_firing_while_the_exporter_is_down() -> dict:
    """The committed alert file with every expression but KVGuardExporterDown's swapped for DOWN, and no `for`."""
    data = load_yaml(ALERTS_FILE)
    for group in data["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule.pop("for", None)
                if rule["alert"] == "KVGuardExporterDown":
                    assert rule["expr"] == DOWN  # its own expression, as committed
                rule["expr"] = DOWN
    return data


@contextlib.contextmanager
def served(folder, port: int):
    process = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        poll(
            "the runbook pages to be served",
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/index.html", timeout=2).status == 200,
            STARTUP_DEADLINE,
        )
        yield f"http://127.0.0.1:{port}/index.html"
    finally:
        stop(process)


@contextlib.contextmanager
def prometheus(work, rule_file: str, external_labels: dict[str, str], target: str):
    if not os.access(PROMETHEUS, os.X_OK):
        pytest.fail("prometheus not found: ./dev.sh test installs Debian's prometheus package")
    port = free_port()
    config = {
        "global": {
            "scrape_interval": "1s",
            "scrape_timeout": "1s",
            "evaluation_interval": "1s",
            "external_labels": external_labels,
        },
        "rule_files": [rule_file],
        "scrape_configs": [{"job_name": "kvguard", "static_configs": [{"targets": [target]}]}],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    with open(work / "prometheus.log", "wb") as log:
        process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:

            def ready() -> bool:
                if process.poll() is not None:
                    pytest.fail(f"prometheus exited: {(work / 'prometheus.log').read_text(errors='replace')[-2000:]}")
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as response:
                    return response.status == 200

            poll("Prometheus to be ready", ready, STARTUP_DEADLINE)
            yield Stack(f"http://127.0.0.1:{port}", "")
        finally:
            stop(process)


def fetch(url: str) -> tuple[int, str]:
    """GET url as a browser with no credentials does (the fragment stays in the browser)."""
    with urllib.request.urlopen(urllib.parse.urldefrag(url).url, timeout=10) as response:
        return response.status, response.read().decode("utf-8")


@pytest.fixture(scope="module")
def fired(tmp_path_factory):
    """{alert name: its rendered runbook_url}, every alert firing, and the down exporter's host:port."""
    work = tmp_path_factory.mktemp("runbook-links")
    (work / "pages").mkdir()
    for name, text in runbook.pages().items():
        (work / "pages" / name).write_text(text, encoding="utf-8")
    (work / "alerts.yaml").write_text(yaml.safe_dump(every_alert_firing_while_the_exporter_is_down()))
    down = f"127.0.0.1:{free_port()}"  # nothing listens there
    with (
        served(work / "pages", free_port()) as page,
        prometheus(work, str(work / "alerts.yaml"), {rules.RUNBOOK_LABEL: page}, down) as stack,
    ):
        names = {a["alert"] for a in alerts()}

        def all_firing():
            found = {
                a["labels"]["alertname"]: a for a in stack.api("alerts")["data"]["alerts"] if a["state"] == "firing"
            }
            return found if set(found) == names else None

        found = poll("every alert to fire", all_firing, STARTUP_DEADLINE)
        yield {name: alert["annotations"]["runbook_url"] for name, alert in found.items()}, page, down


def test_the_committed_alerts_read_the_runbook_page_from_an_external_label():
    for alert in alerts():
        assert alert["annotations"]["runbook_url"] == rules.RUNBOOK_URL % alert["alert"].lower()
    assert "$externalLabels." + rules.RUNBOOK_LABEL in rules.RUNBOOK_URL


def test_every_alerts_link_is_its_section_on_the_page_the_external_label_names(fired):
    urls, page, _ = fired
    assert urls == {name: f"{page}#{name.lower()}" for name in urls}


def test_every_alerts_link_opens_its_section_without_credentials(fired):
    urls, _, _ = fired
    for name, url in urls.items():
        parts = urllib.parse.urlsplit(url)
        assert parts.scheme == "http" and not parts.username and not parts.password
        status, text = fetch(url)
        assert status == 200, url
        assert f'<h2 id="{parts.fragment}">{name}</h2>' in text, url


def test_the_exporter_down_link_is_not_on_the_exporter_that_is_down(fired):
    urls, _, down = fired
    assert urllib.parse.urlsplit(urls["KVGuardExporterDown"]).netloc != down
    with pytest.raises(urllib.error.URLError):  # and that exporter answers nothing
        urllib.request.urlopen(f"http://{down}/runbook", timeout=2)


def test_each_alerts_own_page_opens_too(fired, tmp_path):
    # The same folder in the chart's layout (<alertname>.html), for runbookUrl: https://HOST/%s.html.
    urls, page, _ = fired
    base = page.rsplit("/", 1)[0]
    for name in urls:
        status, text = fetch(f"{base}/{name.lower()}.html")
        assert status == 200 and f"<title>kvguard runbook: {name}</title>" in text
