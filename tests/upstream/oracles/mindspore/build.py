"""Build kvguard's MindSpore pool oracle (ms_pool_oracle.cc) against each MindSpore release's PyPI wheel.

Standard library only: dev.sh runs it with the system python3. Needs g++, binutils (readelf, nm) and
libpython3.11 (Debian: g++, libpython3.11).

For each release in RELEASES it
  1. downloads the cp311 x86_64 wheel once (`pip download --no-deps`) into $CACHE/wheels;
  2. extracts only what the build needs: mindspore/include/ and the shared libraries that the pool's
     libraries load, found by following their NEEDED entries through the wheel's lib/ folder;
  3. writes link-time stand-ins: an empty library for each soname the wheel does not ship (CANN's
     libascendcl.so, libruntime.so, ...) and one library defining every symbol the loaded libraries
     bind but nothing defines (GE operator registration, HCCL, direct ACL calls). Static initialisers
     call a few of them (GE registration), so each returns 0; the pool path reaches none;
  4. compiles the harness and runs it once on a two-op stream;
and leaves $CACHE/oracles/mindspore-X/ms_pool_oracle. A marker holds the digest of the wheel's name and
size, the harness source and this script: a second run does nothing. A second marker holds the digest of
what steps 2 and 3 depend on (the wheel's name and size, the extraction and stand-in code): when only the
harness changed, it is recompiled against the extracted tree, without the wheel (which the setup retires
once unpacked, tests/upstream/oracles/cache.py). A release that does not build or load leaves a FAILED file with the
reason (one line), also digest-keyed, and is reported, not retried.

    python3 tests/upstream/oracles/mindspore/build.py [X ...]     build (or check) the oracles; print timings
    python3 tests/upstream/oracles/mindspore/build.py --path X    print the oracle's path, if it is built

CACHE is ${KVGUARD_CACHE:-${XDG_CACHE_HOME:-~/.cache}/kvguard}, as for tests/upstream/vllm_real/envs.py.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import zipfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from cache import cache_root, find_wheel, wheel_size  # noqa: E402  (tests/upstream/oracles/cache.py: the cache root the setup scripts share)

HERE = pathlib.Path(__file__).resolve().parent
HARNESS = HERE / "ms_pool_oracle.cc"
# The releases on PyPI whose wheels carry the 2.6+ pool layout (plugin/ascend/libmindspore_ascend_res_manager.so).
RELEASES = ("2.7.0", "2.7.1", "2.7.2", "2.8.0", "2.9.0", "2.10.0")
MARKER = ".kvguard-ready"
EXTRACTED = ".kvguard-extracted"  # the extracted wheel and the stand-ins, by _extraction_digest
FAILED = "FAILED"
# The libraries the harness links: the pool, its Ascend support and the context it reads (REQUIRED), and
# those that hold parts of them in some releases (2.7.0 has no hardware_abstract library).
REQUIRED = ("libmindspore_ascend_res_manager.so", "libmindspore_memory_pool.so", "libmindspore_core.so")
LINKED = REQUIRED + ("libmindspore_backend_common.so", "libmindspore_hardware_abstract.so", "libmindspore_common.so")
STUBS_SONAME = "libkvguard_cann_stubs.so"


def oracle_dir(version: str) -> pathlib.Path:
    return cache_root() / "oracles" / f"mindspore-{version}"


def oracle_path(version: str) -> pathlib.Path | None:
    """The built oracle for ``version``, or None when it has not been built (or did not build)."""
    path = oracle_dir(version) / "ms_pool_oracle"
    return path if (oracle_dir(version) / MARKER).is_file() and path.exists() else None


def failure(version: str) -> str | None:
    """Why ``version`` does not build or load, when the last build said so."""
    path = oracle_dir(version) / FAILED
    return path.read_text().split("\n", 1)[1].strip() if path.is_file() else None


class BuildError(Exception):
    """One line: why a release's oracle does not build or load."""


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)


def _digest(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _wheel(version: str, fetch: bool = False) -> pathlib.Path:
    """The release's wheel, downloaded once; once the oracle is built it may be retired
    (tests/upstream/oracles/cache.py:
    its name and size kept, its bytes dropped), and ``fetch`` downloads it again for a build."""
    wheels = cache_root() / "wheels"
    pattern = f"mindspore-{version}-cp311-cp311-*x86_64.whl"
    found = [path] if (path := find_wheel(wheels, pattern)) is not None and (path.exists() or not fetch) else []
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        proc = _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.11",
                "--platform",
                "manylinux1_x86_64",
                "--platform",
                "manylinux2014_x86_64",
                f"mindspore=={version}",
                "-d",
                wheels,
            ]
        )
        found = sorted(wheels.glob(pattern))
        if proc.returncode != 0 or not found:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no wheel"]
            raise BuildError(f"no cp311 x86_64 wheel: {tail[0]}")
    return found[0]


def _needed(lib: pathlib.Path) -> list[str]:
    proc = _run(["readelf", "-d", lib])
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", proc.stdout)


def _system_has(soname: str) -> bool:
    if not hasattr(_system_has, "cache"):
        _system_has.cache = _run(["ldconfig", "-p"]).stdout
    return f"{soname} (" in _system_has.cache or soname.startswith("libpython3")


def _extract(wheel: pathlib.Path, root: pathlib.Path) -> tuple[list[pathlib.Path], list[str]]:
    """Extract include/ and the load closure of LINKED; return (extracted libraries, sonames nobody ships)."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        libs_by_name: dict[str, list[str]] = {}
        for name in names:
            if name.startswith("mindspore/lib/") and ".so" in name.rsplit("/", 1)[-1]:
                libs_by_name.setdefault(name.rsplit("/", 1)[-1], []).append(name)
        for name in names:
            if name.startswith("mindspore/include/"):
                archive.extract(name, root)
        extracted: dict[str, pathlib.Path] = {}
        missing: list[str] = []
        queue = list(LINKED)
        while queue:
            soname = queue.pop()
            if soname in extracted or soname in missing:
                continue
            members = libs_by_name.get(soname)
            if not members:
                if not _system_has(soname):
                    missing.append(soname)
                continue
            for member in members:  # a soname shipped twice (two plugin folders) is extracted twice
                archive.extract(member, root)
            extracted[soname] = root / min(members, key=len)
            queue.extend(_needed(extracted[soname]))
        unknown = [name for name in REQUIRED if name not in extracted]
        if unknown:
            raise BuildError(f"the wheel ships no {', '.join(unknown)}: the pool is not a library of its own here")
    return list(extracted.values()), missing


def _symbols(lib: pathlib.Path, defined: bool) -> set[str]:
    flag = "--defined-only" if defined else "--undefined-only"
    out = _run(["nm", "-D", flag, lib]).stdout
    names = set()
    for line in out.splitlines():
        fields = line.split()
        if not fields:
            continue
        if defined:
            names.add(fields[-1].split("@")[0])
        elif fields[0] == "U" and "@" not in fields[-1]:  # versioned ones are glibc's / libstdc++'s
            names.add(fields[-1])
    return names


def _system_libs(libs: list[pathlib.Path]) -> list[pathlib.Path]:
    """The system libraries (libpython, libstdc++, ...) the extracted ones load: their symbols count as defined."""
    table = _run(["ldconfig", "-p"]).stdout
    paths = set()
    for lib in libs:
        for soname in _needed(lib):
            match = re.search(rf"\s{re.escape(soname)} \(libc6,x86-64[^)]*\) => (\S+)", table)
            if match:
                paths.add(pathlib.Path(match.group(1)))
    python = (
        pathlib.Path(
            _run(["python3", "-c", "import sysconfig;print(sysconfig.get_config_var('LIBDIR'))"]).stdout.strip()
        )
        / "libpython3.11.so.1.0"
    )
    if python.exists():
        paths.add(python)
    return sorted(paths)


def _linked(libs: list[pathlib.Path]) -> list[str]:
    names = {lib.name for lib in libs}
    return [name for name in LINKED if name in names]


def _stand_ins(libs: list[pathlib.Path], missing: list[str], out: pathlib.Path) -> int:
    """Empty libraries for the sonames nobody ships, and one library of stubs; returns the stub count."""
    out.mkdir(parents=True, exist_ok=True)
    empty = out / "empty.c"
    empty.write_text("/* a soname CANN would provide; its symbols are in " + STUBS_SONAME + " */\n")
    for soname in missing:
        proc = _run(["gcc", "-shared", "-fPIC", empty, "-o", out / soname, f"-Wl,-soname,{soname}"])
        if proc.returncode != 0:
            raise BuildError(f"gcc failed on the empty {soname}: {proc.stderr.strip().splitlines()[-1:]}")
    defined: set[str] = set()
    for lib in libs + _system_libs(libs):
        defined |= _symbols(lib, defined=True)
    wanted: set[str] = set()
    for lib in libs:
        wanted |= _symbols(lib, defined=False)
    stubs = sorted(wanted - defined)
    lines = [
        "/* Generated by tests/upstream/oracles/mindspore/build.py: every symbol the pool's libraries bind that",
        "   nothing here defines (GE, HCCL, runtime). Static initialisers call a few (GE registration): each",
        "   returns 0, and logs when KVGUARD_ORACLE_VERBOSE is set. The pool path reaches none. */",
        "#include <stdio.h>",
        "#include <stdlib.h>",
        "static long noted(const char *name) {",
        '  if (getenv("KVGUARD_ORACLE_VERBOSE")) fprintf(stderr, "stub called: %s\\n", name);',
        "  return 0;",
        "}",
    ]
    for i, name in enumerate(stubs):
        lines.append(f'long stub_{i}(void) __asm__("{name}");')
        lines.append(f'long stub_{i}(void) {{ return noted("{name}"); }}')
    source = out / "stubs.c"
    source.write_text("\n".join(lines) + "\n")
    proc = _run(["gcc", "-shared", "-fPIC", "-O1", source, "-o", out / STUBS_SONAME, f"-Wl,-soname,{STUBS_SONAME}"])
    if proc.returncode != 0:
        raise BuildError(f"gcc failed on the stubs: {proc.stderr.strip().splitlines()[-1:]}")
    return len(stubs)


def _compile(root: pathlib.Path, stand_ins: pathlib.Path, binary: pathlib.Path, linked: list[str]) -> None:
    package = root / "mindspore"
    include, lib = package / "include", package / "lib"
    # Old-ABI std::string (no __cxx11 in the wheel's mangled names) must be matched, or nothing links.
    core = _run(["nm", "-D", lib / "libmindspore_core.so"]).stdout
    abi = "1" if "__cxx11" in core else "0"
    python_libdir = _run(["python3", "-c", "import sysconfig;print(sysconfig.get_config_var('LIBDIR'))"]).stdout.strip()
    rpath = ":".join(str(p) for p in (lib, lib / "plugin" / "ascend", stand_ins, python_libdir))
    cmd = [
        "g++",
        "-std=c++17",
        "-O1",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{include / 'mindspore' / 'ccsrc'}",
        f"-I{include / 'mindspore' / 'core' / 'include'}",
        f"-I{include / 'mindspore' / 'core'}",
        f"-I{include / 'mindspore'}",
        f"-I{include}",
        f"-I{include / 'third_party'}",
        f"-I{include / 'third_party' / 'include'}",
        HARNESS,
        "-o",
        binary,
        f"-L{lib}",
        f"-L{lib / 'plugin' / 'ascend'}",
        f"-L{stand_ins}",
        f"-L{python_libdir}",
        f"-Wl,-rpath,{rpath}",
        "-Wl,--allow-shlib-undefined",
        "-Wl,--no-as-needed",
        # DT_RPATH, not RUNPATH: the loader then uses it for the libraries' own NEEDED entries too
        # (libshmem.so's libruntime.so stand-in), not only the harness's.
        "-Wl,--disable-new-dtags",
        *(f"-l{name[3:-3]}" for name in linked),
        "-lpython3.11",
        f"-l:{STUBS_SONAME}",
    ]
    proc = _run(cmd)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "error" in line] or proc.stderr.strip().splitlines()
        raise BuildError(f"g++ failed: {errors[0][:300] if errors else 'no output'}")


def _smoke(binary: pathlib.Path) -> None:
    ops = '{"op": "malloc", "size": 1024, "persistent": false}\n{"op": "free", "index": 0}\n'
    env = {**os.environ, "KVGUARD_ORACLE_DEVICE_FREE": str(16 << 30), "MS_ALLOC_CONF": "enable_vmm:false"}
    try:
        proc = _run([binary], input=ops, env=env, timeout=120)
    except subprocess.TimeoutExpired:
        raise BuildError("the oracle did not answer within 120 s") from None
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or len(lines) != 3 or '"oom":false' not in lines[1]:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:] or [f"rc {proc.returncode}"]
        raise BuildError(f"does not load: {tail[0][:300]}")


def _extraction_digest(wheel: pathlib.Path) -> str:
    """What the extracted tree and the stand-ins depend on: the wheel, and the code that extracts and stubs."""
    code = "".join(inspect.getsource(f) for f in (_extract, _needed, _system_has, _stand_ins, _symbols, _system_libs))
    return _digest(wheel.name, str(wheel_size(wheel)), code, repr(LINKED), STUBS_SONAME)


def _extracted_libs(root: pathlib.Path) -> list[pathlib.Path]:
    """The libraries an earlier build extracted (the ones the harness links, as _extract found them)."""
    lib = root / "mindspore" / "lib"
    return [path for path in lib.rglob("*.so*") if path.is_file()]


def build(version: str) -> tuple[str, str]:
    """Build one release's oracle: ("built" | "recompiled" | "ready" | "failed", detail)."""
    out = oracle_dir(version)
    wheel = _wheel(version)
    digest = _digest(wheel.name, str(wheel_size(wheel)), HARNESS.read_text(), pathlib.Path(__file__).read_text())
    marker, failed, extracted = out / MARKER, out / FAILED, out / EXTRACTED
    if marker.is_file() and marker.read_text().strip() == digest and (out / "ms_pool_oracle").exists():
        return "ready", str(out / "ms_pool_oracle")
    if failed.is_file() and failed.read_text().split("\n", 1)[0] == digest:
        return "failed", failure(version) or ""
    extraction = _extraction_digest(wheel)
    if extracted.is_file() and extracted.read_text().strip() == extraction and (out / "stand-ins").is_dir():
        # Only the harness (or the compile step) changed: recompile against the tree already extracted.
        for stale in (marker, failed, out / "ms_pool_oracle"):
            stale.unlink(missing_ok=True)
        try:
            _compile(out / "wheel", out / "stand-ins", out / "ms_pool_oracle", _linked(_extracted_libs(out / "wheel")))
            _smoke(out / "ms_pool_oracle")
        except BuildError as error:
            failed.write_text(f"{digest}\n{error}\n")
            return "failed", str(error)
        marker.write_text(digest + "\n")
        return "recompiled", str(out / "ms_pool_oracle")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    try:
        libs, missing = _extract(_wheel(version, fetch=True), out / "wheel")
        stubs = _stand_ins(libs, missing, out / "stand-ins")
        extracted.write_text(extraction + "\n")
        _compile(out / "wheel", out / "stand-ins", out / "ms_pool_oracle", _linked(libs))
        _smoke(out / "ms_pool_oracle")
    except BuildError as error:
        failed.write_text(f"{digest}\n{error}\n")
        return "failed", str(error)
    marker.write_text(digest + "\n")
    return "built", f"{out / 'ms_pool_oracle'} ({len(libs)} libraries, {len(missing)} empty sonames, {stubs} stubs)"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--path"]:
        path = oracle_path(argv[1]) if len(argv) > 1 else None
        if path is None:
            return 1
        print(path)
        return 0
    for tool in ("g++", "gcc", "readelf", "nm"):
        if shutil.which(tool) is None:
            print(f"mindspore oracle: {tool} not found (Debian: apt-get install -y g++ binutils)", file=sys.stderr)
            return 1
    versions = argv or list(RELEASES)
    unknown = [v for v in versions if v not in RELEASES]
    if unknown:
        print(f"mindspore oracle: unknown release {', '.join(unknown)} (known: {', '.join(RELEASES)})", file=sys.stderr)
        return 2
    start = time.monotonic()
    built = 0
    for version in versions:
        t0 = time.monotonic()
        try:
            state, detail = build(version)
        except BuildError as error:
            state, detail = "failed", str(error)
        built += state != "failed"
        print(f"mindspore oracle {version}: {state} in {time.monotonic() - t0:.1f} s: {detail}", flush=True)
    print(f"mindspore oracles: {built}/{len(versions)} ready in {time.monotonic() - start:.1f} s")
    return 0 if built else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
