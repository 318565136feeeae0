"""npu-smi: the parser on realistic output of several chips and drivers, and the command's failures."""

from __future__ import annotations

import os
import signal
import stat
import sys
import time

import pytest

from kvguard.sources import SourceError, SourceUnavailable
from kvguard.sources.npu_smi import MAX_OUTPUT_BYTES, NpuSmiSource, device_memory_from_npu_smi, parse_npu_smi_info

MIB = 1 << 20


def read(data_path, name):
    with open(data_path("npu-smi", name)) as handle:
        return handle.read()


def records(data_path, name):
    return device_memory_from_npu_smi(parse_npu_smi_info(read(data_path, name)))


def test_910b3_driver_24_eight_npus_with_vllm_workers(data_path):
    devices = records(data_path, "910b3-24.1.rc1-vllm-tp8.txt")
    assert [d.device for d in devices] == [f"npu:{i}" for i in range(8)]
    first = devices[0]
    assert (first.used_bytes, first.total_bytes, first.free_bytes) == (62581 * MIB, 65536 * MIB, 2955 * MIB)
    assert [(p.pid, p.used_bytes, p.name) for p in first.processes] == [(1480213, 59268 * MIB, "VLLMWorker_TP")]


def test_driver_version_is_read(data_path):
    assert parse_npu_smi_info(read(data_path, "910b4-23.0.6-idle.txt")).version == "23.0.6"
    assert parse_npu_smi_info(read(data_path, "310p3-23.0.rc3-duo.txt")).version == "23.0.rc3"


def test_910b4_driver_23_idle_has_no_processes(data_path):
    devices = records(data_path, "910b4-23.0.6-idle.txt")
    assert [(d.device, d.used_bytes // MIB, d.total_bytes // MIB) for d in devices] == [
        ("npu:0", 2828, 32768),
        ("npu:1", 2831, 32768),
        ("npu:2", 2834, 32768),
        ("npu:3", 2837, 32768),
    ]
    assert all(d.processes == () for d in devices)


def test_hbm_printed_without_space_before_slash_is_read(data_path):
    # "56017/ 65536": five-digit HBM usage leaves no room for the space.
    devices = records(data_path, "910b1-23.0.rc3-multi-process.txt")
    assert devices[0].used_bytes == 56017 * MIB


def test_several_processes_on_one_npu_are_all_kept(data_path):
    devices = records(data_path, "910b1-23.0.rc3-multi-process.txt")
    assert [(p.pid, p.used_bytes // MIB) for p in devices[0].processes] == [
        (3755936, 114),
        (3755939, 114),
        (3755935, 52245),
    ]
    assert [(p.pid, p.used_bytes // MIB) for p in devices[1].processes] == [(3755936, 51829)]


def test_health_other_than_ok_does_not_drop_the_chip(data_path):
    info = parse_npu_smi_info(read(data_path, "910b1-23.0.rc3-multi-process.txt"))
    assert [c.health for c in info.chips] == ["OK", "Warning"]


def test_310p_duo_chips_are_labelled_by_logical_device(data_path):
    devices = records(data_path, "310p3-23.0.rc3-duo.txt")
    assert [d.device for d in devices] == ["npu:0", "npu:1", "npu:2", "npu:3"]
    assert (devices[1].used_bytes // MIB, devices[1].total_bytes // MIB) == (41502, 43693)
    assert [p.pid for p in devices[1].processes] == [27115]


def test_310p_without_hbm_reports_its_ddr(data_path):
    info = parse_npu_smi_info(read(data_path, "310p3-24.1.rc2-pro.txt"))
    chip = info.chips[0]
    assert (chip.hbm_total_mib, chip.memory_used_mib, chip.memory_total_mib) == (None, 1074, 21534)
    assert device_memory_from_npu_smi(info)[0].total_bytes == 21534 * MIB


def test_dual_die_npus_are_labelled_npu_and_chip(data_path):
    devices = records(data_path, "ascend910-a3-25.2.0-dual-die.txt")
    assert [d.device for d in devices] == ["npu:0.0", "npu:0.1", "npu:1.0", "npu:1.1"]
    assert [p.pid for p in devices[3].processes] == [990711]
    assert devices[1].processes == ()


def test_process_table_with_container_pid_column_is_read_by_header():
    # npu-smi 26.0 adds "Process id in container"; columns are found by their header.
    text = """\
| npu-smi 26.0.rc1                            Version: 26.0.rc1                                                    |
| NPU   Name                | Health        | Power(W)             Temp(C)                 Hugepages-Usage(page)   |
| Chip                      | Bus-Id        | AICore(%)            Memory-Usage(MB)        HBM-Usage(MB)           |
| 0     910B4               | OK            | 82.6                 32                      0    / 0                |
| 0                         | 0000:C1:00.0  | 0                    0    / 0                30871 / 32768           |
| NPU     Chip              | Process id    | Process name       | Process memory(MB)    | Process id in container |
| 0       0                 | 2210934       | python3            | 27904                 | 412                     |
"""
    [device] = device_memory_from_npu_smi(parse_npu_smi_info(text))
    assert device.used_bytes == 30871 * MIB
    assert [(p.pid, p.used_bytes // MIB, p.name) for p in device.processes] == [(2210934, 27904, "python3")]


def test_dcmi_error_output_has_no_devices(data_path):
    assert records(data_path, "dcmi-error-23.0.rc3.txt") == []


def test_garbage_never_raises():
    garbage = "\x00\xff|||| 0 | | \n| NPU Name |\n| Chip | Bus-Id |\n| 0 | x | 12 / |\n|" + "|" * 5000 + "\n"
    info = parse_npu_smi_info(garbage + "\ufffd" * 100)
    assert info.chips == []


def test_truncated_output_keeps_the_chips_read_so_far(data_path):
    text = read(data_path, "910b3-24.1.rc1-vllm-tp8.txt")
    cut = text[: text.index("| 3     910B3")]
    assert len(records(data_path, "910b3-24.1.rc1-vllm-tp8.txt")) == 8
    assert [d.device for d in device_memory_from_npu_smi(parse_npu_smi_info(cut))] == ["npu:0", "npu:1", "npu:2"]


# ---------------------------------------------------------------- running the command


def fake_npu_smi(tmp_path, body: str) -> str:
    path = tmp_path / "npu-smi"
    path.write_text(f"#!{sys.executable}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_source_runs_npu_smi_info_and_parses_it(tmp_path, data_path):
    fixture = data_path("npu-smi", "910b4-23.0.6-idle.txt")
    binary = fake_npu_smi(
        tmp_path, f"import sys\nassert sys.argv[1:] == ['info'], sys.argv\nsys.stdout.write(open({fixture!r}).read())"
    )
    devices = NpuSmiSource(binary=binary).sample()
    assert [d.device for d in devices] == ["npu:0", "npu:1", "npu:2", "npu:3"]
    assert devices[0].source == "npu-smi"


def test_missing_binary_is_unavailable(tmp_path):
    with pytest.raises(SourceUnavailable, match="not found"):
        NpuSmiSource(binary=str(tmp_path / "npu-smi")).sample()


def test_nonzero_exit_is_a_one_line_error(tmp_path):
    binary = fake_npu_smi(
        tmp_path,
        "import sys\nsys.stderr.write('dcmi model initialized failed, because the "
        "device is used. ret is -8020\\nmore\\n')\nsys.exit(255)",
    )
    with pytest.raises(SourceError) as info:
        NpuSmiSource(binary=binary).sample()
    assert str(info.value) == (
        "npu-smi info exited with 255: dcmi model initialized failed, because the device is used. ret is -8020"
    )


def test_output_without_a_table_is_an_error(tmp_path):
    binary = fake_npu_smi(tmp_path, "print('Permission denied. Please run as root or HwHiAiUser.')")
    with pytest.raises(SourceError, match="printed no device table: Permission denied"):
        NpuSmiSource(binary=binary).sample()


def test_a_hanging_npu_smi_is_killed_at_the_timeout(tmp_path):
    binary = fake_npu_smi(tmp_path, "import time\ntime.sleep(600)")
    with pytest.raises(SourceError, match=r"npu-smi info did not answer within 0.2s"):
        NpuSmiSource(binary=binary, timeout=0.2).sample()


def test_binary_that_cannot_execute_is_unavailable(tmp_path):
    path = tmp_path / "npu-smi"
    path.write_bytes(b"\x7fELF garbage")
    path.chmod(0o755)
    with pytest.raises(SourceUnavailable, match="cannot run"):
        NpuSmiSource(binary=str(path)).sample()


def test_an_npu_smi_that_prints_past_the_cap_is_killed_there(tmp_path):
    # Four times the cap of table rows, then it keeps the pipe open: the source stops reading at
    # MAX_OUTPUT_BYTES and kills it instead of buffering until the deadline (the reviewer's endless
    # fake reached 10.7 GB in a 10 s timeout).
    binary = fake_npu_smi(
        tmp_path,
        "import sys, time\nrow = '| 0 910B | OK | 1 / 2 |\\n' * 4096\n"
        f"for _ in range({4 * MAX_OUTPUT_BYTES} // len(row) + 1):\n"
        "    sys.stdout.write(row)\n"
        "sys.stdout.flush()\ntime.sleep(600)",
    )
    with pytest.raises(SourceError) as info:
        NpuSmiSource(binary=binary, timeout=5).sample()
    assert str(info.value) == f"npu-smi info printed more than {MAX_OUTPUT_BYTES} bytes"


def _process_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_a_child_that_keeps_the_pipe_open_is_killed_with_npu_smi(tmp_path):
    # npu-smi exits but leaves a child holding its stdout: the deadline still ends the read, and the
    # whole process group, the child too, is killed rather than left running.
    pidfile = tmp_path / "child.pid"
    binary = fake_npu_smi(
        tmp_path,
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n",
    )
    with pytest.raises(SourceError, match="did not answer within 0.5s"):
        NpuSmiSource(binary=binary, timeout=0.5).sample()
    child = int(pidfile.read_text())
    try:
        for _ in range(1000):  # SIGKILL is delivered at once; wait for the kernel to finish it off
            if _process_state(child) in ("Z", "X", "gone"):
                break
            time.sleep(0.01)
        assert _process_state(child) in ("Z", "X", "gone")
    finally:
        if _process_state(child) not in ("Z", "X", "gone"):
            os.kill(child, signal.SIGKILL)


def test_large_stderr_does_not_block_and_only_its_first_line_is_reported(tmp_path):
    binary = fake_npu_smi(tmp_path, "import sys\nsys.stderr.write('dcmi failed\\n' + 'x' * (4 << 20))\nsys.exit(3)")
    with pytest.raises(SourceError) as info:
        NpuSmiSource(binary=binary, timeout=600).sample()
    assert str(info.value) == "npu-smi info exited with 3: dcmi failed"
