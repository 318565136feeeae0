"""``kvguard serve``: the sidecar.

Registered on the ``kvguard`` click group by ``kvguard.cli``. The flags are a contract
(docs/metrics.md): the Helm chart and the README use them.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from typing import Any

import click

from kvguard.cli.options import read_startup_log_or_fail
from kvguard.sidecar import limits

DEFAULT_PORT = 10240
# Where --demo makes its spool when --spool-dir is not given: in memory when /dev/shm is writable
# (it is in a container with a read-only root, where /tmp may not be), else the temporary directory.
DEMO_SPOOL_PARENTS: tuple[str | None, ...] = ("/dev/shm", None)
DEMO_MAX_INTERVAL = 1.0


def _build_sources(names: tuple[str, ...], nvml_mig: bool = False) -> list[tuple[str, Any]]:
    from kvguard.sources import SourceError, get_source

    options = {"nvml": {"mig": True}, "auto": {"nvml_mig": True}} if nvml_mig else {}

    built = []
    for name in names:
        if name == "none":
            continue
        try:
            built.append((name, get_source(name, **options.get(name, {}))))
        except SourceError as exc:
            if name == "auto":  # nothing to find on this machine is not an error for auto
                click.echo(f"kvguard serve: --source auto: {exc}", err=True)
                continue
            raise click.ClickException(f"--source {name}: {exc}") from None
    return built


def _make_demo_spool() -> str:
    """A new spool directory for --demo under the first writable parent; one line when none is."""
    tried = []
    for parent in DEMO_SPOOL_PARENTS:
        try:
            return tempfile.mkdtemp(prefix="kvguard-demo-", dir=parent)
        except OSError as exc:
            tried.append(f"{parent or tempfile.gettempdir()}: {exc.strerror or exc}")
    raise click.ClickException(
        f"cannot create a demo spool directory ({'; '.join(tried)}); give --spool-dir a writable directory"
    )


def _make_spool_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise click.ClickException(f"cannot create spool directory {path}: {exc.strerror or exc}") from None


def _read_password(path: str | None) -> str | None:
    if path is None:
        return os.environ.get("KVGUARD_BASIC_AUTH_PASSWORD")
    try:
        with open(path, "r", encoding="utf-8") as handle:
            return handle.read(4096).rstrip("\r\n")
    except OSError as exc:
        raise click.ClickException(f"cannot read --basic-auth-password-file {path}: {exc.strerror or exc}") from None


def _check_basic_auth(user: str | None, password_file: str | None) -> str | None:
    """The basic-auth password, or None without basic auth. An empty user or password is refused:
    the chart passes --basic-auth-user=$(KVGUARD_BASIC_AUTH_USER), and an empty Secret key must not
    turn authentication off."""
    if user is None:
        if password_file is not None:
            raise click.UsageError("--basic-auth-password-file needs --basic-auth-user")
        return None
    if not user.strip():
        raise click.UsageError("--basic-auth-user is empty: refusing to serve with authentication switched off")
    if user.startswith("$(") and user.endswith(")"):
        raise click.UsageError(f"--basic-auth-user is {user!r}: the environment variable it names is not set")
    if ":" in user:
        raise click.UsageError("--basic-auth-user must not contain ':' (basic auth splits user and password there)")
    password = _read_password(password_file)
    if password is None:
        raise click.UsageError("--basic-auth-user needs --basic-auth-password-file or KVGUARD_BASIC_AUTH_PASSWORD")
    if not password:
        raise click.UsageError("the basic-auth password is empty: refusing to serve with authentication switched off")
    return password


def _load_web_config(
    path: str | None, tls_cert_file: str | None, basic_auth_user: str | None, allow_auth_off: bool = False
):
    if path is None:
        return None
    from kvguard.sidecar.webconfig import WebConfigError, WebConfigWatcher

    try:
        watcher = WebConfigWatcher(path, allow_auth_off=allow_auth_off)
    except WebConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if tls_cert_file and watcher.config.tls_context is not None:
        raise click.UsageError("--tls-cert-file and the web config's tls_server_config: give one of them")
    if basic_auth_user is not None and watcher.config.basic_auth_users:
        raise click.UsageError("--basic-auth-user and the web config's basic_auth_users: give one of them")
    return watcher


@click.command()
@click.option(
    "--listen",
    metavar="ADDR",
    help='Address to bind: an IPv4 address, or an IPv6 one ("::" or "[::]": every address, IPv6 and IPv4 '
    "where the host maps them, for dual-stack and IPv6-only clusters) [default: 0.0.0.0; with --demo: "
    "127.0.0.1, this host only].",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=DEFAULT_PORT,
    show_default=True,
    help="Port to serve /metrics, /healthz, /readyz, /guard and /runbook on.",
)
@click.option(
    "--spool-dir",
    envvar="KVGUARD_SPOOL_DIR",
    metavar="DIR",
    help="Where the probes write snapshots [env KVGUARD_SPOOL_DIR; default: no spool is read, "
    "with --demo a new directory under /dev/shm or the temporary directory].",
)
@click.option(
    "--source",
    "sources",
    multiple=True,
    metavar="NAME",
    help="Device-level source, repeatable: auto, nvml, npu-smi, host, sim, none [default: auto; with --demo: host].",
)
@click.option(
    "--nvml-mig",
    is_flag=True,
    help="With the nvml (or auto) source, also read each MIG device of a GPU "
    "in MIG mode as a device of its own (label cuda:N/mig:S, its own UUID).",
)
@click.option("--vllm-metrics-url", metavar="URL", help="vLLM's /metrics, e.g. http://127.0.0.1:8000/metrics.")
@click.option("--from-log", "log_file", metavar="FILE", help="vLLM startup log to take the profile from.")
@click.option(
    "--interval",
    type=click.FloatRange(0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds between background reads of the sources and vLLM.",
)
@click.option(
    "--stale-after",
    type=click.FloatRange(0, min_open=True),
    default=30.0,
    show_default=True,
    help="A snapshot older than this many seconds is stale.",
)
@click.option(
    "--forget-after",
    type=click.FloatRange(0, min_open=True),
    metavar="SECONDS",
    help="Leave out a rank whose snapshot was not written for this many seconds (a dead rank; "
    "one whose process is gone on this host goes at once) [default: 4 x --stale-after].",
)
@click.option(
    "--read-timeout",
    type=click.FloatRange(0, min_open=True),
    default=2.0,
    show_default=True,
    help="Time limit in seconds for one source, spool or vLLM read.",
)
@click.option("--fail-readiness-on-critical", is_flag=True, help="/readyz answers 503 while a rank is critical.")
@click.option("--tls-cert-file", metavar="FILE", help="Serve HTTPS with this certificate (PEM).")
@click.option("--tls-key-file", metavar="FILE", help="Private key for --tls-cert-file (PEM).")
@click.option("--basic-auth-user", metavar="USER", help="Require HTTP basic auth (except /healthz, /readyz).")
@click.option(
    "--basic-auth-password-file",
    metavar="FILE",
    help="File holding the basic-auth password [or env KVGUARD_BASIC_AUTH_PASSWORD].",
)
@click.option(
    "--web.config.file",
    "web_config_file",
    metavar="FILE",
    help="Prometheus exporter-toolkit web config (tls_server_config, basic_auth_users with bcrypt "
    "hashes); re-read on change. The --tls-* and --basic-auth-* flags are shorthands for it.",
)
@click.option(
    "--web.config.allow-auth-off",
    "web_config_allow_auth_off",
    is_flag=True,
    help="Apply a reload of --web.config.file that lists no basic_auth_users (switching basic auth "
    "off) or lowers client_auth_type or min_version; without it such a reload keeps the previous "
    "config and is logged at error level.",
)
@click.option(
    "--engine-id",
    envvar="KVGUARD_ENGINE_ID",
    default="",
    metavar="ID",
    help="The engine the spool's ranks belong to, the same on every pod of a multi-node engine "
    "(an LWS group, a Ray cluster): the engine_id label [env KVGUARD_ENGINE_ID; default: the "
    "rank's pod, else its host].",
)
@click.option(
    "--max-ranks",
    type=click.IntRange(1),
    default=limits.MAX_RANKS,
    show_default=True,
    help="Ranks exported at most; past it a rank is left out and counted (kvguard_ranks_cut).",
)
@click.option(
    "--max-engines",
    type=click.IntRange(1),
    default=limits.MAX_ENGINES,
    show_default=True,
    help="Distinct engines (engine_id, engine) exported at most; past it their ranks are left out and counted.",
)
@click.option(
    "--max-models",
    type=click.IntRange(1),
    default=limits.MAX_MODELS,
    show_default=True,
    help="Distinct model names exported at most; past it their ranks are left out and counted.",
)
@click.option(
    "--max-pods",
    type=click.IntRange(1),
    default=limits.MAX_PODS,
    show_default=True,
    help="Distinct pods exported at most; past it their ranks are left out and counted.",
)
@click.option(
    "--max-label-length",
    type=click.IntRange(16),
    default=limits.MAX_LABEL_CHARS,
    show_default=True,
    help="Characters of a rank label value at most; a longer one is cut and counted (kvguard_label_values_truncated).",
)
@click.option(
    "--max-metrics-bytes",
    type=click.IntRange(64 * 1024),
    default=limits.MAX_METRICS_BYTES,
    show_default=True,
    help="Bytes of the ranks' series in one /metrics answer at most; ranks past it are left out of "
    "/metrics (not /guard) and counted.",
)
@click.option(
    "--log.level",
    "log_level",
    type=click.Choice(["debug", "info", "warn", "error"]),
    default="info",
    show_default=True,
    help="Log lines on stderr at this level and above: source failures and guard state changes, once per change.",
)
@click.option(
    "--log.format",
    "log_format",
    type=click.Choice(["logfmt", "json"]),
    default="logfmt",
    show_default=True,
    help="Log line format.",
)
@click.option(
    "--demo",
    is_flag=True,
    help=f"Serve simulated ranks through probe -> spool -> collector (--interval is capped at {DEMO_MAX_INTERVAL:g}s).",
)
@click.option(
    "--web.runbook-public",
    "web_runbook_public",
    is_flag=True,
    help="Answer /runbook and /runbook/<alert> without basic auth: the alerts' links open in a "
    "browser that has no scrape credentials (the rest stays behind auth).",
)
@click.option(
    "--demo-ranks",
    type=click.IntRange(1, 16),
    default=2,
    show_default=True,
    help="Simulated ranks with --demo (the last one is set up to trip the guard).",
)
def serve(
    listen,
    port,
    spool_dir,
    sources,
    nvml_mig,
    vllm_metrics_url,
    log_file,
    interval,
    stale_after,
    forget_after,
    read_timeout,
    fail_readiness_on_critical,
    tls_cert_file,
    tls_key_file,
    basic_auth_user,
    basic_auth_password_file,
    web_config_file,
    web_config_allow_auth_off,
    engine_id,
    max_ranks,
    max_engines,
    max_models,
    max_pods,
    max_label_length,
    max_metrics_bytes,
    log_level,
    log_format,
    demo,
    demo_ranks,
    web_runbook_public,
):
    """Run the sidecar: allocator memory, fragmentation and the OOM guard for every rank, over HTTP."""
    from kvguard.logs import setup as setup_logging
    from kvguard.sidecar.core import Sidecar, SidecarConfig
    from kvguard.sidecar.server import KVGuardServer, ServerOptions, make_tls_context
    from kvguard.text import safe_text

    setup_logging(log_level, log_format)
    if listen is None:
        # The demo serves simulated ranks to whoever runs it: this host only, unless --listen says otherwise.
        listen = "127.0.0.1" if demo else "0.0.0.0"
    if listen.startswith("[") and listen.endswith("]"):  # "[::]", as URLs and Kubernetes values write IPv6
        listen = listen[1:-1]
    if bool(tls_cert_file) != bool(tls_key_file):
        raise click.UsageError("--tls-cert-file and --tls-key-file go together")
    password = _check_basic_auth(basic_auth_user, basic_auth_password_file)
    watcher = _load_web_config(web_config_file, tls_cert_file, basic_auth_user, web_config_allow_auth_off)
    startup = read_startup_log_or_fail(log_file) if log_file else None
    requested_interval = interval
    if demo:
        sources = sources or ("host",)
        interval = min(interval, DEMO_MAX_INTERVAL)
    built_sources = _build_sources(sources or ("auto",), nvml_mig=nvml_mig)
    options = ServerOptions(
        listen=listen,
        port=port,
        fail_readiness_on_critical=fail_readiness_on_critical,
        tls_cert_file=tls_cert_file,
        tls_key_file=tls_key_file,
        basic_auth_user=basic_auth_user,
        basic_auth_password=password,
        web_config_file=web_config_file,
        runbook_public=web_runbook_public,
    )
    try:
        tls_context = make_tls_context(options)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise click.ClickException(f"cannot load TLS certificate or key: {detail}") from None

    demo_spool = None
    if demo and not spool_dir:
        spool_dir = demo_spool = _make_demo_spool()
    elif demo:
        _make_spool_dir(spool_dir)
    running_demo = None
    try:
        if demo:
            from kvguard.sim.demo import start_demo

            # The demo's ranks, and their simulated engines' vLLM /metrics, which the sidecar reads as it
            # reads a real vLLM's (unless --vllm-metrics-url names one).
            running_demo = start_demo(spool_dir, demo_ranks, interval=interval)
            vllm_metrics_url = vllm_metrics_url or running_demo.vllm_metrics_url
        sidecar = Sidecar(
            SidecarConfig(
                spool_dir=spool_dir or None,
                sources=built_sources,
                vllm_metrics_url=vllm_metrics_url,
                startup_log=startup,
                interval=interval,
                stale_after=stale_after,
                forget_after=forget_after,
                read_timeout=read_timeout,
                engine_id=safe_text(engine_id, 253),
                max_ranks=max_ranks,
                max_engines=max_engines,
                max_models=max_models,
                max_pods=max_pods,
                max_label_chars=max_label_length,
                max_metrics_bytes=max_metrics_bytes,
            )
        )
        try:
            server = KVGuardServer(sidecar, options, tls_context=tls_context, web_config=watcher)
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {listen}:{port}: {exc.strerror or exc}") from None
        sidecar.start()
        # SIGTERM must stop the server cleanly from the moment the banner tells anyone it is up.
        _serve_until_signalled(
            server,
            sidecar,
            running_demo,
            lambda: _announce(
                server, sidecar, spool_dir, vllm_metrics_url, log_file, demo, demo_ranks, interval, requested_interval
            ),
        )
    finally:
        if running_demo is not None:
            running_demo.stop()
        if demo_spool:
            shutil.rmtree(demo_spool, ignore_errors=True)


def _announce(
    server, sidecar, spool_dir, vllm_metrics_url, log_file, demo, demo_ranks, interval, requested_interval
) -> None:
    say = lambda text: click.echo(text, err=True)  # noqa: E731 - stdout stays free for pipes
    bound = server.options.listen
    where = f"; bound to {bound or 'every address'}: every address" if bound in ("0.0.0.0", "::", "") else ""
    say(f"kvguard serve: {server.url('/metrics')}  (also /guard, /healthz, /readyz, /runbook{where})")
    say(
        f"  spool {spool_dir or 'none'}; sources: {', '.join(n for n, _ in sidecar.config.sources) or 'none'}"
        + (f"; vLLM {vllm_metrics_url}" if vllm_metrics_url else "")
        + (f"; log {log_file}" if log_file else "")
    )
    if demo:
        capped = (
            f" (--interval {requested_interval:g} capped at {interval:g}s in the demo)"
            if requested_interval > interval
            else ""
        )
        say(
            f"  demo: {demo_ranks} simulated rank(s), each an engine of its own, written by the real probe every "
            f"{interval:g}s{capped}; their simulated vLLM /metrics at {vllm_metrics_url}."
        )
        say(f"  look at:  curl -s {server.url('/guard')}   (the last rank turns critical)")
        say(
            f"            curl -s {server.url('/metrics')} | grep -E "
            f"'kvguard_(allocator_fragmentation_bytes|guard_state|guard_headroom_bytes)'"
        )


def _serve_until_signalled(server, sidecar, probe, announce) -> None:
    def stop(signum, _frame):
        raise KeyboardInterrupt

    # SIGHUP (a closed terminal) ends serve as SIGTERM does, cleanly: --demo's spool is removed.
    # Go programs such as node_exporter end on it too; none of kvguard's state is reloaded by it.
    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        announce()
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        server.close()
        sidecar.stop()
        if probe is not None:
            probe.stop()
