"""The landing page at `/`: a real server on loopback, its links followed."""

from __future__ import annotations

from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import kvguard
from sidecar_fixtures import snapshot
from test_server import basic, get


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


def test_the_landing_page_links_every_endpoint_and_says_the_version(serve):
    server = serve(snapshot())
    status, headers, body = get(server, "/")
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    page = parse(body)
    base = f"http://127.0.0.1:{server.port}/"
    targets = [urlsplit(urljoin(base, href)).path for href in page.hrefs]
    assert sorted(targets) == ["/guard", "/healthz", "/metrics", "/readyz"]
    assert f"Version {kvguard.__version__}." in "".join(page.text)
    for path in targets:                    # every link answers
        assert get(server, path)[0] == 200, path


def test_relative_links_stay_under_a_path_prefix():
    # Behind a proxy serving kvguard at /kvguard/, the page's links resolve under the prefix.
    from kvguard.sidecar.server import landing_page

    hrefs = parse(landing_page()).hrefs
    assert {urljoin("https://proxy.example/kvguard/", href) for href in hrefs} == {
        f"https://proxy.example/kvguard/{name}" for name in ("metrics", "guard", "healthz", "readyz")}


def test_the_landing_page_is_behind_the_same_auth_as_metrics(serve):
    server = serve(snapshot(), basic_auth_user="prometheus", basic_auth_password="s3cret")
    assert get(server, "/")[0] == get(server, "/metrics")[0] == 401
    assert get(server, "/", basic("prometheus", "s3cret"))[0] == 200
    assert get(server, "/healthz")[0] == 200       # the probes stay open


def test_head_of_the_landing_page_has_no_body(serve):
    status, headers, body = get(serve(), "/", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 100
