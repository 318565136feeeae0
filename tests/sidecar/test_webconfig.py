"""--web.config.file (exporter-toolkit's format) against the running server: a CA, a server and a
client certificate made by the real openssl in tmp_path, bcrypt users, and rotation without restart."""

from __future__ import annotations

import base64
import http.client
import os
import re
import shutil
import ssl
import subprocess
import time

import bcrypt
import pytest
from click.testing import CliRunner
from sidecar_fixtures import http_get, snapshot

from kvguard.cli import main
from kvguard.sidecar.server import KVGuardServer
from kvguard.sidecar.webconfig import CIPHER_SUITES, WebConfigError, WebConfigWatcher, load_web_config

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory, name: str) -> None:
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.crt",
        cwd=directory,
    )


def make_cert(directory, name: str, ca: str, cn: str, ext: str) -> None:
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={cn}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        cwd=directory,
    )
    (directory / f"{name}.ext").write_text(ext)
    openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.crt",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.crt",
        cwd=directory,
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Two CAs; a server certificate for 127.0.0.1 from each, a client certificate from the first."""
    directory = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "ca2"):
        make_ca(directory, ca)
    server_ext = "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
    make_cert(directory, "server", "ca", "127.0.0.1", server_ext)
    make_cert(directory, "server2", "ca2", "127.0.0.1", server_ext)
    make_cert(directory, "client", "ca", "prometheus", "extendedKeyUsage=clientAuth\n")
    make_cert(directory, "stranger", "ca2", "stranger", "extendedKeyUsage=clientAuth\n")
    return directory


def bcrypt_hash(password: str) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()


@pytest.fixture
def serve_web(serve, tmp_path):
    """A server whose web config is ``config_text``, checked for changes on every request."""

    def start(config_text: str) -> KVGuardServer:
        path = tmp_path / "web.yml"
        path.write_text(config_text)
        return serve(
            snapshot(),
            pod_labels={"pod": "", "namespace": "", "container": ""},
            web_config=WebConfigWatcher(str(path), check_interval=0.0),
        )

    return start


def client_context(pki, ca: str = "ca", cert: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / f"{ca}.crt"))
    if cert:
        context.load_cert_chain(str(pki / f"{cert}.crt"), str(pki / f"{cert}.key"))
    return context


def get(server, path="/metrics", context=None, auth: tuple[str, str] | None = None):
    headers = {"Authorization": "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()} if auth else {}
    status, _, body = http_get(server, path, headers, context=context, timeout=10)
    return status, body


def tls_config(pki, cert="server", **extra) -> str:
    lines = ["tls_server_config:", f"  cert_file: {pki / (cert + '.crt')}", f"  key_file: {pki / (cert + '.key')}"]
    lines += [f"  {key}: {value}" for key, value in extra.items()]
    return "\n".join(lines) + "\n"


def test_tls_from_the_web_config_serves_https(serve_web, pki):
    server = serve_web(tls_config(pki))
    assert server.scheme == "https"
    status, body = get(server, context=client_context(pki))
    assert status == 200 and b"kvguard_guard_state" in body


def test_require_and_verify_client_cert_admits_the_ca_signed_client(serve_web, pki):
    server = serve_web(tls_config(pki, client_auth_type="RequireAndVerifyClientCert", client_ca_file=pki / "ca.crt"))
    assert get(server, context=client_context(pki, cert="client"))[0] == 200


def test_require_and_verify_client_cert_refuses_no_certificate_and_a_foreign_one(serve_web, pki):
    server = serve_web(tls_config(pki, client_auth_type="RequireAndVerifyClientCert", client_ca_file=pki / "ca.crt"))
    for context in (client_context(pki), client_context(pki, cert="stranger")):
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            get(server, context=context)
    assert get(server, context=client_context(pki, cert="client"))[0] == 200  # still serving


def test_min_version_tls13_refuses_a_tls12_client(serve_web, pki):
    server = serve_web(tls_config(pki, min_version="TLS13"))
    context = client_context(pki)
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        get(server, context=context)
    assert get(server, context=client_context(pki))[0] == 200


def test_cipher_suites_limit_what_a_tls12_client_can_negotiate(serve_web, pki):
    server = serve_web(tls_config(pki, cipher_suites="[TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384]"))
    context = client_context(pki)
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=10, context=context)
    try:
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
        assert conn.sock.cipher()[0] == "ECDHE-RSA-AES256-GCM-SHA384"
    finally:
        conn.close()
    context.set_ciphers("ECDHE-RSA-AES128-GCM-SHA256")
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        get(server, "/healthz", context=context)


def test_every_cipher_suite_name_maps_to_the_same_suite_in_openssl():
    listing = subprocess.run(
        ["openssl", "ciphers", "-stdname", "ALL:@SECLEVEL=0"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    openssl_pairs = {}
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "-":
            openssl_pairs[parts[0]] = parts[2]
    assert {name: openssl_pairs.get(name) for name in CIPHER_SUITES} == CIPHER_SUITES


def test_bcrypt_users_need_the_right_password(serve_web):
    server = serve_web(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n")
    assert get(server)[0] == 401
    assert get(server, auth=("prometheus", "wrong"))[0] == 401
    assert get(server, auth=("nobody", "s3cret"))[0] == 401
    assert get(server, auth=("prometheus", "s3cret"))[0] == 200
    assert get(server, "/healthz")[0] == 200  # the kubelet's probes stay open


def test_a_new_password_in_the_web_config_applies_without_a_restart(serve_web, tmp_path):
    server = serve_web(f"basic_auth_users:\n  prometheus: {bcrypt_hash('old')}\n")
    assert get(server, auth=("prometheus", "old"))[0] == 200
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: {bcrypt_hash('new')}\n")
    os.utime(path, ns=(time.time_ns() + 10**9,) * 2)  # a new mtime even on a coarse clock
    reload(server)
    assert get(server, auth=("prometheus", "new"))[0] == 200
    assert get(server, auth=("prometheus", "old"))[0] == 401


def test_a_rotated_certificate_is_served_to_new_connections_without_a_restart(serve_web, pki, tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    for suffix in ("crt", "key"):
        shutil.copy(pki / f"server.{suffix}", live / f"tls.{suffix}")
    server = serve_web(f"tls_server_config:\n  cert_file: {live / 'tls.crt'}\n  key_file: {live / 'tls.key'}\n")
    assert get(server, "/healthz", context=client_context(pki, "ca"))[0] == 200
    for suffix in ("crt", "key"):  # rotate to a certificate from the second CA, as cert-manager would
        shutil.copy(pki / f"server2.{suffix}", live / f"tls.{suffix}.new")
        os.replace(live / f"tls.{suffix}.new", live / f"tls.{suffix}")
    reload(server)
    assert get(server, "/healthz", context=client_context(pki, "ca2"))[0] == 200
    with pytest.raises(ssl.SSLError):
        get(server, "/healthz", context=client_context(pki, "ca"))


def reload(server) -> None:
    """Have the server notice the web config's change and wait for its reload (which runs off the event loop)."""
    server.web_config.current()
    server.web_config.wait()


def reload_errors(caplog) -> list[str]:
    return [
        record.kvguard_fields["error"]
        for record in caplog.records
        if record.getMessage() == "web config not reloaded" and record.levelname == "ERROR"
    ]


def test_a_broken_reload_keeps_the_previous_config_and_says_so_in_one_line(serve_web, tmp_path, caplog):
    server = serve_web(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n")
    path = tmp_path / "web.yml"
    path.write_text("basic_auth_users: [not, a, mapping\n")
    reload(server)
    assert get(server, auth=("prometheus", "s3cret"))[0] == 200
    (line,) = reload_errors(caplog)
    assert line.startswith("keeping the previous one: ") and "\n" not in line
    applied, results = server.web_config.status()
    assert server.web_config.reload_errors_total == 1 and not applied
    assert {outcome: n for outcome, n in results.items() if n} == {("failure", ""): 1}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tls_server_config:\n  key_file: x\n", "missing cert_file"),
        (
            "tls_server_config:\n  cert_file: {pki}/server.crt\n  key_file: {pki}/server.key\n"
            "  client_auth_type: Maybe\n",
            "invalid client_auth_type 'Maybe'",
        ),
        (
            "tls_server_config:\n  cert_file: {pki}/server.crt\n  key_file: {pki}/server.key\n"
            "  client_ca_file: {pki}/ca.crt\n",
            "client CA's have been configured without a client auth policy",
        ),
        (
            "tls_server_config:\n  cert_file: {pki}/server.crt\n  key_file: {pki}/server.key\n  min_version: TLS9\n",
            "unknown TLS version 'TLS9'",
        ),
        (
            "tls_server_config:\n  cert_file: {pki}/server.crt\n  key_file: {pki}/server.key\n  cipher_suites: [RC4]\n",
            "unknown cipher 'RC4'",
        ),
        (
            "tls_server_config:\n  cert_file: {pki}/server.crt\n  key_file: {pki}/server.key\n"
            "  client_auth_type: RequireAnyClientCert\n  client_ca_file: {pki}/ca.crt\n",
            "is not supported",
        ),
        ("basic_auth_users:\n  prometheus: plaintext\n", "not a bcrypt hash"),
        ("basic_auth_users:\n  prometheus: ''\n", "empty password hash"),
        (
            "basic_auth_users:\n  '': $2y$10$X0h1gDsPszWURQaxFh.zoubFi6DXncSjhoQNJgRrnGs7EsimhC7zG\n",
            "user name is empty",
        ),
        ("tls_server_confg: {{}}\n", "unknown field 'tls_server_confg'"),
        ("[" * 60000, "not valid YAML"),
    ],
)
def test_a_bad_web_config_is_one_line_at_startup(tmp_path, pki, text, message):
    path = tmp_path / "web.yml"
    path.write_text(text.format(pki=pki) if "{pki}" in text or "{{" in text else text)
    result = CliRunner().invoke(main, ["serve", "--port", "0", "--source", "none", "--web.config.file", str(path)])
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert "Traceback" not in result.output
    with pytest.raises(WebConfigError):
        load_web_config(str(path))


def test_a_web_config_truncated_to_empty_is_refused_on_reload(serve_web, tmp_path, caplog):
    """An empty file is a valid config at startup (no TLS, no users), but on reload it is what a
    truncate-then-write leaves for a moment: it must not switch authentication off."""
    server = serve_web(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n")
    path = tmp_path / "web.yml"
    path.write_text("")
    reload(server)
    assert get(server)[0] == 401
    assert get(server, auth=("prometheus", "s3cret"))[0] == 200
    (line,) = reload_errors(caplog)
    assert line.startswith("keeping the previous one: ") and "empty" in line
    assert server.web_config.reload_errors_total == 1


@pytest.mark.parametrize(
    "text",
    [
        "{}\n",
        "null\n",
        "~\n",
        "basic_auth_users: {}\n",
        "basic_auth_users:\n",
        "\ufeff# rotated\n",
        "http_server_config:\n  headers: {X-Frame-Options: deny}\n",
    ],
)
def test_a_reload_that_would_switch_basic_auth_off_keeps_the_old_config_says_so_and_counts_it(
    serve_web, tmp_path, caplog, text
):
    """Round three: each of these switched basic auth off at the next reload, without a word."""
    server = serve_web(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n")
    (tmp_path / "web.yml").write_text(text, encoding="utf-8")
    reload(server)
    assert get(server)[0] == 401
    assert get(server, auth=("prometheus", "s3cret"))[0] == 200
    assert len(reload_errors(caplog)) == 1
    server.sidecar.refresh_background(wait=2.0)
    time.sleep(0.05)
    body = server.exposition.body("", False)[0].decode()
    assert "kvguard_web_config_last_reload_successful 0.0" in body
    assert re.search(
        r'kvguard_web_config_reloads_total\{reason="(|auth_off)",result="(failure|refused_weaker)"\} 1\.0', body
    )


def test_with_allow_auth_off_a_reload_may_switch_basic_auth_off(serve, tmp_path):
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n")
    server = serve(snapshot(), web_config=WebConfigWatcher(str(path), check_interval=0.0, allow_auth_off=True))
    assert get(server)[0] == 401
    path.write_text("basic_auth_users: {}\n")
    reload(server)
    assert get(server)[0] == 200 and server.web_config.status()[0] is True


def test_a_fifo_in_place_of_the_web_config_is_refused_without_stalling_any_endpoint(serve_web, tmp_path, caplog):
    server = serve_web(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n")
    path = tmp_path / "web.yml"
    path.unlink()
    os.mkfifo(path)
    reload(server)
    assert get(server, "/healthz")[0] == 200
    assert get(server, auth=("prometheus", "s3cret"))[0] == 200
    (line,) = reload_errors(caplog)
    assert "not a regular file" in line


def test_a_fifo_in_place_of_the_key_file_is_refused(serve_web, pki, tmp_path, caplog):
    live = tmp_path / "live"
    live.mkdir()
    for suffix in ("crt", "key"):
        shutil.copy(pki / f"server.{suffix}", live / f"tls.{suffix}")
    server = serve_web(f"tls_server_config:\n  cert_file: {live / 'tls.crt'}\n  key_file: {live / 'tls.key'}\n")
    (live / "tls.key").unlink()
    os.mkfifo(live / "tls.key")
    reload(server)
    assert get(server, "/healthz", context=client_context(pki, "ca"))[0] == 200
    (line,) = reload_errors(caplog)
    assert "key_file" in line and "not a regular file" in line


def test_a_reload_runs_off_the_event_loop(serve_web, tmp_path, monkeypatch):
    """A 1 MiB YAML stalled every endpoint 3-5 s: the load now runs on a thread of its own."""
    import threading

    from kvguard.sidecar import webconfig

    server = serve_web(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n")
    release = threading.Event()
    real_load = webconfig.load_web_config
    monkeypatch.setattr(webconfig, "load_web_config", lambda *a, **k: release.wait(30) and real_load(*a, **k))
    (tmp_path / "web.yml").write_text(f"basic_auth_users:\n  prometheus: {bcrypt_hash('new')}\n")
    try:
        server.web_config.current()  # the reload starts, and blocks until released
        assert get(server, "/healthz")[0] == 200
        assert get(server, auth=("prometheus", "s3cret"))[0] == 200
    finally:
        release.set()
    server.web_config.wait()
    assert get(server, auth=("prometheus", "new"))[0] == 200


def test_server_options_allow_auth_off_reaches_the_watcher_the_server_builds(serve, tmp_path):
    """Review of issue 37: a KVGuardServer given web_config_file (not a watcher) built its watcher
    without allow_auth_off; ServerOptions had no way to say it."""
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n")
    server = serve(snapshot(), web_config_file=str(path), web_config_allow_auth_off=True)
    assert server.web_config.allow_auth_off is True
    assert get(server)[0] == 401
    path.write_text("basic_auth_users: {}\n")
    os.utime(path, ns=(time.time_ns() + 10**9,) * 2)
    server.web_config.check_interval = 0.0
    reload(server)
    assert get(server)[0] == 200 and server.web_config.status()[0] is True


def test_server_options_without_allow_auth_off_keep_auth_on_a_reload_to_no_users(serve, tmp_path):
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n")
    server = serve(snapshot(), web_config_file=str(path))
    path.write_text("basic_auth_users: {}\n")
    os.utime(path, ns=(time.time_ns() + 10**9,) * 2)
    server.web_config.check_interval = 0.0
    reload(server)
    assert get(server)[0] == 401 and server.web_config.status()[0] is False


# ------------------------------------------------------------------ issue 37 item 4: mTLS downgrades

MTLS = {"client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": "{pki}/ca.crt", "min_version": "TLS13"}


def mtls_config(pki, **changes) -> str:
    settings = {key: str(value).format(pki=pki) for key, value in {**MTLS, **changes}.items() if value is not None}
    return tls_config(pki, **settings)


def tls12_context(pki, cert: str | None = "client") -> ssl.SSLContext:
    context = client_context(pki, cert=cert)
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    return context


def reloads_by_reason(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    server.sidecar.refresh_background(wait=2.0)
    time.sleep(0.05)
    body = server.exposition.body("", False)[0].decode()
    family = {f.name: f for f in text_string_to_metric_families(body)}["kvguard_web_config_reloads"]
    return {
        s.labels["reason"]: s.value
        for s in family.samples
        if s.name.endswith("_total") and s.labels["result"] == "refused_weaker" and s.value
    }


@pytest.mark.parametrize(
    ("changes", "reason", "still_refused"),
    [
        ({"client_auth_type": "NoClientCert", "client_ca_file": None}, "client_auth", {"cert": None}),
        ({"client_auth_type": "VerifyClientCertIfGiven"}, "client_auth", {"cert": None}),
        ({"min_version": "TLS12"}, "min_version", {"tls12": True}),
        # a max_version below the old min_version needs a min_version as low (min above max does not load)
        ({"min_version": "TLS12", "max_version": "TLS12"}, "min_version", {"tls12": True}),
    ],
)
def test_a_reload_that_would_downgrade_mtls_keeps_the_old_config_logs_an_error_and_counts_it(
    serve_web, pki, tmp_path, caplog, changes, reason, still_refused
):
    """Issue 37, item 4: lowering client_auth_type (the client CA removed with it) or min_version
    was applied on reload without a word; now it is kept out as switching basic auth off is."""
    server = serve_web(mtls_config(pki))
    assert get(server, context=client_context(pki, cert="client"))[0] == 200
    (tmp_path / "web.yml").write_text(mtls_config(pki, **changes))
    reload(server)
    weaker = tls12_context(pki) if still_refused.get("tls12") else client_context(pki, cert=still_refused["cert"])
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):  # the old config still in force
        get(server, context=weaker)
    assert get(server, context=client_context(pki, cert="client"))[0] == 200
    (line,) = reload_errors(caplog)
    assert line.startswith("keeping the previous one: ") and "allow-auth-off" in line
    assert server.web_config.status()[0] is False
    assert reloads_by_reason(server) == {reason: 1.0}


def test_with_allow_auth_off_a_reload_may_downgrade_mtls(serve, pki, tmp_path):
    path = tmp_path / "web.yml"
    path.write_text(mtls_config(pki))
    server = serve(snapshot(), web_config=WebConfigWatcher(str(path), check_interval=0.0, allow_auth_off=True))
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        get(server, context=client_context(pki))
    path.write_text(mtls_config(pki, client_auth_type="NoClientCert", client_ca_file=None, min_version="TLS12"))
    reload(server)
    assert get(server, context=tls12_context(pki, cert=None))[0] == 200
    assert server.web_config.status()[0] is True


def test_a_reload_that_strengthens_mtls_applies(serve_web, pki, tmp_path):
    server = serve_web(mtls_config(pki, client_auth_type="VerifyClientCertIfGiven", min_version="TLS12"))
    assert get(server, context=tls12_context(pki, cert=None))[0] == 200
    (tmp_path / "web.yml").write_text(mtls_config(pki))
    reload(server)
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        get(server, context=client_context(pki))
    assert get(server, context=client_context(pki, cert="client"))[0] == 200
    assert server.web_config.status()[0] is True
