"""The one cache root every setup script shares: the allocator oracles (tests/upstream/oracles/*/build.py) and the
real-upstream test environments (tests/upstream/vllm_real/envs.py, tests/upstream/ascend_real/envs.py).

Standard library only: these scripts run before the virtualenv exists (``./dev.sh test``).
``KVGUARD_CACHE`` overrides it; otherwise ``${XDG_CACHE_HOME:-~/.cache}/kvguard``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import pathlib
import shutil
import stat


def cache_root() -> pathlib.Path:
    if os.environ.get("KVGUARD_CACHE"):
        return pathlib.Path(os.environ["KVGUARD_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(xdg) / "kvguard"


# ----------------------------------------------------------------------------------------------- disk
# A wheel that has been unpacked into its environment or oracle is retired: its bytes are dropped, its name
# and size stay in the folder's ledger, so the markers that digest them still match and a second run
# neither downloads nor rebuilds. A build that needs the file again downloads it again.
RETIRED = "retired-wheels.txt"
# Retired when at least this large (vLLM's and MindSpore's wheels, 0.2-0.8 GB each); the small dependency
# wheels stay, so an environment's rebuild needs no index for them.
RETIRE_FROM_BYTES = 16 << 20


def _retired(folder: pathlib.Path) -> dict[str, int]:
    ledger = folder / RETIRED
    if not ledger.is_file():
        return {}
    out = {}
    for line in ledger.read_text().splitlines():
        name, _, size = line.rpartition(" ")
        if name and size.isdigit():
            out[name] = int(size)
    return out


def find_wheel(folder: pathlib.Path, pattern: str) -> pathlib.Path | None:
    """The newest wheel matching ``pattern`` in ``folder``, present or retired (then the path does not exist)."""
    found = sorted(folder.glob(pattern))
    if found:
        return found[-1]
    names = sorted(name for name in _retired(folder) if fnmatch.fnmatch(name, pattern))
    return folder / names[-1] if names else None


def wheel_size(path: pathlib.Path) -> int:
    """A wheel's size, from the file or, once retired, from the ledger."""
    return path.stat().st_size if path.exists() else _retired(path.parent)[path.name]


def retire_wheels(folder: pathlib.Path, min_bytes: int = RETIRE_FROM_BYTES) -> int:
    """Drop the large wheels in ``folder`` (their names and sizes kept in its ledger); bytes freed."""
    if not folder.is_dir():
        return 0
    ledger = _retired(folder)
    freed = 0
    for path in sorted(folder.glob("*.whl")):
        size = path.stat().st_size
        if size >= min_bytes:
            ledger[path.name] = size
            (folder / RETIRED).write_text("".join(f"{name} {n}\n" for name, n in sorted(ledger.items())))
            path.unlink()
            freed += size
    return freed


def link_duplicates(roots: list[pathlib.Path]) -> int:
    """Hard-link the files under ``roots`` that are byte for byte the same (same size, mode and SHA-256) to
    one copy; how many paths were linked. The environments hold many of the same packages (numpy,
    transformers, torch in kvguard's venv and the base env, ...) at the same versions. Nothing writes into
    an installed file (pip replaces files; an import writes new __pycache__ files), so the copies never
    diverge. Only files on the first root's device are linked."""
    groups: dict[tuple[int, int], list[pathlib.Path]] = {}
    device = None
    for root in roots:
        if not root.is_dir():
            continue
        device = root.stat().st_dev if device is None else device
        for folder, _, names in os.walk(root):
            for name in names:
                path = pathlib.Path(folder) / name
                try:
                    st = path.lstat()
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_size >= 4096 and st.st_dev == device:
                    groups.setdefault((st.st_size, st.st_mode), []).append(path)
    linked = 0
    for paths in groups.values():
        if len(paths) < 2:
            continue
        keep_for: dict[str, pathlib.Path] = {}
        digest_of: dict[int, str] = {}
        for path in paths:
            inode = path.stat().st_ino
            if inode not in digest_of:
                digest_of[inode] = _sha256(path)
            keep = keep_for.setdefault(digest_of[inode], path)
            if keep.stat().st_ino == inode:
                continue
            spare = path.with_name(path.name + ".kvguard-link")
            try:
                os.link(keep, spare)
                os.replace(spare, path)
            except OSError:
                spare.unlink(missing_ok=True)
                continue
            linked += 1
    return linked


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def disk_usage(roots: list[pathlib.Path]) -> tuple[int, list[int]]:
    """Bytes on disk under ``roots`` in all and under each root, in one walk; a hard-linked file counted once
    in each figure (as du counts)."""
    seen: set[tuple[int, int]] = set()
    total, per_root = 0, []
    for root in roots:
        own: set[tuple[int, int]] = set()
        size = 0
        for folder, _, names in os.walk(root):
            for name in names:
                try:
                    st = os.lstat(os.path.join(folder, name))
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                if key not in own:
                    own.add(key)
                    size += st.st_blocks * 512
                    if key not in seen:
                        seen.add(key)
                        total += st.st_blocks * 512
        per_root.append(size)
    return total, per_root


def disk_bytes(roots: list[pathlib.Path]) -> int:
    """Bytes on disk under ``roots``, each hard-linked file counted once (as du counts)."""
    return disk_usage(roots)[0]


# The environments' folders: their bytecode is dropped once after each build (pip compiles every module; the
# tests import a fraction, and Python writes those back on first import).
ENV_FOLDERS = ("vllm-envs", "ascend-envs", "mindspore-envs")
STAMP = "slim-stamp"


def _identities(root: pathlib.Path, venv: pathlib.Path | None) -> dict[str, str]:
    """What each environment and oracle is: its folder (a rebuild makes a new one); and the venv's
    site-packages folder (an install changes it)."""
    out = {}
    for kind in (*ENV_FOLDERS, "oracles"):
        folder = root / kind
        for child in sorted(folder.iterdir()) if folder.is_dir() else ():
            st = child.stat()
            out[f"{kind}/{child.name}"] = f"{st.st_ino} {st.st_mtime_ns}"
    if venv is not None:
        for site in sorted(venv.glob("lib/python*/site-packages")):
            st = site.stat()
            out[f"venv {site.resolve()}"] = f"{st.st_ino} {st.st_mtime_ns}"
    return out


def drop_bytecode(folders: list[pathlib.Path]) -> int:
    """Remove the __pycache__ folders under ``folders``; bytes freed (hard links counted once)."""
    caches = [
        pathlib.Path(d) / "__pycache__"
        for folder in folders
        if folder.is_dir()
        for d, subdirs, _ in os.walk(folder)
        if "__pycache__" in subdirs
    ]
    freed = disk_bytes(caches)
    for cache in caches:
        shutil.rmtree(cache, ignore_errors=True)
    return freed


def slim(venv: pathlib.Path | None) -> str:
    """Retire the unpacked wheels; drop the bytecode of the environments built since the last pass, and, when
    anything changed (a build, another venv), hard-link duplicate files over the cache and kvguard's venv.
    One line. A second run with nothing changed only retires wheels."""
    root = cache_root()
    roots = [root] + ([venv] if venv is not None else [])
    freed = retire_wheels(root / "wheels")
    stamp = root / STAMP
    try:
        before = json.loads(stamp.read_text()) if stamp.is_file() else {}
    except ValueError:
        before = {}
    now = _identities(root, venv)
    if now == before:
        done = "nothing rebuilt since the last pass"
    else:
        # Bytecode only in the environments built since the last pass (a new clone's venv rebuilds nothing).
        built = [
            root / name
            for name, ident in now.items()
            if name.split("/")[0] in ENV_FOLDERS and before.get(name) != ident
        ]
        dropped = drop_bytecode(built)
        linked = link_duplicates(roots)
        stamp.write_text(json.dumps(_identities(root, venv)))
        done = f"dropped {dropped / 1e9:.1f} GB of bytecode, linked {linked} duplicate files"
    total, per_root = disk_usage(roots)
    sizes = ", ".join(f"{path} {size / 1e9:.1f} GB" for path, size in zip(roots, per_root))
    return (
        f"retired {freed / 1e9:.1f} GB of unpacked wheels; {done}; on disk: "
        f"{total / 1e9:.1f} GB in all ({sizes}; a file linked in both counted once)"
    )


if __name__ == "__main__":
    import sys

    if len(sys.argv) in (2, 3) and sys.argv[1] == "slim":
        print(slim(pathlib.Path(sys.argv[2]) if len(sys.argv) == 3 else None), flush=True)
        sys.exit(0)
    print("usage: python3 tests/upstream/oracles/cache.py slim [VENV]", file=sys.stderr)
    sys.exit(2)
