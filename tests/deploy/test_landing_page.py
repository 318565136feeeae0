"""The landing page at `/` and the runbook at `/runbook`: a real server on loopback, its links followed."""

from __future__ import annotations

import os
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import pytest
from monitoring import RUNBOOK, alerts
from sidecar_fixtures import basic, http_get as get, snapshot

import kvguard
from kvguard.sidecar import server as sidecar_server

ALERT_NAMES = [a["alert"] for a in alerts()]


class Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs.append(dict(attrs)["href"])

    def handle_data(self, data):
        self.text.append(data)


def parse(body: bytes) -> Links:
    links = Links()
    links.feed(body.decode("utf-8"))
    return links


def html_page(server, path: str) -> tuple[Links, list[str]]:
    """GET an HTML page of the server: the page, and the paths its links resolve to from its own URL."""
    status, headers, body = get(server, path)
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8", path
    page = parse(body)
    base = f"http://127.0.0.1:{server.port}{path}"
    return page, [urlsplit(urljoin(base, href)).path for href in page.hrefs]


def test_the_landing_page_links_every_endpoint_and_says_the_version(serve):
    server = serve(snapshot())
    page, targets = html_page(server, "/")
    assert sorted(targets) == ["/guard", "/healthz", "/metrics", "/readyz", "/runbook"]
    assert f"Version {kvguard.__version__}." in "".join(page.text)
    for path in targets:  # every link answers
        assert get(server, path)[0] == 200, path


def test_relative_links_stay_under_a_path_prefix():
    # Behind a proxy serving kvguard at /kvguard/, the page's links resolve under the prefix.
    from kvguard.sidecar.server import landing_page

    hrefs = parse(landing_page()).hrefs
    assert {urljoin("https://proxy.example/kvguard/", href) for href in hrefs} == {
        f"https://proxy.example/kvguard/{name}" for name in ("metrics", "guard", "runbook", "healthz", "readyz")
    }


def test_the_landing_page_is_behind_the_same_auth_as_metrics(serve):
    server = serve(snapshot(), basic_auth_user="prometheus", basic_auth_password="s3cret")
    assert get(server, "/")[0] == get(server, "/metrics")[0] == 401
    assert get(server, "/", basic("prometheus", "s3cret"))[0] == 200
    assert get(server, "/healthz")[0] == 200  # the probes stay open


def test_head_of_the_landing_page_has_no_body(serve):
    status, headers, body = get(serve(), "/", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 100


# ------------------------------------------------------------------------------ /runbook (issue 21)


def runbook_sections() -> dict[str, str]:
    """alert name -> its section of the packaged runbook, the markdown after its "## " heading."""
    with open(RUNBOOK, encoding="utf-8") as handle:
        parts = handle.read().split("\n## ")[1:]
    return {part.split("\n", 1)[0].strip(): part.split("\n", 1)[1] for part in parts}


def page_text(body: bytes) -> str:
    return "".join(parse(body).text)


def test_the_runbook_has_a_section_for_every_alert_the_rules_define():
    assert set(ALERT_NAMES) <= set(runbook_sections())


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_runbook_slash_alert_serves_that_alerts_section_in_any_case(serve, name):
    server = serve(snapshot())
    section = runbook_sections()[name]
    for path in (f"/runbook/{name.lower()}", f"/runbook/{name}"):
        status, headers, body = get(server, path)
        assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8", path
        assert f'<h2 id="{name.lower()}">{name}</h2>' in body.decode("utf-8")
        text = page_text(body)
        # Every line of the section reads back as written: quotes, < and & escaped, nothing lost.
        assert [line for line in section.splitlines() if line.strip() and line not in text] == []
        # Only this alert's section.
        assert [other for other in ALERT_NAMES if other != name and f"## {other}" in text] == []


def test_runbook_serves_the_whole_runbook_with_a_link_to_each_section(serve):
    server = serve(snapshot())
    page, targets = html_page(server, "/runbook")
    assert set(targets) == {f"/runbook/{name.lower()}" for name in runbook_sections()}
    for name in ALERT_NAMES:
        assert name in "".join(page.text)
        assert get(server, f"/runbook/{name.lower()}")[0] == 200


def test_a_section_page_links_back_to_the_whole_runbook(serve):
    server = serve(snapshot())
    name = ALERT_NAMES[0].lower()
    (href,) = parse(get(server, f"/runbook/{name}")[2]).hrefs
    assert urljoin(f"https://proxy.example/kvguard/runbook/{name}", href) == "https://proxy.example/kvguard/runbook"


@pytest.mark.parametrize(
    "path",
    [
        "/runbook/kvguardnosuchalert",
        "/runbook/",
        "/runbook/KVGuardOOMRiskCritical/x",
        "/runbook/%3Cscript%3E",
        "/runbookx",
    ],
)
def test_an_unknown_runbook_section_is_a_404_of_one_line(serve, path):
    status, headers, body = get(serve(snapshot()), path)
    assert status == 404 and headers["Content-Type"].startswith("text/plain")
    assert len(body.decode().strip().splitlines()) == 1 and body.endswith(b"\n")


def test_the_runbook_is_behind_the_same_auth_as_metrics(serve):
    server = serve(snapshot(), basic_auth_user="prometheus", basic_auth_password="s3cret")
    for path in ("/runbook", "/runbook/kvguardheadroomlow", "/runbook/kvguardnosuchalert"):
        assert get(server, path)[0] == 401, path
    assert get(server, "/runbook/kvguardheadroomlow", basic("prometheus", "s3cret"))[0] == 200
    assert get(server, "/runbook", basic("prometheus", "s3cret"))[0] == 200


def test_a_missing_runbook_file_is_a_404_of_one_line_not_a_traceback(serve, monkeypatch):
    # An install without the package data: the resource is not there.
    monkeypatch.setattr(sidecar_server, "RUNBOOK_RESOURCE", "no-such-runbook.md")
    server = serve(snapshot())
    for path in ("/runbook", "/runbook/kvguardheadroomlow"):
        status, _, body = get(server, path)
        assert status == 404 and body == b"the runbook is not installed with this kvguard\n", path
    assert get(server, "/metrics")[0] == 200


def test_the_runbook_is_read_from_the_installed_package():
    import importlib.resources

    packaged = importlib.resources.files("kvguard").joinpath("runbook.md").read_text(encoding="utf-8")
    with open(RUNBOOK, encoding="utf-8") as handle:
        assert packaged == handle.read()
    assert sidecar_server.runbook_pages() is sidecar_server.runbook_pages()  # read once, cached


def test_the_runbook_url_a_real_prometheus_makes_opens_the_alerts_section(tmp_path):
    # kvguard serve --demo scraped by a real Prometheus with the default rules, two alerts made to fire
    # at once: one per rank (its own instance), one per engine (the instance a query finds).
    import urllib.request

    from monitoring import rules_generator
    from test_prometheus_e2e import kvguard_and_prometheus, kvguard_env, poll

    firing = {"KVGuardFragmentationHigh", "KVGuardHeadroomLow"}
    config = {
        "thresholds": {"fragmentationRatio": -1, "fragmentationBytes": -1, "headroomRatio": 2},
        "for": {name: "0" for name in firing},
    }
    rule_files = []
    for path, text in rules_generator().outputs(config, output_dir=str(tmp_path / "rules"), chart=False).items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        rule_files.append(path)
    args = ["--demo", "--spool-dir", str(tmp_path / "spool"), "--interval", "1"]
    with kvguard_and_prometheus(tmp_path, args, rule_files, env=kvguard_env()) as stack:

        def links():
            alerts_now = stack.api("alerts")["data"]["alerts"]
            found = {
                a["labels"]["alertname"]: a["annotations"]["runbook_url"] for a in alerts_now if a["state"] == "firing"
            }
            return found if firing <= set(found) else None

        urls = poll("both alerts to fire", links, 60.0)
        for name in firing:
            # No external label kvguard_runbook_url here: the sidecar's /runbook, at the alert's heading.
            assert urls[name] == f"{stack.kvguard_url}/runbook#{name.lower()}", urls[name]
            with urllib.request.urlopen(urls[name], timeout=10) as response:
                assert response.status == 200
                assert f'<h2 id="{name.lower()}">' in response.read().decode("utf-8")
