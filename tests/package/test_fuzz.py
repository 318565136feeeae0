"""Property-based fuzzing of every parser the sidecar and the CLI feed untrusted bytes to.

Deterministic in CI: ``derandomize=True`` (examples follow from the test itself, not a random
seed), a bounded number of examples, no deadline (the machine is shared), no example database.
Each property is what the house rules promise: a one-line error of the parser's own type or a
counted skip, never another exception, and whatever is accepted renders and exports.
"""

from __future__ import annotations

import json
import socket
import string

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from sidecar_fixtures import snapshot

from kvguard.budget.estimator import ConfigError, Profile, ProfileError, kv_layout_from_config
from kvguard.budget.model_config import bundled_model_config_path, load_model_config
from kvguard.sidecar.collector import families
from kvguard.sidecar.core import Sidecar, SidecarConfig
from kvguard.sidecar.server import BadRequest, KVGuardServer, ServerOptions, find_head_end, parse_request
from kvguard.spool.io import read_spool, write_snapshot

FUZZ = settings(
    derandomize=True,
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# JSON values of every kind, with the numbers and strings that break naive code.
NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2**63, 2**64, 1e308]),
)
TEXT = st.one_of(st.text(max_size=20), st.sampled_from(["npu:\udcff", "\ud800", "a\x00b", "\n", "", "é" * 5]))
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=20,
)


def _bundled() -> dict:
    with open(bundled_model_config_path()) as handle:
        return json.load(handle)


CONFIG_KEYS = sorted(_bundled()) + ["head_dim", "kv_lora_rank", "qk_rope_head_dim", "text_config", "n_head"]


def _dump(value) -> str:
    return json.dumps(value, allow_nan=True, ensure_ascii=True)


# ------------------------------------------------------------------ config.json


@FUZZ
@given(overrides=st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON, max_size=4))
def test_any_config_json_mutation_is_a_config_or_a_config_error(tmp_path, overrides):
    path = tmp_path / "config.json"
    path.write_text(_dump({**_bundled(), **overrides}))
    try:
        config = load_model_config(str(path))
        layout = kv_layout_from_config(config)
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    assert layout.block_bytes > 0


@FUZZ
@given(raw=st.binary(max_size=200))
def test_any_bytes_as_config_json_are_a_config_error_or_an_object(tmp_path, raw):
    path = tmp_path / "config.json"
    path.write_bytes(raw)
    try:
        assert isinstance(load_model_config(str(path)), dict)
    except ConfigError:
        pass


# ------------------------------------------------------------------ profile files

PROFILE_KEYS = (
    "total_memory_bytes",
    "gpu_memory_utilization",
    "weights_bytes",
    "peak_allocated_increase_bytes",
    "peak_reserved_increase_bytes",
    "non_torch_increase_bytes",
)


@FUZZ
@given(data=st.one_of(JSON, st.fixed_dictionaries({k: st.one_of(NUMBERS, st.none()) for k in PROFILE_KEYS})))
def test_any_profile_file_is_a_profile_or_a_profile_error(data):
    text = _dump(data)
    try:
        profile = Profile.from_dict(json.loads(text))
    except ProfileError as exc:
        assert "\n" not in str(exc)
        return
    assert 0 < profile.gpu_memory_utilization <= 1


# ------------------------------------------------------------------ snapshots

SNAPSHOT_PATHS = [
    ("device",),
    ("host",),
    ("pid",),
    ("rank",),
    ("written_at",),
    ("sequence",),
    ("pod",),
    ("pod", "pod"),
    ("memory",),
    ("memory", "device"),
    ("memory", "allocated_bytes"),
    ("memory", "reserved_bytes"),
    ("memory", "processes"),
    ("profile",),
    ("profile", "gpu_memory_utilization"),
    ("kv_cache",),
    ("kv_cache", "num_blocks"),
    ("probe",),
    ("probe", "last_error"),
    ("schema",),
    ("kind",),
]


def _set(data: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        if not isinstance(data.get(key), dict):
            data[key] = {}
        data = data[key]
    data[path[-1]] = value


@FUZZ
@given(
    mutations=st.lists(st.tuples(st.sampled_from(SNAPSHOT_PATHS), JSON), max_size=3),
    junk=st.one_of(st.none(), st.binary(max_size=100)),
)
def test_any_spool_content_is_counted_or_exported(tmp_path_factory, mutations, junk):
    spool = tmp_path_factory.mktemp("spool")
    write_snapshot(str(spool), snapshot(rank=0, pid=10))
    data = snapshot(rank=1, device="npu:1", pid=11).to_dict()
    for path, value in mutations:
        _set(data, path, value)
    (spool / "mutated.json").write_text(_dump(data))
    if junk is not None:
        (spool / "junk.json").write_bytes(junk)
    result = read_spool(str(spool))
    assert len(result.snapshots) + sum(result.skipped.values()) == (3 if junk is not None else 2)
    observation = Sidecar(
        SidecarConfig(spool_dir=str(spool), pod_labels={"pod": "", "namespace": "", "container": ""})
    ).observe()
    assert any(rank.labels["device"] == "npu:0" for rank in observation.ranks)  # the good rank survives

    class Registry:
        def collect(self):
            return iter(families(observation))

    text = generate_latest(Registry()).decode("utf-8")
    assert 'device="npu:0"' in text
    generate_openmetrics(Registry())
    json.dumps(observation.guard_dict()).encode("utf-8")


# ------------------------------------------------------------------ HTTP request heads

TOKENS = st.sampled_from(
    [
        "GET",
        "HEAD",
        "POST",
        "get",
        "",
        " ",
        "/metrics",
        "/healthz",
        "*",
        "HTTP/1.1",
        "HTTP/1.0",
        "HTTP/2.0",
        "HTTP/1.1 ",
        "\t",
        ":",
        "Host",
        "Content-Length",
        "Transfer-Encoding",
        "Connection",
        "close",
        "keep-alive",
        "-1",
        "99999999999999999999",
        "\x00",
        "\r",
        "\n",
        "\r\n",
        "é",
        "Authorization: Basic !!",
    ]
)
HEADS = st.one_of(
    st.lists(TOKENS, max_size=12).map(lambda parts: "".join(parts).encode("latin-1", "replace")),
    st.binary(max_size=300),
    st.builds(
        lambda line, headers: (line + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode(
            "latin-1", "replace"
        ),
        st.text(alphabet=string.printable, max_size=40),
        st.lists(
            st.tuples(st.text(alphabet=string.ascii_letters + "-:", min_size=0, max_size=12), st.text(max_size=20)),
            max_size=5,
        ),
    ),
)


@FUZZ
@given(head=HEADS)
def test_any_request_head_is_a_request_or_a_bad_request(head):
    end = find_head_end(head + b"\r\n\r\n")
    try:
        request = parse_request((head + b"\r\n\r\n")[:end])
    except BadRequest as exc:
        assert 400 <= exc.status < 600
        return
    assert request.method.isupper() and request.version in ("HTTP/1.0", "HTTP/1.1")


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    spool = tmp_path_factory.mktemp("live")
    write_snapshot(str(spool), snapshot())
    server = KVGuardServer(
        Sidecar(SidecarConfig(spool_dir=str(spool), pod_labels={"pod": "", "namespace": "", "container": ""})),
        ServerOptions(listen="127.0.0.1", port=0, header_timeout=1.0),
    ).start()
    yield server
    server.stop()


@settings(
    derandomize=True,
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(head=HEADS)
def test_the_running_server_answers_any_head_and_keeps_serving(live_server, head):
    with socket.create_connection(("127.0.0.1", live_server.port), timeout=5) as sock:
        try:
            sock.sendall(head + b"\r\n\r\n")
            sock.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        except (ConnectionResetError, BrokenPipeError):
            answer = b""
    assert answer == b"" or answer.startswith(b"HTTP/1.1 ")
    with socket.create_connection(("127.0.0.1", live_server.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
