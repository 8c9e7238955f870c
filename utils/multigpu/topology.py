"""What connects the GPUs: `nvidia-smi topo -m`, `rocm-smi --showtopo` and `amd-smi topology` parsed, with peaks.

`parse(text)` recognises the tool by its output and returns a `Topology`: the GPUs, the label of the
link between every pair ("NV18", "XGMI", "PCIE", "PIX", ...) and what the tool adds (CPU and NUMA
affinity, hops, weights). `read()` runs whichever tool this machine has. The peak of a link comes from
the device table (`utils/data/gpu_specs.toml`: link count, GB/s per link and direction, switch or mesh).
Recorded outputs in `utils/data/topology/` show what the tools print on machines the course does not
have; `EXAMPLES` says where each comes from.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field

from utils import backend
from utils.base.paths import DATA_DIR
from utils.device import spec as spec_row

EXAMPLES_DIR = DATA_DIR / "topology"
EXAMPLES = {
    # name: (file, GPU spec key, where it comes from)
    "2x H200 (nvidia-smi)": ("nvidia-smi-2xh200.txt", "h200",
                             "nvidia-smi's format, written from the course's notes on its 2x H200 machine (NV18 between "
                             "the two GPUs); the CPU and NUMA columns are illustrative"),
    "8x MI300X (amd-smi)": ("amd-smi-8xmi300x.txt", "mi300x",
                            "written from AMD's public documentation (the `amd-smi topology` example of the AMD SMI "
                            "changelog, ROCm 6.1); no AMD machine was available to the course"),
    "8x MI300X (rocm-smi)": ("rocm-smi-8xmi300x.txt", "mi300x",
                             "written from AMD's public documentation (rocm-smi's --showtopo format as the rocm_smi_lib "
                             "project shows it, with the XGMI links, hops and weights of the amd-smi example); NUMA "
                             "values illustrative; no AMD machine was available to the course"),
}

# nvidia-smi's legend, shortened; rocm-smi and amd-smi name the link type itself.
MEANING = {
    "X": "the GPU itself",
    "NV": "NVLink: a bonded set of {n} links",
    "PIX": "PCIe through at most one PCIe bridge",
    "PXB": "PCIe through several bridges, not the CPU's host bridge",
    "PHB": "PCIe through the CPU's host bridge",
    "NODE": "PCIe and the link between host bridges of one NUMA node",
    "SYS": "PCIe and the CPU-to-CPU link between NUMA nodes (QPI/UPI/Infinity Fabric)",
    "SOC": "PCIe and the CPU-to-CPU link (older name of SYS)",
    "XGMI": "AMD Infinity Fabric (xGMI) link",
    "PCIE": "PCIe",
    "SELF": "the GPU itself",
}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_DEVICE = re.compile(r"^(GPU|NIC)\d+$")
_BDF = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-9a-fA-F]$")


class TopologyError(ValueError):
    """The text is not a topology output this module can read (the message says where it stopped)."""


@dataclass
class Topology:
    tool: str                                   # "nvidia-smi topo -m" | "rocm-smi --showtopo" | "amd-smi topology"
    gpus: list[str]                             # "GPU0", ... (amd-smi: PCI addresses)
    links: dict[tuple[int, int], str]           # (i, j), i != j -> the tool's label: "NV18", "XGMI", "PIX", ...
    nics: list[str] = field(default_factory=list)
    affinity: dict[int, dict[str, str]] = field(default_factory=dict)   # per GPU: CPU/NUMA affinity
    tables: dict[str, dict[tuple[int, int], str]] = field(default_factory=dict)   # hops, weight, ...
    raw: str = ""

    def label(self, i: int, j: int) -> str:
        return self.links[(i, j)]

    def pairs(self) -> list[tuple[int, int, str]]:
        return [(i, j, lab) for (i, j), lab in sorted(self.links.items()) if i < j]


def link_kind(label: str) -> tuple[str, int | None]:
    """("NVLink", 18) for "NV18"; ("xGMI", None) for "XGMI"; ("PCIe", None) for PIX/PXB/PHB/NODE/SYS/PCIE."""
    lab = label.strip().upper()
    m = re.fullmatch(r"NV(\d+)", lab)
    if m:
        return "NVLink", int(m.group(1))
    if lab == "XGMI":
        return "xGMI", None
    if lab in ("PIX", "PXB", "PHB", "NODE", "SYS", "SOC", "PCIE"):
        return "PCIe", None
    return "unknown", None


def meaning(label: str) -> str:
    kind, n = link_kind(label)
    if kind == "NVLink":
        return MEANING["NV"].format(n=n)
    return MEANING.get(label.strip().upper(), f"unknown link type {label!r}")


# --- parsers ---------------------------------------------------------------------------------------

def _clean(text: str) -> list[str]:
    return _ANSI.sub("", text).replace("\r", "").split("\n")


def parse_nvidia_smi(text: str) -> Topology:
    """`nvidia-smi topo -m` (tab-separated matrix of GPUs and NICs, then affinity columns, then a legend)."""
    lines = _clean(text)
    h, header = None, []
    for k, line in enumerate(lines):
        cells = [c.strip() for c in line.split("\t")]
        if "GPU0" in cells and "X" not in cells:        # the header; a row has X on its diagonal
            h, header = k, cells[1:] if cells[0] == "" else cells
            break
    if h is None:
        raise TopologyError("no header line with GPU0 (is this `nvidia-smi topo -m`?)")
    devices = [c for c in header if _DEVICE.match(c)]
    if not devices or devices != header[:len(devices)]:
        raise TopologyError(f"line {h + 1}: the header does not start with the device columns: {header}")
    extra_cols = header[len(devices):]
    rows: dict[str, list[str]] = {}
    for k, line in enumerate(lines[h + 1:], start=h + 2):
        if not line.strip():
            if rows:
                break
            continue
        cells = line.split("\t")
        name = cells[0].strip()
        if not _DEVICE.match(name):
            break
        if len(cells) < 1 + len(devices):
            raise TopologyError(f"line {k}: {name} has {len(cells) - 1} columns, the header {len(devices)} devices")
        rows[name] = [c.strip() for c in cells[1:]]
    gpus = [d for d in devices if d.startswith("GPU")]
    missing = [g for g in gpus if g not in rows]
    if missing:
        raise TopologyError(f"no row for {', '.join(missing)}")
    index = {d: i for i, d in enumerate(devices)}
    links, affinity = {}, {}
    for i, g in enumerate(gpus):
        row = rows[g]
        for j, other in enumerate(gpus):
            value = row[index[other]]
            if i == j:
                if value != "X":
                    raise TopologyError(f"{g} to itself is {value!r}, not X")
                continue
            if not value:
                raise TopologyError(f"{g} to {other}: empty cell")
            links[(i, j)] = value
        rest = row[len(devices):]
        while len(rest) > len(extra_cols) and "" in rest[1:]:   # nvidia-smi pads with an empty cell
            k = len(rest) - 1 - rest[::-1].index("")
            rest = rest[:k] + rest[k + 1:]
        affinity[i] = {col: (rest[n] if n < len(rest) else "") for n, col in enumerate(extra_cols)}
    nics = [d for d in devices if d.startswith("NIC")]
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", "\n".join(lines), flags=re.M))
    return Topology("nvidia-smi topo -m", gpus, links, nics=[f"{n} ({legend[n]})" if n in legend else n for n in nics],
                    affinity=affinity, raw=text)


def _matrix(lines: list[str], start: int, names_re) -> tuple[list[str], dict[str, list[str]], int]:
    """A whitespace-separated matrix: a header of column names, then one row per name."""
    k = start
    while k < len(lines) and not lines[k].strip():
        k += 1
    if k >= len(lines):
        raise TopologyError(f"line {start + 1}: a table header was expected")
    cols = lines[k].split()
    if not cols or not all(names_re.match(c) for c in cols):
        raise TopologyError(f"line {k + 1}: not a table header: {lines[k].strip()!r}")
    rows = {}
    k += 1
    while k < len(lines) and lines[k].split() and names_re.match(lines[k].split()[0]):
        cells = lines[k].split()
        if len(cells) != len(cols) + 1:
            raise TopologyError(f"line {k + 1}: {cells[0]} has {len(cells) - 1} values for {len(cols)} columns")
        rows[cells[0]] = cells[1:]
        k += 1
    if set(rows) != set(cols):
        raise TopologyError(f"line {k}: the rows ({', '.join(rows)}) are not the columns ({', '.join(cols)})")
    return cols, rows, k


def _pairs(cols, rows, self_values) -> dict[tuple[int, int], str]:
    out = {}
    for i, a in enumerate(cols):
        for j, _ in enumerate(cols):
            if i != j:
                out[(i, j)] = rows[a][j]
            elif rows[a][j] not in self_values:
                raise TopologyError(f"{a} to itself is {rows[a][j]!r}")
    return out


def parse_rocm_smi(text: str) -> Topology:
    """`rocm-smi --showtopo`: "Weight", "Hops" and "Link Type between two GPUs" tables, then NUMA lines."""
    lines = _clean(text)
    gpu_re = re.compile(r"^GPU\d+$")
    tables, gpus = {}, None
    for k, line in enumerate(lines):
        m = re.match(r"^=+\s*(Weight|Hops|Link Type) between two GPUs\s*=+$", line.strip())
        if m:
            cols, rows, _ = _matrix(lines, k + 1, gpu_re)
            if gpus is not None and cols != gpus:
                raise TopologyError(f"line {k + 1}: the {m.group(1)} table has other GPUs ({cols}) than {gpus}")
            gpus = cols
            tables[m.group(1).lower().replace(" ", "_")] = _pairs(cols, rows, {"0", "1", "X", "SELF"})
    if "link_type" not in tables:
        raise TopologyError("no 'Link Type between two GPUs' table (is this `rocm-smi --showtopo`?)")
    affinity = {}
    for g, what, value in re.findall(r"^GPU\[(\d+)\]\s*:\s*\(Topology\)\s*(Numa Node|Numa Affinity):\s*(\S+)",
                                     "\n".join(lines), flags=re.M):
        affinity.setdefault(int(g), {})[what] = value
    return Topology("rocm-smi --showtopo", gpus, tables.pop("link_type"), affinity=affinity, tables=tables, raw=text)


def parse_amd_smi(text: str) -> Topology:
    """`amd-smi topology`: tables ("ACCESS TABLE:", "LINK TYPE TABLE:", ...) indexed by PCI address."""
    lines = _clean(text)
    tables, gpus = {}, None
    for k, line in enumerate(lines):
        m = re.match(r"^([A-Z][A-Z -]*?) TABLE:\s*$", line.strip())
        if m:
            cols, rows, _ = _matrix(lines, k + 1, _BDF)
            if gpus is not None and cols != gpus:
                raise TopologyError(f"line {k + 1}: the {m.group(1)} table has other GPUs than the first table")
            gpus = cols
            name = m.group(1).lower().replace(" ", "_").replace("-", "_")
            tables[name] = {(i, j): rows[a][j] for i, a in enumerate(cols) for j in range(len(cols)) if i != j}
    if "link_type" not in tables:
        raise TopologyError("no 'LINK TYPE TABLE:' (is this `amd-smi topology`?)")
    for i, g in enumerate(gpus):
        if any(tables["link_type"][(i, j)] == "SELF" for j in range(len(gpus)) if j != i):
            raise TopologyError(f"{g}: SELF outside the diagonal")
    return Topology("amd-smi topology", gpus, tables.pop("link_type"), tables=tables, raw=text)


def parse(text: str) -> Topology:
    """The output of any tool in COMMANDS (each backend's record names them), recognised by its content."""
    clean = _ANSI.sub("", text)
    if "LINK TYPE TABLE:" in clean:
        return parse_amd_smi(text)
    if "between two GPUs" in clean:
        return parse_rocm_smi(text)
    if re.search(r"(^|\t)GPU0(\t|$)", clean, flags=re.M):
        return parse_nvidia_smi(text)
    raise TopologyError("not the output of " + " or ".join(" ".join(cmd) for cmd in COMMANDS))


COMMANDS = tuple(list(cmd) for plat in backend.GPUS for cmd in plat.topology_commands)   # each backend's tools


def read(timeout: float = 20.0) -> tuple[Topology | None, str]:
    """(topology, how it was obtained) from the first tool on PATH that answers; (None, why) otherwise.
    rocm-smi prints errors and still exits 0 without a GPU: its output is parsed, not its status trusted."""
    tried = []
    for cmd in COMMANDS:
        if shutil.which(cmd[0]) is None:
            continue
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            tried.append(f"{' '.join(cmd)}: {exc}")
            continue
        try:
            return parse(out.stdout), " ".join(cmd)
        except TopologyError as exc:
            tried.append(f"{' '.join(cmd)}: {exc}")
    if not tried:
        return None, f"none of {', '.join(cmd[0] for cmd in COMMANDS)} is installed"
    return None, "; ".join(tried)


def example(name: str) -> Topology:
    file, _, _ = EXAMPLES[name]
    return parse((EXAMPLES_DIR / file).read_text())


# --- peaks -----------------------------------------------------------------------------------------

def link_spec(key: str | None) -> dict | None:
    """The GPU-to-GPU link fields of a spec-table row (None when the table has none for it)."""
    if not key:
        return None
    row = spec_row(key)
    if "link_count" not in row:
        return None
    return {k: row[k] for k in ("name", "interconnect", "link_count", "link_gbps", "link_fabric", "pcie_gbps")}


def pair_peak_gbps(label: str, spec: dict | None) -> float | None:
    """Peak GB/s in each direction between two GPUs joined by `label`, from the spec row's figures:
    NV# -> # x link_gbps; XGMI -> one link (a mesh has one per pair); PCIe -> the slot's pcie_gbps."""
    kind, n = link_kind(label)
    if spec is None:
        return None
    if kind == "NVLink" and n:
        return n * spec["link_gbps"]
    if kind == "xGMI":
        return spec["link_gbps"]
    if kind == "PCIe":
        return spec.get("pcie_gbps")
    return None


def peak_busbw_gbps(spec: dict | None, ranks: int) -> float | None:
    """The bus bandwidth a collective over `ranks` GPUs of one machine can reach at most: what one GPU
    can send in each direction. Behind switches every link serves any peer; in a mesh a GPU reaches the
    others over one link each, so only ranks - 1 of its links carry the collective."""
    if spec is None or ranks < 2:
        return None
    links = spec["link_count"] if spec["link_fabric"] == "switch" else min(ranks - 1, spec["link_count"])
    return links * spec["link_gbps"]


def describe(topo: Topology, spec: dict | None = None) -> str:
    """A few lines: the tool, the GPUs, and each distinct link with its meaning and (given a spec) its peak."""
    lines = [f"{topo.tool}: {len(topo.gpus)} GPUs" + (f", NICs {', '.join(topo.nics)}" if topo.nics else "")]
    seen: dict[str, list[str]] = {}
    for i, j, lab in topo.pairs():
        seen.setdefault(lab, []).append(f"{i}-{j}")
    for lab, pairs in seen.items():
        peak = pair_peak_gbps(lab, spec)
        shown = ", ".join(pairs[:6]) + (f" and {len(pairs) - 6} more" if len(pairs) > 6 else "")
        lines.append(f"  {lab:<5} {meaning(lab)}: GPU pairs {shown}"
                     + (f"; peak {peak:,.0f} GB/s each way" if peak else ""))
    return "\n".join(lines)
