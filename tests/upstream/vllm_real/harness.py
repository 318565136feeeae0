"""Run a real vLLM release's worker startup on a fake device, from kvguard's own venv.

    from vllm_real.harness import run_worker          # from tests/ (pytest puts it on sys.path)
    result = run_worker("0.34.0", {"weights_bytes": 15 << 30}, env={"KVGUARD_BUDGET": "reserved"})

The release runs in its own environment (envs.py, set up by `./dev.sh test`), in a subprocess
(worker_main.py). kvguard's package from this tree is visible there as an installed
distribution: a dist-info carrying the `vllm.general_plugins` entry points of this tree's
pyproject.toml, beside this tree's exporter/ on the path; vLLM loads it through its own
`load_general_plugins()`. Pass plugins=False to start vLLM without kvguard.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import tomllib

if __package__:
    from . import envs
else:  # run as a script
    import envs  # type: ignore[no-redef]

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]
EXAMPLE_MODEL = REPO / "exporter" / "kvguard" / "examples" / "qwen2.5-7b-instruct"
GiB = 1 << 30

# A 7B model on an 80 GiB device: the figures the fake runner allocates (fake_runner.py).
DEFAULT_SCENARIO = {
    "model_dir": str(EXAMPLE_MODEL),
    "total_memory_bytes": 80 * GiB,
    "other_process_bytes": 0,
    "init_non_torch_bytes": 512 << 20,  # CUDA context + NCCL before the init snapshot
    "weights_bytes": 15_231_233_024,  # Qwen2.5-7B in bf16
    "profile_transient_bytes": 2 * GiB,  # activation peak of profile_run, freed after
    "profile_residual_bytes": 0,  # allocated in profile_run and kept
    "profile_non_torch_bytes": 0,  # non-torch growth during profile_run
    "profile_fragment_bytes": 0,  # reserved that empty_cache cannot release after it
    "cudagraph_bytes": 512 << 20,  # CUDA graph pool (capture; also the estimate)
    "warmup_transient_bytes": 2 * GiB,  # 0.34 sizing warm-up step
    "max_model_len": 4096,
    "enforce_eager": False,
}

# Environment for the release's process: offline, loopback, vLLM's logs at DEBUG on stdout.
BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOGGING_LEVEL": "DEBUG",
    "VLLM_CONFIGURE_LOGGING": "1",
    "VLLM_LOGGING_COLOR": "0",
    "NO_COLOR": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


class EnvironmentMissing(RuntimeError):
    """The release's environment has not been set up (run ./dev.sh test)."""


class HarnessError(RuntimeError):
    """The release's startup failed on the fake device; the message carries vLLM's error."""


def available_releases() -> list[str]:
    """Releases with a pinned list whose environment is set up here."""
    return [v for v in envs.releases() if envs.env_python(v) is not None]


def _plugin_dist(site: pathlib.Path) -> None:
    """A dist-info for this tree's kvguard, with the entry points its pyproject.toml declares."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    dist = site / f"kvguard-{project['version']}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvguard\nVersion: {project['version']}\n")
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (dist / "top_level.txt").write_text("kvguard\n")


def run_worker(
    version: str,
    scenario: dict | None = None,
    env: dict | None = None,
    *,
    plugins: bool = True,
    check: bool = True,
    timeout: float = 300,
) -> dict:
    """Start release `version`'s real worker on a fake device per `scenario` (keys of
    DEFAULT_SCENARIO; gpu_memory_utilization, kv_cache_memory_bytes, block_size,
    enable_extensible_kv_cache, max_num_seqs, served_model_name also taken) and return what it did:

      returned_available_bytes  what Worker.determine_available_memory returned to the engine
      figures                   the worker's own figures (requested_memory, init snapshot, ...)
      profile                   the MemoryProfilingResult vLLM computed (every field, bytes)
      config                    the resolved cache config (block size, utilization used, ...)
      kv_cache_config           the KVCacheConfig vLLM's kv_cache_utils built (blocks, tensors)
      extensible_kv_cache       0.34's committed blocks and what sized them, where enabled
      log_lines                 every line vLLM logged, at DEBUG, formatted as vLLM formats it
      device_calls              the fake device calls made, counted
      scenario                  the scenario as run
    `env` is added to the release process's environment (KVGUARD_SPOOL_DIR, KVGUARD_BUDGET,
    VLLM_* ...). With check=True a failed startup raises HarnessError."""
    python = envs.env_python(version)
    if python is None:
        raise EnvironmentMissing(f"vLLM {version}: its environment is not set up (./dev.sh test builds it)")
    merged = {**DEFAULT_SCENARIO, **(scenario or {})}
    return run_release_process(
        python,
        HERE / "worker_main.py",
        merged,
        label=f"vLLM {version}",
        cache_key=version,
        env=env,
        plugins=plugins,
        check=check,
        timeout=timeout,
    )


def run_release_process(
    python,
    main_script: pathlib.Path,
    scenario: dict,
    *,
    label: str,
    cache_key: str,
    env: dict | None,
    plugins: bool,
    check: bool,
    timeout: float,
) -> dict:
    """Run ``main_script`` (worker_main.py, or tests/upstream/ascend_real/engine_main.py) under a release
    environment's ``python`` on ``scenario``, with kvguard (and its plugin entry point, unless
    ``plugins`` is off) importable, and return its result with the lines it logged."""
    with tempfile.TemporaryDirectory(prefix=f"kvguard-{cache_key}-") as tmp:
        tmp = pathlib.Path(tmp)
        site = tmp / "site"
        site.mkdir()
        if plugins:
            _plugin_dist(site)
        (tmp / "in.json").write_text(json.dumps({"scenario": scenario}))
        child_env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
        child_env.update(BASE_ENV)
        child_env["VLLM_CACHE_ROOT"] = str(envs.cache_root() / "vllm-cache" / cache_key)
        child_env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO / "exporter")])
        child_env.update(env or {})
        try:
            proc = subprocess.run(
                [str(python), "-W", "ignore", str(main_script), str(tmp / "in.json"), str(tmp / "out.json")],
                capture_output=True,
                text=True,
                env=child_env,
                timeout=timeout,
                cwd=tmp,
            )
        except subprocess.TimeoutExpired as exc:
            raise HarnessError(f"{label}: startup did not finish in {timeout:.0f}s") from exc
        out = tmp / "out.json"
        if not out.is_file():
            raise HarnessError(
                f"{label}: the worker process died (rc={proc.returncode}): "
                + "\n".join(proc.stderr.strip().splitlines()[-12:])
            )
        result = json.loads(out.read_text())
    result["log_lines"] = proc.stdout.splitlines()
    result["stderr_tail"] = proc.stderr.splitlines()[-40:]
    result["scenario"] = scenario
    if check and not result.get("ok"):
        raise HarnessError(
            f"{label}: {result.get('error')}\n" + "\n".join(str(result.get("traceback", "")).splitlines()[-12:])
        )
    return result


def engine_runner(engine_envs, main_script: pathlib.Path, base_scenario: dict, setup_command: str):
    """``run_engine(release, scenario=None, env=None, *, plugins, check, timeout)`` for a platform engine's
    environments (``engine_envs``: tests/upstream/ascend_real/envs.py, tests/upstream/mindspore_real/envs.py): its
    ``main_script`` run by :func:`run_release_process` on ``base_scenario`` updated by ``scenario``."""

    def run_engine(
        release: str,
        scenario: dict | None = None,
        env: dict | None = None,
        *,
        plugins: bool = True,
        check: bool = True,
        timeout: float = 300,
    ) -> dict:
        python = engine_envs.env_python(release)
        if python is None:
            raise EnvironmentMissing(f"{release}: its environment is not set up ({setup_command} {release})")
        return run_release_process(
            python,
            main_script,
            {**base_scenario, **(scenario or {})},
            label=release,
            cache_key=engine_envs._name(release),
            env=env,
            plugins=plugins,
            check=check,
            timeout=timeout,
        )

    return run_engine


def save_logs(run_engine, releases, out: pathlib.Path, scenario: dict | None = None) -> None:
    """Write each release's startup log without kvguard's plugin, at INFO (RELEASE.log) and DEBUG
    (RELEASE-debug.log), named by ``_name`` of the release, and print what each run decided."""
    out.mkdir(parents=True, exist_ok=True)
    for release, name in releases:
        for level, suffix in (("INFO", ""), ("DEBUG", "-debug")):
            result = run_engine(release, scenario, env={"VLLM_LOGGING_LEVEL": level}, plugins=False)
            path = out / f"{name}{suffix}.log"
            path.write_text("\n".join(result["log_lines"]) + "\n")
            decided = result["returned_available_bytes"]  # None on V0: its worker decides blocks
            print(
                f"{path.name}: returned {'no byte budget (V0)' if decided is None else f'{decided} bytes'}, "
                f"{result['kv_cache_config']['num_blocks']} blocks of {result['config']['block_size']} tokens, "
                f"utilization {result['config']['gpu_memory_utilization']}",
                flush=True,
            )


def vllm_lines(result: dict, contains: str) -> list[str]:
    """The logged lines that contain `contains`."""
    return [line for line in result["log_lines"] if contains in line]


if __name__ == "__main__":
    sys.exit("use: python tests/upstream/vllm_real/run.py VERSION [key=value ...]")
