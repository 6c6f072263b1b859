"""Tuned launch configurations: one JSON table per (operator, device, weight dtype), typed
entries, and the one lookup the kernels use. Nothing is tuned while serving: the tables are
written offline (``scripts/tune_moe.py``, ``scripts/bench_dense.py --write-table``); how to
tune a new GPU, and each kind's fields, are in docs/tuning.md.

A table is ``kernels/<op>/tables/<device>-<dtype>.json``, in its operator's package
(``table_path``):
- op: ``moe`` (the fused MoE layer's up and down GEMMs, and ``linear_triton``'s one-group
  GEMM) or ``linear`` (the dense linear layer at decode sizes);
- device: ``torch.cuda.get_device_name`` lower-cased, each run of other characters a ``-``
  (``device_name``: "NVIDIA H100 80GB HBM3" -> ``nvidia-h100-80gb-hbm3``);
- dtype: the weights' torch dtype (``bfloat16``, ``int8``).

    {"op": "moe", "device": "nvidia-h100-80gb-hbm3", "dtype": "int8",
     "entries": {"up:E8:N28672:K4096:k2": {"1": {"kind": "cuda", "bn": 2, "warps": 4, "unroll": 2}, ...}}}

``entries`` maps a shape (``moe_shape``: phase, E, N rows of W, K, top-k; ``linear_shape``:
N, K) to T buckets (positive integers), each an entry: its ``kind`` (``MOE_KINDS``,
``LINEAR_KINDS``) and that kind's fields, those left at their default omitted. Loading checks
all of it: an unknown kind or field, a missing field, a wrong type or a value out of range
fails with ``TableError`` naming the file, the shape, the bucket and the field.

The lookup rule (``Tables.lookup``): among the device's own entries for the shape and those
of the other devices of its chip (``SAME_CHIP``), the smallest bucket >= T, the device's own
at a tie; with none, the caller's heuristic (past the largest bucket the regime may have
changed, bandwidth- to compute-bound, so the largest entry is not stretched). An entry lent by
a same-chip device, and the heuristic, are logged once per (op, device, dtype, shape) and
fallback.
"""
import json
import logging
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Callable, ClassVar

import torch

logger = logging.getLogger(__name__)

TABLES_DIR = Path(__file__).parent  # the kernels package: each operator's tables in <op>/tables/
DTYPES = ("bfloat16", "float16", "float32", "int8")

# Devices built on one chip (the same SMs, caches and instructions; they differ in memory
# size and bandwidth), by ``device_name``. The lookup takes the others' entries beside the
# device's own (``Tables.lookup``) before the heuristic: lent entries measured much faster in
# the decode step than the heuristic, MoE and dense layers alike. A new device of a listed
# chip joins its group here; a new chip is a new group.
SAME_CHIP: tuple[tuple[str, ...], ...] = (
    ("nvidia-h100-80gb-hbm3", "nvidia-h200"),  # GH100
)

_ZERO_OK = {"min": 0}  # field metadata: 0 is a valid value (it means "off")


class TableError(ValueError):
    """A tuning table or entry that does not match the schema."""


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One tuned choice. Every field is an int (positive, unless its metadata allows 0) or
    a bool, checked at construction. ``pinned``: chosen by timing the decode step itself
    (where a kernel shares DRAM with its neighbours); the table writers keep it."""
    kind: ClassVar[str]
    pinned: bool = False

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type is bool and type(value) is not bool:
                raise ValueError(f"{self.kind} entry field {f.name!r}: expected true or false, got {value!r}")
            if f.type is int and (type(value) is not int or value < f.metadata.get("min", 1)):
                low = "a non-negative" if f.metadata.get("min", 1) == 0 else "a positive"
                raise ValueError(f"{self.kind} entry field {f.name!r}: expected {low} int, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class MoeTriton(Entry):
    """The Triton grouped GEMM (``kernels.moe.grouped_gemm``): bm x bn output tiles, bk deep."""
    kind: ClassVar[str] = "triton"
    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int
    split_k: int  # K splits (float32 partials, summed after); 1 in an up entry
    group_m: int = field(default=0, metadata=_ZERO_OK)  # row tiles per group of the tile order; 0: row-major
    sub_m: int = 1  # 2 or 4: an expert's last row tile runs at bm / sub_m rows where they fit
    tma: bool = False  # weight tiles by TMA where ``grouped_gemm.tma_ok``

    def __post_init__(self):
        super().__post_init__()
        if self.sub_m not in (1, 2, 4) or self.bm // self.sub_m < 16:
            raise ValueError(f"{self.kind} entry field 'sub_m': expected 1, 2 or 4 with bm / sub_m >= 16, "
                             f"got sub_m={self.sub_m}, bm={self.bm}")

    def kernel_args(self) -> dict:
        """The launch configuration as ``kernels.moe.grouped_gemm`` takes it."""
        return dict(bm=self.bm, bn=self.bn, bk=self.bk, num_warps=self.num_warps, num_stages=self.num_stages,
                    split_k=self.split_k, group_m=self.group_m, sub_m=self.sub_m, tma=self.tma)


@dataclass(frozen=True, kw_only=True)
class MoeGroupedMm(MoeTriton):
    """The down GEMM by ``torch._grouped_mm`` (bf16 on Hopper or later, large T) where it
    takes the operands (``kernels.moe.triton.grouped_mm_ok``); elsewhere the Triton kernel with
    these tiles."""
    kind: ClassVar[str] = "grouped_mm"


@dataclass(frozen=True, kw_only=True)
class MoeCuda(Entry):
    """The CUDA decode kernels (``kernels.moe.cuda``, T <= 16); they run as a pair, an up
    entry's kernel with the down entry's where that is CUDA too."""
    kind: ClassVar[str] = "cuda"
    bn: int  # outputs per block
    warps: int
    unroll: int  # loads per row in flight
    split_k: int = 1  # the down kernel's splits of the k * F reduction; 1 in an up entry
    min_blocks: int = 1  # registers capped so that this many blocks fit on an SM
    pair_major: bool = False  # grid order: pairs / tokens fastest
    unit: bool = False  # int8 widened by one byte permute a weight
    pipe: bool = False  # down: two weight buffers
    row_groups: int = 1  # the block's warps split its rows into this many groups


@dataclass(frozen=True, kw_only=True)
class MoeDequant(Entry):
    """int8 experts widened to the activations' dtype first, then that dtype's entries
    (large T, int8 tables only)."""
    kind: ClassVar[str] = "dequant"


@dataclass(frozen=True, kw_only=True)
class LinearCublas(Entry):
    """``torch.nn.functional.linear`` (full-precision weights only)."""
    kind: ClassVar[str] = "cublas"


@dataclass(frozen=True, kw_only=True)
class LinearTriton(Entry):
    """``kernels.moe.triton.linear_triton``: the grouped GEMM with one group (its tiles from the moe table)."""
    kind: ClassVar[str] = "triton"


@dataclass(frozen=True, kw_only=True)
class LinearSbi(Entry):
    """``kernels.sbi_linear``: SBI-GeMM in Triton."""
    kind: ClassVar[str] = "sbi"


@dataclass(frozen=True, kw_only=True)
class LinearCuda(Entry):
    """SBI-GeMM in CUDA C++ (``kernels.linear.sbi_cuda``) with this launch configuration."""
    kind: ClassVar[str] = "cuda"
    bn: int  # outputs per block
    warps: int
    unroll: int  # loads per row in flight
    split_k: int  # K splits
    persist: int = field(default=0, metadata=_ZERO_OK)  # blocks per SM of a persistent grid; 0: one per tile
    unit: bool = False  # int8 widened by one byte permute a weight
    pipe: bool = False  # two weight buffers
    norm: bool = False  # ``norm_linear``: the residual add and RMSNorm inside the launch

    def kernel_args(self) -> dict:
        """The launch configuration as ``kernels.linear.sbi_cuda`` takes it."""
        return dict(bn=self.bn, warps=self.warps, unroll=self.unroll, split_k=self.split_k, persist=self.persist,
                    unit=self.unit, pipe=self.pipe)


MoeEntry = MoeTriton | MoeCuda | MoeDequant  # MoeGroupedMm is a MoeTriton
LinearEntry = LinearCublas | LinearTriton | LinearSbi | LinearCuda
MOE_KINDS = {c.kind: c for c in (MoeTriton, MoeGroupedMm, MoeCuda, MoeDequant)}
LINEAR_KINDS = {c.kind: c for c in (LinearCublas, LinearTriton, LinearSbi, LinearCuda)}
KINDS = {"moe": MOE_KINDS, "linear": LINEAR_KINDS}
SHAPES = {"moe": re.compile(r"(up|down):E[1-9]\d*:N[1-9]\d*:K[1-9]\d*:k[1-9]\d*"),
          "linear": re.compile(r"N[1-9]\d*:K[1-9]\d*")}
_DEVICE = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
_BUCKET = re.compile(r"[1-9]\d*")


def moe_shape(phase: str, e: int, n: int, k: int, topk: int) -> str:
    """A moe table's shape key: phase up/down, E experts, N output rows of W, reduction K, top-k."""
    return f"{phase}:E{e}:N{n}:K{k}:k{topk}"


def linear_shape(n: int, k: int) -> str:
    """A linear table's shape key: W [N, K]."""
    return f"N{n}:K{k}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def normalize_device(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_name(device: torch.device) -> str:
    """The tables' name of ``device``: "cpu" off the GPU (no table has it)."""
    if device.type != "cuda":
        return device.type
    return normalize_device(torch.cuda.get_device_name(device))


def sm_count(device: torch.device) -> int:
    """The device's SM count (the heuristics' grid sizes); 1 off the GPU, where the Triton
    interpreter runs one program at a time."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def table_path(root: Path, op: str, device: str, dtype: str) -> Path:
    """Where (op, device, dtype)'s table lives under ``root`` (``TABLES_DIR``: the kernels package)."""
    return Path(root) / op / "tables" / f"{device}-{dtype}.json"


@dataclass(frozen=True)
class Table:
    """One file's content: ``entries`` maps shape -> T bucket -> entry (read-only)."""
    op: str
    device: str
    dtype: str
    entries: dict

    def __post_init__(self):
        if self.op not in KINDS:
            raise TableError(f"op {self.op!r}: expected one of {tuple(KINDS)}")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise TableError(f"device {self.device!r}: expected a name like 'nvidia-h100-80gb-hbm3' (device_name)")
        if self.dtype not in DTYPES:
            raise TableError(f"dtype {self.dtype!r}: expected one of {DTYPES}")
        if not isinstance(self.entries, dict):
            raise TableError(f"entries: expected an object of shapes, got {type(self.entries).__name__}")
        kinds = tuple(KINDS[self.op].values())
        for shape, buckets in self.entries.items():
            if not isinstance(shape, str) or not SHAPES[self.op].fullmatch(shape):
                like = moe_shape("up", 8, 28672, 4096, 2) if self.op == "moe" else linear_shape(4096, 4096)
                raise TableError(f"shape {shape!r}: expected one like {like!r}")
            if not isinstance(buckets, dict) or not buckets:
                raise TableError(f"{shape}: expected an object of T buckets, got {buckets!r}")
            for bucket, entry in buckets.items():
                where = f"{shape} T {bucket}"
                if type(bucket) is not int or bucket < 1:
                    raise TableError(f"{where}: expected a positive int bucket")
                if not isinstance(entry, kinds):
                    raise TableError(f"{where}: expected a {self.op} entry ({', '.join(KINDS[self.op])}), "
                                     f"got {entry!r}")
                why = self._misfit(shape, entry)
                if why:
                    raise TableError(f"{where}: {entry.kind} entry: {why}")

    def _misfit(self, shape: str, entry: Entry) -> str | None:
        """Why ``entry`` cannot stand in this table at ``shape`` (None: it can)."""
        if isinstance(entry, LinearCublas) and self.dtype == "int8":
            return "cuBLAS takes no int8 weights"
        if isinstance(entry, MoeDequant) and self.dtype != "int8":
            return "widens int8 weights; this table's are " + self.dtype
        if shape.startswith("up:") and getattr(entry, "split_k", 1) != 1:
            return "field 'split_k': expected 1 in an up entry (the up GEMM's epilogue is not linear)"
        return None


def entry_from_json(op: str, data) -> Entry:
    """The typed entry of a table's JSON object (``{"kind": ..., fields}``); ValueError
    naming the kind or field that does not fit."""
    kinds = KINDS[op]
    if not isinstance(data, dict) or "kind" not in data:
        raise TableError(f"expected an object with a 'kind' ({', '.join(kinds)}), got {data!r}")
    cls = kinds.get(data["kind"])
    if cls is None:
        raise TableError(f"kind {data['kind']!r}: expected one of {tuple(kinds)}")
    names = [f.name for f in fields(cls)]
    for name in data:
        if name != "kind" and name not in names:
            raise TableError(f"{cls.kind} entry: unknown field {name!r} (fields: {', '.join(names)})")
    for f in fields(cls):
        if f.default is MISSING and f.default_factory is MISSING and f.name not in data:
            raise TableError(f"{cls.kind} entry: missing field {f.name!r}")
    try:
        return cls(**{name: value for name, value in data.items() if name != "kind"})
    except ValueError as exc:
        raise TableError(str(exc)) from None


def entry_to_json(entry: Entry) -> dict:
    """``entry`` as a table stores it: its kind, its fields without a default, the others
    where they differ from it (``pinned`` last)."""
    out = {"kind": entry.kind}
    for f in sorted(fields(entry), key=lambda f: f.name == "pinned"):
        value = getattr(entry, f.name)
        if f.default is MISSING or value != f.default:
            out[f.name] = value
    return out


def load_table(path: Path) -> Table:
    """The validated table in ``path``; TableError naming the file, shape, bucket and field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TableError(f"{path}: not JSON ({exc})") from None
    keys = ("op", "device", "dtype", "entries")
    if not isinstance(data, dict) or sorted(data) != sorted(keys):
        raise TableError(f"{path}: expected an object with the keys {', '.join(keys)}, got "
                         f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    op, entries = data["op"], data["entries"]
    if op not in KINDS or not isinstance(entries, dict):
        raise TableError(f"{path}: op {op!r} (expected one of {tuple(KINDS)}) with an object of entries")
    parsed = {}
    for shape, buckets in entries.items():
        if not isinstance(buckets, dict):
            raise TableError(f"{path}: {shape}: expected an object of T buckets, got {buckets!r}")
        parsed[shape] = {}
        for bucket, value in buckets.items():
            if not _BUCKET.fullmatch(bucket):
                raise TableError(f"{path}: {shape} T {bucket!r}: expected a positive integer bucket")
            try:
                parsed[shape][int(bucket)] = entry_from_json(op, value)
            except TableError as exc:
                raise TableError(f"{path}: {shape} T {bucket}: {exc}") from None
    try:
        table = Table(op, data["device"], data["dtype"], parsed)
    except TableError as exc:
        raise TableError(f"{path}: {exc}") from None
    expected = table_path(path.parents[2], op, table.device, table.dtype)
    if path.parts[-3:] != expected.parts[-3:]:
        raise TableError(f"{path}: its op, device and dtype ({op}, {table.device}, {table.dtype}) name the file "
                         f"{Path(*expected.parts[-3:])}")
    return table


def dump_table(table: Table) -> str:
    """The file text of ``table``: one line an entry, shapes and buckets sorted."""
    def natural(shape: str):  # up:E8:N4096... before up:E64:...
        return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", shape)]

    shapes = []
    for shape in sorted(table.entries, key=natural):
        buckets = table.entries[shape]
        lines = [f'   "{b}": {json.dumps(entry_to_json(buckets[b]))}' for b in sorted(buckets)]
        shapes.append(f'  "{shape}": {{\n' + ",\n".join(lines) + "\n  }")
    head = f' "op": "{table.op}",\n "device": "{table.device}",\n "dtype": "{table.dtype}",\n'
    return "{\n" + head + ' "entries": {\n' + ",\n".join(shapes) + ("\n" if shapes else "") + " }\n}\n"


def write_table(root: Path, table: Table) -> Path:
    """Writes ``table`` to its file under ``root`` (``table_path``); returns the path."""
    path = table_path(root, table.op, table.device, table.dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_table(table))
    return path


class Tables:
    """The tables under ``root``, each file loaded (and validated) at its first lookup, and
    the devices of one chip (``chips``, as ``SAME_CHIP``) that lend each other entries."""

    def __init__(self, root: Path = TABLES_DIR, chips: tuple[tuple[str, ...], ...] = SAME_CHIP):
        self.root, self.chips = Path(root), chips
        self._tables: dict[tuple[str, str, str], Table | None] = {}
        self._noted: set[tuple] = set()  # fallbacks logged (once each)

    def table(self, op: str, device: str, dtype: str) -> Table | None:
        """The table of (op, device, dtype); None where there is no file."""
        key = (op, device, dtype)
        if key not in self._tables:
            path = table_path(self.root, op, device, dtype)
            self._tables[key] = load_table(path) if path.is_file() else None
        return self._tables[key]

    def same_chip(self, device: str) -> tuple[str, ...]:
        """The other devices of ``device``'s chip, in listed order."""
        return next((tuple(d for d in group if d != device) for group in self.chips if device in group), ())

    def lookup(self, op: str, device: str, dtype: str, shape: str, t: int, heuristic: Callable[[], Entry]) -> Entry:
        """The entry for T = t of ``shape`` in the ``op`` tables of ``dtype`` weights on
        ``device`` (``device_name``): of the device's own entries and those of the other
        devices of its chip, the one at the smallest bucket >= t, the device's own at a tie
        (then the chip's devices in listed order); with none, ``heuristic()``. A lent entry
        and the heuristic are logged (INFO) once per (op, device, dtype, shape) and source."""
        best = None  # (bucket, lender, entry)
        for lender in (device, *self.same_chip(device)):
            table = self.table(op, lender, dtype)
            buckets = table.entries.get(shape, {}) if table is not None else {}
            bucket = min((b for b in buckets if b >= t), default=None)
            if bucket is not None and (best is None or bucket < best[0]):
                best = bucket, lender, buckets[bucket]
        if best is not None and best[1] == device:
            return best[2]
        source = best[1] if best is not None else "heuristic"
        if (op, device, dtype, shape, source) not in self._noted:
            self._noted.add((op, device, dtype, shape, source))
            if best is not None:
                logger.info("tuning: %s %s %s on %s: T=%d takes %s's entry (same chip; none of its own)",
                            op, shape, dtype, device, t, source)
            else:
                logger.info("tuning: %s %s %s on %s: T=%d takes the heuristic (no tuned entry for a bucket >= T)",
                            op, shape, dtype, device, t)
        return best[2] if best is not None else heuristic()


TABLES = Tables()  # the shipped tables, as the kernels read them (one instance: each file loads once)
