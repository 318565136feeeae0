"""Ascend devices through ``npu-smi info``: HBM (or DDR) usage per chip and the process table.

Device level only, like NVML: the driver sees what each process holds, never the
allocator's split. The command runs with a fixed argv (``npu-smi info``), no shell, no
stdin, one deadline for the whole run and a cap on what it may print (a runaway npu-smi
is killed, not buffered). The parser (:func:`parse_npu_smi_info`) is pure and reads the box
tables of driver 23.x to 25.x, for single-chip NPUs (910B, 910B4) and for cards with
several chips (300I Duo: a ``Chip Device`` column; 910 A3: one row per die):

    | NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
    | Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
    | 0     910B3               | OK            | 93.1        40                0    / 0             |
    | 0                         | 0000:C1:00.0  | 0           0    / 0          3318 / 65536         |
    | NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
    | 0       0                 | 209314        | python3                  | 52245                   |

"MB" in npu-smi is MiB. Chips with HBM report HBM-Usage; 310P chips have none and
report their DDR in Memory-Usage.

Device labels: ``npu:<logical id>`` where the table has a ``Device`` column (310P), else
``npu:<NPU id>`` when every NPU has one chip, else ``npu:<NPU id>.<chip>``.

Identity (:func:`chip_identity`), what ``npu-smi info`` itself prints about a chip: its PCIe address
(the ``Bus-Id`` column, ``0000:C1:00.0``: the form npu-exporter's ``pcie_bus_info`` label takes,
``%04X:%02X:%02X.%X`` in its dcmi.go) becomes ``pci_bus_id``; ``device_uuid`` is
``npu-phy-<id>`` where the table has a ``Chip Phy-ID`` column (910 A3: npu-exporter's ``id`` label is
this physical id), ``npu-logic-<id>`` where it has a ``Device`` column (310P: the logical id), and
empty where it shows neither (910B: the table has no per-chip id beyond the NPU's own index). Ascend
chips have no UUID that npu-smi prints; the die id npu-exporter labels ``vdie_id`` comes from dcmi,
not from this table. On an Atlas 300I Duo the two chips of a card print the same Bus-Id.
"""

from __future__ import annotations

import os
import re
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

from kvguard.records import DeviceMemory, ProcessMemory
from kvguard.sources import SourceError, SourceUnavailable, free_total_used

MIB = 1 << 20
ARGV = ("info",)
MAX_OUTPUT_BYTES = 1 << 20
MAX_STDERR_BYTES = 64 << 10
_READ_CHUNK = 64 << 10
MAX_LINES = 20_000
# Where Ascend drivers install npu-smi when it is not on PATH (containers often lack it there).
_FALLBACK_PATHS = ("/usr/local/sbin/npu-smi", "/usr/local/bin/npu-smi", "/usr/local/Ascend/driver/tools/npu-smi")

_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")
_VERSION = re.compile(r"npu-smi\s+([0-9][0-9A-Za-z.\-]*)")
_BUS_ID = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]\Z")


@dataclass(frozen=True)
class NpuChip:
    npu: int
    chip: int
    name: str
    health: str
    logical_id: int | None = None  # the "Device" column of 310P tables
    physical_id: int | None = None  # the "Phy-ID" column of 910 A3 tables
    bus_id: str = ""  # the "Bus-Id" column
    memory_used_mib: int | None = None  # Memory-Usage(MB): DDR
    memory_total_mib: int | None = None
    hbm_used_mib: int | None = None  # HBM-Usage(MB)
    hbm_total_mib: int | None = None


@dataclass(frozen=True)
class NpuProcess:
    npu: int
    chip: int
    pid: int
    name: str
    memory_mib: int


@dataclass(frozen=True)
class NpuSmiInfo:
    version: str | None = None
    chips: list[NpuChip] = field(default_factory=list)
    processes: list[NpuProcess] = field(default_factory=list)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _is_int(token: str) -> bool:
    return token.isascii() and token.isdigit() and len(token) <= 12


def parse_npu_smi_info(text: str) -> NpuSmiInfo:
    """Parse ``npu-smi info``. Never raises: lines it cannot read are skipped."""
    version = None
    chips: list[NpuChip] = []
    processes: list[NpuProcess] = []
    mode = None  # "devices" or "processes"
    has_hbm: bool | None = None
    chip_column = None  # second word of the "Chip ..." header: "Device", "Phy-ID" or None
    npu_row: tuple[int, str, str] | None = None
    process_columns: dict[str, int] = {}

    for raw in text.splitlines()[:MAX_LINES]:
        line = raw.strip()
        if not line.startswith("|"):
            continue
        cells = _cells(line)
        first = cells[0]
        if version is None and (match := _VERSION.search(first)):
            version = match.group(1)
            continue
        words = first.split()
        if words[:1] == ["NPU"] and "Name" in words:
            mode, npu_row = "devices", None
            continue
        if words[:1] == ["NPU"] and "Chip" in words and any(cell.startswith("Process id") for cell in cells):
            mode = "processes"
            process_columns = {cell: index for index, cell in enumerate(cells)}
            continue
        if mode == "devices" and words[:1] == ["Chip"]:
            header = " ".join(cells)
            has_hbm = "HBM-Usage" in header
            chip_column = words[1] if len(words) > 1 else None
            continue
        if mode == "devices" and len(cells) >= 3 and words:
            if all(_is_int(word) for word in words):
                if npu_row is not None and len(words) <= 2:
                    chips.append(_chip(npu_row, words, cells[1], cells[2], has_hbm, chip_column))
            elif _is_int(words[0]) and len(words) >= 2:
                npu_row = (int(words[0]), " ".join(words[1:])[:64], cells[1][:32])
        elif mode == "processes" and len(cells) >= 4 and len(words) == 2 and all(_is_int(w) for w in words):
            proc = _process(words, cells, process_columns)
            if proc is not None:
                processes.append(proc)
    return NpuSmiInfo(version=version, chips=chips, processes=processes)


def _chip(
    npu_row: tuple[int, str, str],
    words: list[str],
    bus_id: str,
    usage: str,
    has_hbm: bool | None,
    chip_column: str | None,
) -> NpuChip:
    npu, name, health = npu_row
    pairs = [(int(used), int(total)) for used, total in _PAIR.findall(usage)]
    memory = hbm = None
    if has_hbm or (has_hbm is None and len(pairs) >= 2):
        hbm = pairs[-1] if pairs else None
        memory = pairs[0] if len(pairs) >= 2 else None
    elif pairs:
        memory = pairs[0]
    logical = int(words[1]) if chip_column == "Device" and len(words) == 2 else None
    physical = int(words[1]) if chip_column == "Phy-ID" and len(words) == 2 else None
    bus = bus_id if _BUS_ID.match(bus_id) else ""
    return NpuChip(
        npu=npu,
        chip=int(words[0]),
        name=name,
        health=health,
        logical_id=logical,
        physical_id=physical,
        bus_id=bus,
        memory_used_mib=memory[0] if memory else None,
        memory_total_mib=memory[1] if memory else None,
        hbm_used_mib=hbm[0] if hbm else None,
        hbm_total_mib=hbm[1] if hbm else None,
    )


def _process(words: list[str], cells: list[str], columns: dict[str, int]) -> NpuProcess | None:
    def cell(header: str, default: int) -> str:
        index = columns.get(header, default)
        return cells[index] if index < len(cells) else ""

    pid, name, memory = cell("Process id", 1), cell("Process name", 2), cell("Process memory(MB)", 3)
    if not _is_int(pid) or not _is_int(memory):
        return None
    return NpuProcess(npu=int(words[0]), chip=int(words[1]), pid=int(pid), name=name[:128], memory_mib=int(memory))


def device_memory_from_npu_smi(info: NpuSmiInfo) -> list[DeviceMemory]:
    """One record per chip: HBM where the chip has it, else its DDR."""
    chips_per_npu: dict[int, int] = {}
    for chip in info.chips:
        chips_per_npu[chip.npu] = chips_per_npu.get(chip.npu, 0) + 1
    single_chip = all(count == 1 for count in chips_per_npu.values())
    records = []
    for chip in info.chips:
        if chip.logical_id is not None:
            label = f"npu:{chip.logical_id}"
        elif single_chip:
            label = f"npu:{chip.npu}"
        else:
            label = f"npu:{chip.npu}.{chip.chip}"
        if chip.hbm_total_mib is not None:
            used, total = chip.hbm_used_mib, chip.hbm_total_mib
        else:
            used, total = chip.memory_used_mib, chip.memory_total_mib
        fields = free_total_used(
            None if used is None or total is None else (total - used) * MIB,
            None if total is None else total * MIB,
            None if used is None else used * MIB,
        )
        processes = tuple(
            ProcessMemory(pid=p.pid, used_bytes=p.memory_mib * MIB, name=p.name)
            for p in info.processes
            if (p.npu, p.chip) == (chip.npu, chip.chip)
        )
        uuid, pci_bus_id = chip_identity(chip)
        records.append(
            DeviceMemory(
                device=label, source="npu-smi", processes=processes, device_uuid=uuid, pci_bus_id=pci_bus_id, **fields
            )
        )
    return records


def chip_identity(chip: NpuChip) -> tuple[str, str]:
    """(device_uuid, pci_bus_id) from what the table prints about the chip (module docstring)."""
    if chip.physical_id is not None:
        uuid = f"npu-phy-{chip.physical_id}"
    elif chip.logical_id is not None:
        uuid = f"npu-logic-{chip.logical_id}"
    else:
        uuid = ""
    return uuid, chip.bus_id.upper()


class NpuSmiSource:
    """Runs ``npu-smi info`` (fixed argv, no shell) under a timeout and parses its tables."""

    name = "npu-smi"

    def __init__(self, binary: str = "npu-smi", timeout: float = 10.0):
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise SourceError(f"npu-smi timeout must be a positive number of seconds, got {timeout!r}")
        self._binary = binary
        self._timeout = float(timeout)

    @property
    def timeout_seconds(self) -> float:
        """The limit this source puts on one read itself; the sidecar's poller waits as long (not less)."""
        return self._timeout

    def _path(self) -> str:
        found = shutil.which(self._binary)
        if found:
            return found
        if os.path.basename(self._binary) == self._binary:
            for candidate in _FALLBACK_PATHS:
                if os.access(candidate, os.X_OK):
                    return candidate
        raise SourceUnavailable(f"{self._binary} not found (is the Ascend driver mounted into this container?)")

    def sample(self) -> list[DeviceMemory]:
        path = self._path()
        returncode, stdout_bytes, stderr_bytes = _run_bounded([path, *ARGV], self._timeout)
        stdout = stdout_bytes.decode("utf-8", "replace")
        if returncode != 0:
            raise SourceError(
                f"npu-smi info exited with {returncode}: "
                f"{_first_line(stderr_bytes.decode('utf-8', 'replace')) or _first_line(stdout)}"
            )
        records = device_memory_from_npu_smi(parse_npu_smi_info(stdout))
        if not records:
            raise SourceError(f"npu-smi info printed no device table: {_first_line(stdout) or 'no output'}")
        return records


def _run_bounded(argv: list[str], timeout: float) -> tuple[int, bytes, bytes]:
    """Run ``argv`` (no shell, no stdin) and read its output under one deadline and a size cap.

    stdout past :data:`MAX_OUTPUT_BYTES` or anything still running at the deadline kills the
    process group (npu-smi and anything it started) and is a :class:`SourceError`; stderr is
    drained but only its first :data:`MAX_STDERR_BYTES` are kept.
    """
    deadline = time.monotonic() + timeout
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
    except OSError as exc:
        raise SourceUnavailable(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
    stdout, stderr = bytearray(), bytearray()
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ, stdout)
            selector.register(proc.stderr, selectors.EVENT_READ, stderr)
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SourceError(f"npu-smi info did not answer within {timeout:g}s")
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, _READ_CHUNK)
                    if not chunk:
                        selector.unregister(key.fileobj)
                    elif key.data is stdout:
                        stdout += chunk
                        if len(stdout) > MAX_OUTPUT_BYTES:
                            raise SourceError(f"npu-smi info printed more than {MAX_OUTPUT_BYTES} bytes")
                    elif len(stderr) < MAX_STDERR_BYTES:
                        stderr += chunk[: MAX_STDERR_BYTES - len(stderr)]
        try:
            returncode = proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SourceError(f"npu-smi info did not answer within {timeout:g}s") from None
    except BaseException:
        _kill(proc)
        raise
    finally:
        proc.stdout.close()
        proc.stderr.close()
    return returncode, bytes(stdout), bytes(stderr)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        try:
            proc.kill()
        except OSError:
            pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _first_line(text: str) -> str:
    for line in text.splitlines():
        line = "".join(ch for ch in line.strip() if ch.isprintable())
        if line:
            return line[:200]
    return ""
