"""Why the manifests are UpdateLens's own and not a Delta table: a measurement, run by hand.

On real partitions of a data root (the SmolLM2 job's residuals, the largest per-layer table), it
compares the product's partition write (staged folder, rename, manifest with SHA-256) with
`deltalake.write_deltalake` replacing the same (model, layer) partition of a Delta table
(`mode="overwrite"` with a predicate), for the 30 layers in turn; then flips one bit in a data
file of each and records what a reader gets: the product's verification names the file, the Delta
table reads (or fails) without saying which file is wrong.

    pip install deltalake   # not a dependency of the product
    python -m bench.table_format --data-root data OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from updatelens.registry import DEFAULT_MODEL
from updatelens.storage.integrity import partition_error
from updatelens.storage.layout import partition_file, write_partition
from updatelens.storage.location import local_path


def flip_bit(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


def as_delta(table: pa.Table) -> pa.Table:
    """Delta has no fixed-size lists: vector columns become lists; the model column is constant."""
    fields = [pa.field(f.name, pa.list_(f.type.value_type)) if pa.types.is_fixed_size_list(f.type) else f
              for f in table.schema if f.name != "model"]
    return table.drop_columns(["model"]).cast(pa.schema(fields))


def main() -> int:
    from deltalake import DeltaTable, write_deltalake

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--data-root", type=Path, default=Path("data"))
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--table", default="residuals")
    args = parser.parse_args()
    layers = sorted(int(p.name.split("=")[1]) for p in (args.data_root / args.table / f"model={args.model}").glob("layer=*"))
    tables = {layer: pq.read_table(partition_file(args.data_root, args.table, args.model, layer)) for layer in layers}
    work = Path(tempfile.mkdtemp(prefix="table-format-"))
    ours, delta = work / "ours", str(work / "delta")
    record: dict[str, object] = {"table": args.table, "layers": len(layers),
                                 "bytes_per_partition": int(sum(t.nbytes for t in tables.values()) / len(tables))}
    try:
        for name, write in (
            ("updatelens", lambda layer, t: write_partition(ours, args.table, args.model, layer, t)),
            ("deltalake", lambda layer, t: write_deltalake(
                delta, t, partition_by=["layer"], mode="overwrite" if os.path.exists(delta) else "error",
                predicate=f"layer = {layer}" if os.path.exists(delta) else None)),
        ):
            for rnd in ("first write", "replace"):
                times = []
                for layer, t in tables.items():
                    start = time.perf_counter()
                    write(layer, as_delta(t) if name == "deltalake" else t)
                    times.append(time.perf_counter() - start)
                record[f"{name} {rnd} s per partition (median)"] = round(sorted(times)[len(times) // 2], 3)
                record[f"{name} {rnd} s, last partition"] = round(times[-1], 3)
        # one flipped bit in the middle of a data file of layer 7
        target = local_path(partition_file(ours, args.table, args.model, 7))
        flip_bit(target)
        record["updatelens after a bit flip"] = partition_error(target)
        dt = DeltaTable(delta)
        files = [f for f in dt.file_uris() if "layer=7" in f]
        flip_bit(Path(files[0].removeprefix("file://")))
        try:
            got = DeltaTable(delta).to_pyarrow_table(filters=[("layer", "=", 7)])
            same = got.select(["rel_err"]).equals(tables[7].select(["rel_err"]))
            outcome = "equal" if same else "differs"
            record["deltalake after a bit flip"] = f"read {len(got)} rows without an error; rel_err {outcome}"
        except (OSError, pa.ArrowException, Exception) as exc:  # noqa: BLE001 - what the reader says is the record
            record["deltalake after a bit flip"] = f"read failed: {type(exc).__name__}: {str(exc)[:200]}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
