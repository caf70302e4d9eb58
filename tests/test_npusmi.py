"""npu-smi parsers on the recorded fixtures (exact values) and on the other layouts ASCEND.md describes."""
from pathlib import Path

import pytest

from workbench.platform.npusmi import NpuSmiFormatError, parse_info, parse_usages

# recorded on real hosts (tests/fixtures/npu-smi/README.md)
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "npu-smi"

WIDE_DUAL_DIE = """\
+--------------------------------------------------------------------------------------------------------+
| npu-smi 26.0.0                           Version: 26.0.0                                               |
+-------------------------------+-----------------+------------------------------------------------------+
| NPU     Name                  | Health          | Power(W)     Temp(C)           Hugepages-Usage(page) |
| Chip    Phy-ID                | Bus-Id          | AICore(%)    Memory-Usage(MB)  HBM-Usage(MB)         |
+===============================+=================+======================================================+
| 0       Ascend910             | OK              | 172.4        41                0    / 0              |
| 0       0                     | 0000:C1:00.0    | 37           0    / 0          31877/ 65536          |
+-------------------------------+-----------------+------------------------------------------------------+
| 0       Ascend910             | OK              | -            40                0    / 0              |
| 1       1                     | 0000:C2:00.0    | 0            0    / 0          2871 / 65536          |
+===============================+=================+======================================================+
+-------------------------------+-----------------+------------------------------------------------------+
| NPU     Chip                  | Process id      | Process name             | Process memory(MB)        |
+===============================+=================+======================================================+
| No running processes found in NPU 0                                                                    |
+===============================+=================+======================================================+
"""


def test_narrow_910b2c_fixture_values():
    chips = parse_info((FIXTURES / "info-910b2c-narrow.txt").read_text())
    assert [(c.npu, c.chip, c.name, c.health) for c in chips] == [(0, 0, "910B2C", "OK"), (1, 0, "910B2C", "OK")]
    assert [c.power_w for c in chips] == [94.2, 99.0] and [c.temp_c for c in chips] == [43, 45]
    assert [(c.hbm_used_mb, c.hbm_total_mb) for c in chips] == [(3455, 65536), (3434, 65536)]
    assert [c.bus_id for c in chips] == ["0000:5A:00.0", "0000:19:00.0"]
    assert chips[0].aicore_pct == 0 and round(chips[0].hbm_pct, 2) == 5.27


def test_narrow_910b4_fixture_values():
    chips = parse_info((FIXTURES / "info-910b4-narrow.txt").read_text())
    assert [(c.npu, c.name, c.power_w, c.temp_c, c.hbm_used_mb) for c in chips] == [
        (0, "910B4-1", 91.3, 33, 3197), (1, "910B4-1", 88.1, 32, 3197)]


def test_usages_fixture_values():
    (chip,) = parse_usages((FIXTURES / "usages-chip0.txt").read_text())
    assert chip["npu_id"] == 0 and chip["chip_id"] == 0
    assert chip["hbm_capacity_mb"] == 65536 and chip["hbm_usage_pct"] == 5
    assert chip["aicore_pct"] == 0 and chip["npu_util_pct"] == 0 and chip["ctrlcpu_pct"] == 6


def test_wide_dual_die_with_process_table():
    chips = parse_info(WIDE_DUAL_DIE)
    assert [(c.npu, c.chip, c.phy_id) for c in chips] == [(0, 0, 0), (0, 1, 1)]
    assert chips[0].power_w == 172.4 and chips[1].power_w is None  # '-' on the second die
    assert chips[0].hbm_used_mb == 31877 and chips[0].aicore_pct == 37  # five digits glued to the slash


def test_two_usage_blocks():
    text = "\n".join(["NPU ID : 3", "Chip Count : 2", "HBM Capacity(MB) : 65536", "HBM Usage Rate(%) : 48",
                      "NPU Utilization(%) : 77", "Chip ID : 0", "", "HBM Capacity(MB) : 65536",
                      "HBM Usage Rate(%) : 4", "NPU Utilization(%) : 0", "Chip ID : 1"])
    blocks = parse_usages(text)
    assert [(b["npu_id"], b["chip_id"], b["hbm_usage_pct"], b["npu_util_pct"]) for b in blocks] == [
        (3, 0, 48, 77), (3, 1, 4, 0)]


@pytest.mark.parametrize("text,pattern", [
    ("hello world", "banner"),
    ("npu-smi 25.0\n| NPU Name | Health | Power |\n", "header row"),
    (WIDE_DUAL_DIE.replace("172.4        41", "hot          41"), "cannot read NPU"),
    (WIDE_DUAL_DIE.replace("31877/ 65536", "lots / 65536"), "cannot read chip"),
])
def test_unknown_formats_fail_loudly(text, pattern):
    with pytest.raises(NpuSmiFormatError, match=pattern):
        parse_info(text)


def test_unknown_usage_format_fails_loudly():
    with pytest.raises(NpuSmiFormatError, match="Chip ID"):
        parse_usages("NPU ID : 0\nHBM Usage Rate(%) : 4\n")
    with pytest.raises(NpuSmiFormatError, match="not a number"):
        parse_usages("NPU ID : 0\nHBM Usage Rate(%) : high\nChip ID : 0\n")
