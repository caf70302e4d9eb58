"""Parsers for Ascend's `npu-smi` output, shared by the environment check and the device monitor.

    npu-smi info              -> parse_info(text)    -> [NpuChip(npu=0, chip=0, name="910B2C", health="OK", ...)]
    npu-smi info -t usages -i N -> parse_usages(text) -> [{"npu_id": 0, "chip_id": 0, "hbm_usage_pct": 5.0, ...}]

They survive the formats seen in the field (recorded in tests/fixtures/npu-smi/): narrow (25.x) and wide (26.x) tables, a `Chip` or `Chip  Phy-ID` second header, two chips
per NPU with Power shown as `-` on the second, five-digit values that lose their separating space
(`31877/ 65536`), names such as 910B2C, 910B4-1, Ascend910, and a process table after the devices. What they do
not understand raises NpuSmiFormatError naming the line: never silent zeros.

    python -m workbench.platform.npusmi FILE
"""
from __future__ import annotations

import re
import sys
from dataclasses import asdict, dataclass

_ROW1_METRICS = re.compile(r"^(?P<power>\d+(?:\.\d+)?|-)\s+(?P<temp>\d+|-)\s+(?P<hp_used>\d+)\s*/\s*(?P<hp_total>\d+)$")
_ROW2_METRICS = re.compile(r"^(?P<aicore>\d+(?:\.\d+)?|-)\s+(?P<mem_used>\d+)\s*/\s*(?P<mem_total>\d+)\s+"
                           r"(?P<hbm_used>\d+)\s*/\s*(?P<hbm_total>\d+)$")


class NpuSmiFormatError(ValueError):
    """npu-smi printed something the parser does not understand."""


@dataclass
class NpuChip:
    npu: int
    chip: int
    name: str
    health: str
    power_w: float | None  # None where npu-smi prints '-' (the second die of a dual-die board)
    temp_c: float | None
    aicore_pct: float | None
    memory_used_mb: int
    memory_total_mb: int
    hbm_used_mb: int
    hbm_total_mb: int
    bus_id: str
    phy_id: int | None = None

    @property
    def hbm_pct(self) -> float:
        return 100.0 * self.hbm_used_mb / self.hbm_total_mb if self.hbm_total_mb else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hbm_pct": self.hbm_pct}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _num(text: str) -> float | None:
    return None if text == "-" else float(text)


def parse_info(text: str) -> list[NpuChip]:
    """Every chip of an `npu-smi info` table, in order."""
    lines = text.splitlines()
    if not any("npu-smi" in line for line in lines[:5]):
        raise NpuSmiFormatError("no 'npu-smi <version>' banner in the first lines: is this `npu-smi info` output?")
    header2 = next((i for i, line in enumerate(lines) if re.match(r"^\|\s*Chip\b", line)), None)
    if header2 is None or "Bus-Id" not in lines[header2] or "HBM-Usage" not in lines[header2]:
        raise NpuSmiFormatError("no 'Chip | Bus-Id | ... HBM-Usage' header row: unknown npu-smi table layout")
    has_phy_id = "Phy-ID" in lines[header2]
    chips: list[NpuChip] = []
    pending: tuple[int, list[str]] | None = None
    for number, line in enumerate(lines[header2 + 1:], start=header2 + 2):
        stripped = line.strip()
        if not stripped or stripped.startswith("+"):
            if pending is not None and stripped.startswith("+"):
                raise NpuSmiFormatError(f"line {pending[0]}: an NPU row without its chip row")
            continue
        if re.search(r"Process id|Process name|No running processes", stripped):
            break  # the process table follows the devices
        if not stripped.startswith("|"):
            raise NpuSmiFormatError(f"line {number}: not a table row: {stripped[:80]!r}")
        cells = _cells(line)
        if len(cells) != 3:
            raise NpuSmiFormatError(f"line {number}: expected 3 columns, found {len(cells)}: {stripped[:80]!r}")
        if pending is None:
            pending = (number, cells)
            continue
        first_number, first = pending
        pending = None
        head = first[0].split()
        m1 = _ROW1_METRICS.match(re.sub(r"\s+", " ", first[2]))
        if len(head) < 2 or not head[0].isdigit() or not m1 or not first[1]:
            raise NpuSmiFormatError(f"line {first_number}: cannot read NPU, name, health, power, temp from {first!r}")
        chip_cell = cells[0].split()
        m2 = _ROW2_METRICS.match(re.sub(r"\s+", " ", cells[2]))
        if not chip_cell or not chip_cell[0].isdigit() or not m2:
            raise NpuSmiFormatError(f"line {number}: cannot read chip, AICore, memory and HBM from {cells!r}")
        phy = int(chip_cell[1]) if has_phy_id and len(chip_cell) > 1 and chip_cell[1].isdigit() else None
        chips.append(NpuChip(
            npu=int(head[0]), chip=int(chip_cell[0]), name=" ".join(head[1:]), health=first[1],
            power_w=_num(m1["power"]), temp_c=_num(m1["temp"]), aicore_pct=_num(m2["aicore"]),
            memory_used_mb=int(m2["mem_used"]), memory_total_mb=int(m2["mem_total"]),
            hbm_used_mb=int(m2["hbm_used"]), hbm_total_mb=int(m2["hbm_total"]), bus_id=cells[1], phy_id=phy))
    if pending is not None:
        raise NpuSmiFormatError(f"line {pending[0]}: an NPU row without its chip row")
    if not chips:
        raise NpuSmiFormatError("the table lists no devices")
    return chips


_USAGE_KEYS = {
    "NPU ID": "npu_id", "Chip ID": "chip_id", "Chip Count": "chip_count",
    "HBM Capacity(MB)": "hbm_capacity_mb", "HBM Usage Rate(%)": "hbm_usage_pct",
    "Aicore Usage Rate(%)": "aicore_pct", "Aivector Usage Rate(%)": "aivector_pct", "Aicpu Usage Rate(%)": "aicpu_pct",
    "Ctrlcpu Usage Rate(%)": "ctrlcpu_pct", "NPU Utilization(%)": "npu_util_pct",
    "HBM Bandwidth Usage Rate(%)": "hbm_bandwidth_pct", "DDR Capacity(MB)": "ddr_capacity_mb",
    "DDR Usage Rate(%)": "ddr_usage_pct", "Aicube Usage Rate(%)": "aicube_pct",
}


def parse_usages(text: str) -> list[dict]:
    """`npu-smi info -t usages -i N`: one dict per chip (blocks end with 'Chip ID')."""
    blocks: list[dict] = []
    current: dict = {}
    npu_id = None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if ":" not in line:
            raise NpuSmiFormatError(f"line {number}: expected 'Key : value', got {line.strip()[:80]!r}")
        key, _, value = (part.strip() for part in line.partition(":"))
        name = _USAGE_KEYS.get(key)
        if name is None:
            continue  # npu-smi adds counters between releases; the known ones are enough
        try:
            number_value = float(value) if "." in value else int(value)
        except ValueError:
            if value in ("NA", "-"):
                number_value = None
            else:
                raise NpuSmiFormatError(f"line {number}: {key} is {value!r}, not a number") from None
        if name == "npu_id":
            npu_id = number_value
        current[name] = number_value
        if name == "chip_id":
            current.setdefault("npu_id", npu_id)
            blocks.append(current)
            current = {}
    if not blocks:
        raise NpuSmiFormatError("no 'Chip ID' line: not `npu-smi info -t usages` output")
    for block in blocks:
        if "hbm_usage_pct" not in block and "npu_util_pct" not in block:
            raise NpuSmiFormatError(f"chip {block.get('chip_id')}: neither HBM usage nor NPU utilization reported")
    return blocks


if __name__ == "__main__":
    text = open(sys.argv[1]).read()
    parsed = parse_usages(text) if "Chip ID" in text and "|" not in text else [c.to_dict() for c in parse_info(text)]
    for item in parsed:
        print(item)
