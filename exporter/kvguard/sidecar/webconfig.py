"""``--web.config.file``: the Prometheus exporter-toolkit web configuration, for the sidecar.

The format is exporter-toolkit's (docs/web-configuration.md, the same file node_exporter and
dcgm-exporter read)::

    tls_server_config:
      cert_file: /etc/kvguard/tls/tls.crt
      key_file: /etc/kvguard/tls/tls.key
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: /etc/kvguard/tls/ca.crt
      min_version: TLS12
      cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]
    http_server_config:
      headers: {X-Content-Type-Options: nosniff}
    basic_auth_users:
      prometheus: $2y$10$...          # bcrypt

Like exporter-toolkit (web/tls_config.go, ``getConfig`` per request), the file and the files it
names are watched: :class:`WebConfigWatcher` re-reads them when their size, mtime or inode
changes, so a rotated certificate or a new password takes effect on the next connection without a
restart. Reloads run off the server's event loop, read at most MAX_WEB_CONFIG_BYTES and never open a
FIFO or another non-regular file. A change that does not load is logged at error level, counted
(kvguard_web_config_reloads_total) and the previous configuration stays; so is a file emptied (an
empty file at startup is a valid config, no TLS and no users; on a reload it is what a
truncate-then-write leaves for a moment) and any config that would switch basic auth off (``{}``,
``null``, ``basic_auth_users: {}``...) unless ``--web.config.allow-auth-off``.
Whether TLS is on at all is fixed at startup (exporter-toolkit fixes it too).

What Python's ssl module cannot do is refused with one line, never silently weakened:
``RequestClientCert`` and ``RequireAnyClientCert`` (request a client certificate without
verifying it), inline ``cert``/``key``, ``client_allowed_sans``, ``curve_preferences`` beyond one
curve, and ``rate_limit``.
"""

from __future__ import annotations

import hmac
import os
import secrets
import ssl
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from kvguard.text import one_line
from kvguard.textfile import read_text

# A web config is a few users and file names: 1 MiB of YAML took 3-5 s to parse.
MAX_WEB_CONFIG_BYTES = 64 * 1024


class WebConfigError(ValueError):
    """A web config that cannot be used; the message is one line."""


# exporter-toolkit's min_version / max_version names (web/tls_config.go, TLSVersion map).
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}

# Go's crypto/tls names (cipher_suites.go, tls.CipherSuites() and tls.InsecureCipherSuites(), Go 1.22)
# for TLS 1.0-1.2, and the OpenSSL name of each; `openssl ciphers -stdname` lists the same pairs (the
# Go names are the IANA ones). tests/sidecar/test_webconfig.py checks every row against the real openssl.
CIPHER_SUITES = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA256": "AES128-SHA256",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256": "ECDHE-ECDSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256": "ECDHE-RSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
}
# TLS 1.3 suites are in Go's list too but are not configurable (in Go or in OpenSSL's cipher
# string): accepted and left to the library, as exporter-toolkit does.
TLS13_CIPHER_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")

# Go's tls.CurveID names -> OpenSSL's.
CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519"}

# client_auth_type -> Python's verify mode; None: Go can, Python's ssl cannot (it verifies every
# certificate it requests).
CLIENT_AUTH = {
    "": ssl.CERT_NONE,
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
    "RequestClientCert": None,
    "RequireAnyClientCert": None,
    "RequireClientCert": None,
}

_TLS_KEYS = {
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "client_ca",
    "min_version",
    "max_version",
    "cipher_suites",
    "prefer_server_cipher_suites",
    "curve_preferences",
    "cert",
    "key",
    "client_allowed_sans",
}
_HTTP_KEYS = {"http2", "headers"}
# Response headers exporter-toolkit lets the file set (web/handler.go, extraHTTPHeaders).
_HEADERS = (
    "Strict-Transport-Security",
    "X-Content-Type-Options",
    "X-Frame-Options",
    "X-XSS-Protection",
    "Content-Security-Policy",
)


@dataclass(frozen=True)
class WebConfig:
    """One loaded web config: a TLS context (or None), the bcrypt users, extra response headers."""

    tls_context: ssl.SSLContext | None = None
    basic_auth_users: Mapping[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: Mapping[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()  # what to watch for changes


def _resolve(base: str, path: Any, key: str) -> str:
    if not isinstance(path, str) or not path:
        raise WebConfigError(f"tls_server_config.{key} must be a file name")
    # exporter-toolkit resolves relative paths against the config file's directory (joinDir).
    return path if os.path.isabs(path) else os.path.join(base, path)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise WebConfigError(f"{where} must be a mapping")
    return value


def _strict(section: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(str(k) for k in section if k not in known)
    if unknown:  # exporter-toolkit unmarshals strictly: a typo is an error, not a silent default
        raise WebConfigError(f"{where}: unknown field {unknown[0]!r}")


def parse_web_config(text: str, base_dir: str = ".") -> WebConfig:
    """Parse and load one web config (YAML text); certificates are read now. Raises WebConfigError."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        raise WebConfigError(f"not valid YAML: {one_line(exc, first_line=True)}") from None
    data = _mapping(data, "the web config")
    _strict(data, {"tls_server_config", "http_server_config", "basic_auth_users", "rate_limit"}, "web config")
    if data.get("rate_limit") not in (None, {}):
        raise WebConfigError("rate_limit is not supported by kvguard")
    files: list[str] = []
    context = _tls_context(_mapping(data.get("tls_server_config"), "tls_server_config"), base_dir, files)
    users = _users(_mapping(data.get("basic_auth_users"), "basic_auth_users"))
    http = _mapping(data.get("http_server_config"), "http_server_config")
    _strict(http, _HTTP_KEYS, "http_server_config")
    if not isinstance(http.get("http2", True), bool):
        raise WebConfigError("http_server_config.http2 must be true or false")
    headers = {}
    for name, value in _mapping(http.get("headers"), "http_server_config.headers").items():
        if name not in _HEADERS:
            raise WebConfigError(f"http_server_config.headers: {name!r} is not one of {', '.join(_HEADERS)}")
        if not isinstance(value, str) or any(c in value for c in "\r\n\0"):
            raise WebConfigError(f"http_server_config.headers.{name} must be a one-line string")
        if value:
            headers[name] = value
    return WebConfig(tls_context=context, basic_auth_users=users, headers=headers, files=tuple(files))


def _tls_context(tls: Mapping[str, Any], base: str, files: list[str]) -> ssl.SSLContext | None:
    _strict(tls, _TLS_KEYS, "tls_server_config")
    if not tls:
        return None
    for inline in ("cert", "key"):
        if tls.get(inline):
            raise WebConfigError(f"tls_server_config.{inline} (inline PEM) is not supported: use {inline}_file")
    if tls.get("client_allowed_sans"):
        raise WebConfigError("tls_server_config.client_allowed_sans is not supported by kvguard")
    if not tls.get("cert_file"):
        raise WebConfigError("tls_server_config: missing cert_file")
    if not tls.get("key_file"):
        raise WebConfigError("tls_server_config: missing key_file")
    cert, key = _resolve(base, tls["cert_file"], "cert_file"), _resolve(base, tls["key_file"], "key_file")
    files += [cert, key]
    _regular_file(cert, "cert_file")
    _regular_file(key, "key_file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else one_line(exc, first_line=True)
        raise WebConfigError(f"cannot load cert_file {cert} / key_file {key}: {detail}") from None

    versions = {}
    for name, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        value = tls.get(name) or default
        if value not in TLS_VERSIONS:
            raise WebConfigError(
                f"tls_server_config.{name}: unknown TLS version {value!r} (choose from {', '.join(TLS_VERSIONS)})"
            )
        versions[name] = TLS_VERSIONS[value]
    if versions["min_version"] > versions["max_version"]:
        raise WebConfigError("tls_server_config: min_version is above max_version")
    try:
        context.minimum_version, context.maximum_version = versions["min_version"], versions["max_version"]
    except (ValueError, ssl.SSLError) as exc:
        raise WebConfigError(
            f"tls_server_config: this OpenSSL refuses the TLS versions: {one_line(exc, first_line=True)}"
        ) from None

    suites = tls.get("cipher_suites") or []
    if not isinstance(suites, list) or not all(isinstance(s, str) for s in suites):
        raise WebConfigError("tls_server_config.cipher_suites must be a list of names")
    openssl_names = []
    for suite in suites:
        if suite in TLS13_CIPHER_SUITES:
            continue
        if suite not in CIPHER_SUITES:
            raise WebConfigError(f"tls_server_config.cipher_suites: unknown cipher {suite!r}")
        openssl_names.append(CIPHER_SUITES[suite])
    if openssl_names:
        try:
            context.set_ciphers(":".join(openssl_names))
        except ssl.SSLError as exc:
            raise WebConfigError(f"tls_server_config.cipher_suites: {one_line(exc, first_line=True)}") from None
    if tls.get("prefer_server_cipher_suites", True) is True:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    curves = tls.get("curve_preferences") or []
    if not isinstance(curves, list) or not all(c in CURVES for c in curves):
        raise WebConfigError(f"tls_server_config.curve_preferences: unknown curve (choose from {', '.join(CURVES)})")
    if len(curves) > 1:
        raise WebConfigError("tls_server_config.curve_preferences: kvguard supports one curve")
    if curves:
        context.set_ecdh_curve(CURVES[curves[0]])

    auth = tls.get("client_auth_type") or ""
    if auth not in CLIENT_AUTH:
        raise WebConfigError(f"tls_server_config: invalid client_auth_type {auth!r}")
    mode = CLIENT_AUTH[auth]
    if mode is None:
        raise WebConfigError(
            f"tls_server_config: client_auth_type {auth} (a client certificate that is not "
            "verified) is not supported: use RequireAndVerifyClientCert"
        )
    has_ca = bool(tls.get("client_ca_file") or tls.get("client_ca"))
    if has_ca and mode == ssl.CERT_NONE:  # exporter-toolkit refuses this too
        raise WebConfigError("tls_server_config: client CA's have been configured without a client auth policy")
    if mode != ssl.CERT_NONE and not has_ca:
        raise WebConfigError(f"tls_server_config: client_auth_type {auth} needs client_ca_file")
    if has_ca:
        try:
            if tls.get("client_ca_file"):
                ca = _resolve(base, tls["client_ca_file"], "client_ca_file")
                files.append(ca)
                _regular_file(ca, "client_ca_file")
                context.load_verify_locations(cafile=ca)
            else:
                if not isinstance(tls["client_ca"], str):
                    raise WebConfigError("tls_server_config.client_ca must be PEM text")
                context.load_verify_locations(cadata=tls["client_ca"])
        except (OSError, ssl.SSLError) as exc:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else one_line(exc, first_line=True)
            raise WebConfigError(f"cannot load the client CA: {detail}") from None
    context.verify_mode = mode
    return context


def _users(users: Mapping[str, Any]) -> dict[str, bytes]:
    parsed = {}
    for user, hashed in users.items():
        if not isinstance(user, str) or not user:
            raise WebConfigError("basic_auth_users: a user name is empty")
        if not isinstance(hashed, str) or not hashed:
            raise WebConfigError(f"basic_auth_users.{user}: empty password hash")
        if not hashed.startswith(("$2a$", "$2b$", "$2y$")) or len(hashed) != 60:
            raise WebConfigError(f"basic_auth_users.{user}: not a bcrypt hash ($2y$10$... from htpasswd -nBC 10)")
        parsed[user] = hashed.encode("ascii", "replace")
    return parsed


def _regular_file(path: str, what: str) -> None:
    """Refuse what is not a regular file (a FIFO's open waits for a writer, a device's read may never end)."""
    try:
        info = os.stat(path)
    except OSError:
        return  # the load that follows says why, in its own words
    if not stat.S_ISREG(info.st_mode):
        raise WebConfigError(f"{what} {path} is not a regular file")


def _read_config_text(path: str) -> str:
    """The UTF-8 text of the web config (at most MAX_WEB_CONFIG_BYTES, a BOM dropped), opened without
    waiting: a FIFO or other non-regular file is refused, never read."""
    return read_text(path, "web config", MAX_WEB_CONFIG_BYTES, WebConfigError, encoding="utf-8-sig", regular_only=True)


def load_web_config(path: str, allow_empty: bool = True) -> WebConfig:
    """Read and load ``path``. Raises WebConfigError with one line. An empty file (nothing but
    blanks and comments) is no TLS and no users; with ``allow_empty`` False it is refused."""
    text = _read_config_text(path)
    try:
        if not allow_empty and _empty(text):
            raise WebConfigError(
                "the file is empty (truncated, or being rewritten?): it would switch authentication and TLS off"
            )
        config = parse_web_config(text, os.path.dirname(os.path.abspath(path)))
    except WebConfigError as exc:
        raise WebConfigError(f"web config {path}: {one_line(exc)}") from None
    return WebConfig(config.tls_context, config.basic_auth_users, config.headers, (path,) + config.files)


def _empty(text: str) -> bool:
    """Nothing but blank lines, comments and YAML document markers: what YAML reads as no document."""
    return all(
        not line.strip() or line.lstrip().startswith("#") or line.strip() in ("---", "...")
        for line in text.splitlines()
    )


def _stamp(paths: tuple[str, ...]) -> tuple:
    stamps: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            info = os.stat(path)
            stamps.append((info.st_ino, info.st_size, info.st_mtime_ns))
        except OSError:
            stamps.append(None)
    return tuple(stamps)


class BasicAuth:
    """Basic-auth credentials against bcrypt hashes, in two steps, so that the legitimate never
    wait behind guesses (issue 23):

    - :meth:`verified`: is this (user, password) one that bcrypt has already accepted? A digest of
      (user, password, hash) compared in constant time with the few kept for that user; no bcrypt.
      Only successes are kept, so a flood of wrong passwords cannot push a valid one out (one
      cache for both, as before, could);
    - :meth:`refused`: is it one that bcrypt has already refused? Those are answered 401 again
      without bcrypt and without using up their address's budget of guesses (kvguard.sidecar.server),
      so a client repeating a wrong password (an old Prometheus replica behind the same SNAT
      address) costs a dictionary look-up, not the address's new logins. At most REFUSED_SIZE are
      kept, the least recently presented forgotten first;
    - :meth:`verify`: the bcrypt run for anything else (kvguard.sidecar.server runs it in a small pool of
      its own); a success joins the verified ones, a failure the refused ones.

    The digests are HMAC-SHA256 under a key drawn at random per process, so what is kept in memory
    cannot be tested against guessed passwords without the key. exporter-toolkit caches the same
    way (web/handler.go: bcrypt once per credential, then the cached answer). A password change in
    the web config changes the hash, hence every digest."""

    VERIFIED_PER_USER = 4
    REFUSED_SIZE = 4096  # about 0.5 MB

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key = secrets.token_bytes(32)
        self._verified: dict[str, list[bytes]] = {}
        self._refused: OrderedDict[bytes, None] = OrderedDict()

    def _digest(self, user: str, password: str, hashed: bytes) -> bytes:
        # Each part's length first, so that no two (user, password, hash) make one message.
        parts = [user.encode("utf-8", "replace"), password.encode("utf-8", "replace"), hashed]
        return hmac.new(self._key, b"".join(len(p).to_bytes(4, "big") + p for p in parts), "sha256").digest()

    def verified(self, users: Mapping[str, bytes], user: str, password: str) -> bool:
        """True when bcrypt has accepted these credentials before; constant time in the password."""
        hashed = users.get(user)
        if hashed is None:
            return False
        key = self._digest(user, password, hashed)
        with self._lock:
            digests = tuple(self._verified.get(user, ()))
        ok = False
        for digest in digests:  # every one compared, whichever matches
            ok |= hmac.compare_digest(digest, key)
        return ok

    def credential_key(self, users: Mapping[str, bytes], user: str, password: str) -> bytes:
        """The keyed digest of (user, password) against ``users``: equal for the same credential
        under the same hash, with no way back to the password (the server keeps one per connection)."""
        return self._digest(user, password, users.get(user) or _NO_USER_HASH)

    def refused(self, users: Mapping[str, bytes], user: str, password: str) -> bool:
        """True when bcrypt has refused exactly these credentials before (answered 401 without a run)."""
        key = self.credential_key(users, user, password)
        with self._lock:
            if key not in self._refused:
                return False
            self._refused.move_to_end(key)
            return True

    def verify(self, users: Mapping[str, bytes], user: str, password: str) -> bool:
        """The bcrypt check (about 70 ms at cost 10); remembers the answer."""
        import bcrypt

        hashed = users.get(user)
        # An unknown user still costs a bcrypt run, so timing does not tell which users exist.
        target = hashed or _NO_USER_HASH
        try:
            ok = bcrypt.checkpw(password.encode("utf-8", "replace"), target) and hashed is not None
        except ValueError:  # a hash bcrypt cannot read
            ok = False
        key = self._digest(user, password, target)
        with self._lock:
            if ok:
                digests = self._verified.setdefault(user, [])
                if key not in digests:
                    digests.append(key)
                    del digests[: -self.VERIFIED_PER_USER]
            else:
                self._refused[key] = None
                self._refused.move_to_end(key)
                while len(self._refused) > self.REFUSED_SIZE:
                    self._refused.popitem(last=False)
        return ok

    def check(self, users: Mapping[str, bytes], user: str, password: str) -> bool:
        """verified(), else verify() unless refused before: the whole check, in the caller's thread."""
        if self.verified(users, user, password):
            return True
        return not self.refused(users, user, password) and self.verify(users, user, password)


_NO_USER_HASH = b"$2b$10$" + b"." * 53


class GuessLimiter:
    """A token bucket per source address for guesses: ``rate`` a second, bursts of ``burst``. The
    server takes a token for each credential it hands to bcrypt (take) and gives it back when bcrypt
    accepts it (refund): only refused passwords use tokens up, and no more credentials from one
    address are in bcrypt's hands at once than it has tokens, so its guesses never outrun ``rate``
    whatever the number of its connections. At most ``max_sources`` addresses are tracked (the
    least recently seen forgotten first), so a spray of addresses cannot grow it. Thread-safe."""

    def __init__(
        self,
        rate: float = 4.0,
        burst: float = 8.0,
        max_sources: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.rate, self.burst, self.max_sources, self._clock = rate, burst, max_sources, clock
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # source -> [tokens, updated]
        self._lock = threading.Lock()
        self.refused_total = 0

    def take(self, source: str) -> bool:
        """Reserve one token for a credential about to be checked; False (nothing taken) when none is left."""
        with self._lock:
            bucket = self._refill(source)
            if bucket[0] < 1.0:
                return False
            bucket[0] -= 1.0
            return True

    def refund(self, source: str) -> None:
        """Give back the token of a credential bcrypt accepted (or that was never checked)."""
        with self._lock:
            bucket = self._refill(source)
            bucket[0] = min(self.burst, bucket[0] + 1.0)

    def spend(self, source: str) -> None:
        """Use up one token for a wrong guess let through by another budget, into debt if none is
        left: what it lets through is then paid back before this one lets any more through."""
        with self._lock:
            bucket = self._refill(source)
            bucket[0] -= 1.0

    def _refill(self, source: str) -> list[float]:
        now = self._clock()
        bucket = self._buckets.get(source)
        if bucket is None:
            bucket = self._buckets[source] = [self.burst, now]
            while len(self._buckets) > self.max_sources:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(source)
            bucket[0] = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
            bucket[1] = now
        return bucket

    def allow(self, source: str) -> bool:
        """Take one token for ``source``; False (refused, counted) when it has none left."""
        if self.take(source):
            return True
        with self._lock:
            self.refused_total += 1
        return False


# Why a reload was not applied (kvguard_web_config_reloads_total's result label, beside "success").
RELOAD_FAILED = "failure"  # the file or a file it names did not load
RELOAD_REFUSED = "refused_weaker"  # it would weaken authentication or TLS (one of REFUSED_REASONS)
RELOAD_RESULTS = ("success", RELOAD_FAILED, RELOAD_REFUSED)
# What a refused_weaker reload would have done (the reason label): switch basic auth off; switch TLS
# on or off (needs a restart, as in exporter-toolkit); lower client_auth_type (RequireAndVerifyClientCert
# to VerifyClientCertIfGiven or NoClientCert, the client CA gone with it); lower min_version.
# --web.config.allow-auth-off allows all but tls_on_off.
REFUSED_AUTH_OFF, REFUSED_TLS_ON_OFF, REFUSED_CLIENT_AUTH, REFUSED_MIN_VERSION = (
    "auth_off",
    "tls_on_off",
    "client_auth",
    "min_version",
)
REFUSED_REASONS = (REFUSED_AUTH_OFF, REFUSED_TLS_ON_OFF, REFUSED_CLIENT_AUTH, REFUSED_MIN_VERSION)
# Every (result, reason) pair the metric shows, zeros included.
RELOAD_OUTCOMES = (("success", ""), (RELOAD_FAILED, "")) + tuple((RELOAD_REFUSED, r) for r in REFUSED_REASONS)
RELOAD_TIMEOUT_SECONDS = 10.0
_VERIFY_STRENGTH = {ssl.CERT_NONE: 0, ssl.CERT_OPTIONAL: 1, ssl.CERT_REQUIRED: 2}
_VERIFY_NAMES = {
    ssl.CERT_NONE: "NoClientCert",
    ssl.CERT_OPTIONAL: "VerifyClientCertIfGiven",
    ssl.CERT_REQUIRED: "RequireAndVerifyClientCert",
}


def _tls_name(version: ssl.TLSVersion) -> str:
    return next((name for name, value in TLS_VERSIONS.items() if value == version), str(version))


def _log_error(message: str, **fields: Any) -> None:
    import logging

    from kvguard.logs import LOGGER, event

    event(logging.getLogger(LOGGER), logging.ERROR, message, **fields)


class WebConfigWatcher:
    """The current web config; re-read when the file or a file it names changes.

    ``current()`` never waits: at most once per ``check_interval`` seconds it stats the files, and
    when one changed it starts a reload on a thread of its own (one at a time; the YAML parse and
    the certificate loads stay off the server's event loop) and answers with the config in force.
    A reload that fails, or that would weaken authentication (switch basic auth off, lower
    client_auth_type or min_version: unless ``allow_auth_off``) or switch TLS on or off, keeps the
    config in force, is logged at error level and counted by result and reason
    (kvguard_web_config_reloads_total); exporter-toolkit's operators expect a config that does not
    load to change nothing. A reload still running after RELOAD_TIMEOUT_SECONDS is logged once.
    """

    def __init__(
        self,
        path: str,
        check_interval: float = 1.0,
        warn: Callable[[str], None] | None = None,
        allow_auth_off: bool = False,
    ):
        self.path = path
        self.check_interval = check_interval
        self.allow_auth_off = allow_auth_off
        self._warn = warn or (lambda line: _log_error("web config not reloaded", path=path, error=line))
        self._lock = threading.Lock()
        self.config = load_web_config(path)  # the first load raises: startup refuses a bad file
        self._stamp = _stamp(self.config.files)
        self._checked_at = time.monotonic()
        self.reloads_total = 0
        self.reload_errors_total = 0  # failed or refused
        self.results: dict[tuple[str, str], int] = dict.fromkeys(RELOAD_OUTCOMES, 0)  # (result, reason)
        self.last_reload_successful = True
        self._tls = self.config.tls_context is not None
        self._reloading: threading.Thread | None = None
        self._reload_started = 0.0
        self._slow_logged = False

    def current(self) -> WebConfig:
        now = time.monotonic()
        with self._lock:
            if now - self._checked_at < self.check_interval:
                return self.config
            self._checked_at = now
            if self._reloading is not None:
                if now - self._reload_started > RELOAD_TIMEOUT_SECONDS and not self._slow_logged:
                    self._slow_logged = True
                    self._warn(f"the reload started {now - self._reload_started:.0f}s ago has not finished")
                return self.config
            stamp = _stamp(self.config.files)
            if stamp == self._stamp:
                return self.config
            self._stamp = stamp
            self._reload_started, self._slow_logged = now, False
            self._reloading = threading.Thread(target=self._reload, name="kvguard-web-config", daemon=True)
            self._reloading.start()
            return self.config

    def wait(self, timeout: float = 10.0) -> None:
        """Wait for a reload in progress (tests, and callers that want it applied now)."""
        thread = self._reloading
        if thread is not None:
            thread.join(timeout)

    def _weaker(self, config: WebConfig) -> tuple[str, str] | None:
        """(reason, why) when ``config`` would weaken what is in force and may not; else None.

        Checked: TLS switched on or off (tls_on_off, whatever ``allow_auth_off``); basic_auth_users
        emptied (auth_off); client_auth_type lowered, RequireAndVerifyClientCert to
        VerifyClientCertIfGiven or NoClientCert, or VerifyClientCertIfGiven to NoClientCert
        (client_auth); min_version lowered (min_version). A max_version below the old min_version
        is refused with it, since a config's min_version may not be above its max_version.
        Not checked, so applied like any other change: cipher_suites (weak suites added),
        curve_preferences, max_version lowered within the old range, client_ca_file or client_ca
        changed to another CA with the same client_auth_type (a CA rotation looks the same),
        cert_file / key_file, headers, and which users there are or their hashes (a rotation)."""
        if (config.tls_context is not None) != self._tls:
            return REFUSED_TLS_ON_OFF, "turning TLS on or off needs a restart"
        if self.allow_auth_off:
            return None
        allows = " (serve --web.config.allow-auth-off allows that)"
        if self.config.basic_auth_users and not config.basic_auth_users:
            return REFUSED_AUTH_OFF, "it lists no basic_auth_users and would switch basic auth off" + allows
        old, new = self.config.tls_context, config.tls_context
        if old is not None and new is not None:
            if _VERIFY_STRENGTH[new.verify_mode] < _VERIFY_STRENGTH[old.verify_mode]:
                return REFUSED_CLIENT_AUTH, (
                    f"it lowers client_auth_type from {_VERIFY_NAMES[old.verify_mode]} "
                    f"to {_VERIFY_NAMES[new.verify_mode]}" + allows
                )
            if new.minimum_version < old.minimum_version:
                return REFUSED_MIN_VERSION, (
                    f"it lowers min_version from {_tls_name(old.minimum_version)} "
                    f"to {_tls_name(new.minimum_version)}" + allows
                )
        return None

    def _reload(self) -> None:
        result, reason, error = "success", "", None
        try:
            config = load_web_config(self.path, allow_empty=False)
            weaker = self._weaker(config)
            if weaker is not None:
                result, (reason, error) = RELOAD_REFUSED, weaker
        except WebConfigError as exc:
            result, error = RELOAD_FAILED, str(exc)
        except Exception as exc:  # noqa: BLE001 - a reload thread must say why, never die silently
            result, error = RELOAD_FAILED, one_line(exc, with_type=True)
        with self._lock:
            self.results[(result, reason)] += 1
            self.last_reload_successful = error is None
            if error is None:
                self.config = config
                self._stamp = _stamp(config.files)
                self.reloads_total += 1
            else:
                self.reload_errors_total += 1
            self._reloading = None
        if error is not None:
            self._warn(f"keeping the previous one: {error}")

    def status(self) -> tuple[bool, dict[tuple[str, str], int]]:
        """(last reload applied, reloads by (result, reason)) for the metrics."""
        with self._lock:
            return self.last_reload_successful, dict(self.results)
