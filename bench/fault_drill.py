"""A fault drill on a real data root, run by hand (tens of minutes), not by the suite.

On a data root holding a model's results (by default the SmolLM2 job's, `./data`), each fault is
inflicted on one layer, then the drill records whether `updatelens verify` names the damage,
whether queries of the other partitions keep answering, whether the next `updatelens run` repairs
it (exit 0, `verify` clean afterwards) and whether the repaired partitions equal the ones from
before the fault (Parquet tables compared whole). The faults:

- delete, truncate (to half) and flip one bit of the first table of each of the five stages;
- SIGKILL while a partition is being written, between the data file and its manifest, and while
  an existing partition is being replaced (bench.faults patches the writer of the run's process);
- a full disk: the data root on a small tmpfs (needs root; otherwise recorded as not run) filled by
  another writer while a run is going;
- two runs on the same model and root at once;
- a partition replaced by its neighbour layer's (file and manifest), a stray valid file beside a
  partition, the token text deleted, the catalog cut to 100 bytes, a killed writer's staging folder;
- and, on a fresh root, each bad input to `run`: its message and whether anything was created;
- a root's shape (`--only shape`): a second spelling of a partition key, a backup-named folder, a
  partition folder replaced by a symbolic link (then its target damaged), a run with other settings
  killed in its last stage (stage, then swap: the layer keeps its tables), the root copied and the
  original moved away;
  a mistyped --data-root given to the reading commands and corpus files that are no text (a FIFO,
  a device, a 2 GiB sparse file): each refused in one line, nothing created;
- trust (`--only trust`): a run with other settings that fails in its last stage, the model's name
  pointed at other weights, a report on a layer of two configurations, a bit flipped with the file's
  mtime put back (found by `verify`, then left out and recomputed without --repair), a sweep rerun
  killed mid-write, and bad settings and `sql --timeout` values given to the stored root.

It also times `verify_root` over the whole root (what every run and view refresh pays) against
the pipeline time given with --pipeline-s.

    python -m bench.fault_drill --data-root data --layers 6-8 --target 7 OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from updatelens.registry import DEFAULT_MODEL
from updatelens.stages import STAGES, TABLES
from updatelens.storage import catalog
from updatelens.storage.layout import STAGING, partition_file

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Outcome:
    fault: str
    table: str
    detected: bool = False  # `verify` exited 1 and named the table and layer (or the run refused)
    detection: str = ""
    others_answer: bool = False  # the other layers' rows of that table, counted while the damage stood
    repair_rc: int | None = None
    repair_s: float = 0.0
    verified_after: bool = False  # `verify` exits 0 after the repair
    identical: bool = False  # every partition of the drill's layers equals its copy from before
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.detected and self.others_answer and self.repair_rc == 0 and self.verified_after and self.identical


class Drill:
    def __init__(self, root: Path, model: str, layers: list[int], target: int, extra: list[str]) -> None:
        self.root, self.model, self.layers, self.target, self.extra = root, model, layers, target, extra
        self.home = root.parent / (root.name + "-drill-dagster-home")
        self.baseline: dict[tuple[str, int], pa.Table] = {}
        self.other_rows: dict[str, int] = {}

    # ---- the product's commands ----------------------------------------------------------------
    def cli(self, *args: str, fault: tuple[str, str] | None = None, background: bool = False):
        """The CLI in a subprocess; `fault` (fault, table): under bench.faults, killed there."""
        full_env = dict(os.environ, DAGSTER_HOME=str(self.home), HF_HUB_OFFLINE="1", UPDATELENS_PROGRESS="off")
        entry = ["bench.faults", *fault, "--"] if fault else ["updatelens.orchestration.cli"]
        cmd = [sys.executable, "-m", *entry, *args, "--data-root", str(self.root)]
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if background:
            return proc
        out, _ = proc.communicate()
        return proc.returncode, out

    def run(self, *extra: str, background: bool = False):
        span = f"{self.layers[0]}-{self.layers[-1]}"
        return self.cli("run", "--model", self.model, "--layers", span, *self.extra, *extra,
                        background=background)

    def verify(self) -> tuple[int, str]:
        return self.cli("verify")

    # ---- the state to compare with -------------------------------------------------------------
    def file(self, table: str, layer: int | None = None) -> Path:
        return Path(str(partition_file(self.root, table, self.model, self.target if layer is None else layer)))

    def snapshot(self) -> None:
        rc, out = self.run()
        if rc != 0:
            raise SystemExit(f"the data root could not be brought up to date:\n{out[-3000:]}")
        rc, out = self.verify()
        if rc != 0:
            raise SystemExit(f"the data root does not verify before the drill:\n{out[-3000:]}")
        for table in TABLES:
            for layer in self.layers:
                self.baseline[(table, layer)] = pq.read_table(self.file(table, layer))
            self.other_rows[table] = self.count_others(table)

    def count_others(self, table: str) -> int:
        return int(catalog.query(self.root, f"SELECT count(*) AS n FROM {table} WHERE model = ? AND layer <> ?",
                                 [self.model, self.target])["n"][0])

    def identical(self) -> tuple[bool, list[str]]:
        differ = []
        for (table, layer), before in self.baseline.items():
            path = self.file(table, layer)
            if not path.exists() or not pq.read_table(path).equals(before):
                differ.append(f"{table} layer {layer}")
        return not differ, differ

    # ---- one fault -----------------------------------------------------------------------------
    def detect(self, outcome: Outcome, table: str) -> None:
        rc, out = self.verify()
        named = [line for line in out.splitlines()
                 if f"layer={self.target}" in line and (table in line or "incomplete" in line)]
        outcome.detected = rc == 1 and bool(named)
        outcome.detection = named[0].strip() if named else out.strip()[-300:]

    def others(self, outcome: Outcome, table: str) -> None:
        try:
            outcome.others_answer = self.count_others(table) == self.other_rows[table]
        except Exception as exc:  # noqa: BLE001 - recorded: a query that fails is what the drill looks for
            outcome.notes.append(f"query of the other layers failed: {exc}")

    def repair(self, outcome: Outcome, *extra: str) -> None:
        start = time.perf_counter()
        outcome.repair_rc, out = self.run(*extra)
        outcome.repair_s = round(time.perf_counter() - start, 1)
        if outcome.repair_rc != 0:
            outcome.notes.append(out[-1500:])
        self.after(outcome)

    def after(self, outcome: Outcome) -> None:
        """What the root holds after the repair: it verifies, equals its state from before, no leftovers."""
        outcome.verified_after = self.verify()[0] == 0
        outcome.identical, differ = self.identical()
        if differ:
            outcome.notes.append(f"differ from before: {', '.join(differ)}")
        if list((self.root / STAGING).glob("*")):
            outcome.notes.append("staging folders left behind")

    def file_fault(self, fault: str, table: str) -> Outcome:
        outcome = Outcome(fault, table)
        path = self.file(table)
        if fault == "delete":
            path.unlink()
        elif fault == "truncate":
            with path.open("r+b") as f:
                f.truncate(path.stat().st_size // 2)
        else:  # bit flip in the middle of the file: its footer still reads
            with path.open("r+b") as f:
                f.seek(path.stat().st_size // 2)
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte ^ 0x10]))
        self.detect(outcome, table)
        self.others(outcome, table)
        self.repair(outcome)
        quarantined = list((self.root / "_quarantine").rglob(f"{table}/model={self.model}/layer={self.target}/*.parquet"))
        if fault != "delete" and not quarantined:
            outcome.notes.append("the damaged file was not kept in _quarantine")
        return outcome

    def kill(self, fault: str, point: str, table: str = "geometry") -> Outcome:
        """A run over the target layer killed at `point` (bench.faults); then verify, the others, the repair."""
        outcome = Outcome(fault, table)
        rc, out = self.cli("run", "--model", self.model, "--layers", str(self.target), "--force", *self.extra,
                           fault=(point, table))
        if rc != -9:
            outcome.notes.append(f"the run was not killed (exit {rc}): {out[-500:]}")
        vrc, vout = self.verify()
        # the kill left only staging folders: every visible file verifies and equals the one from before
        # (mid-replace: the new partition was swapped in whole, the old one not yet removed)
        outcome.detected = vrc == 0 and self.identical()[0]
        outcome.detection = "nothing visible changed; verify exits 0" if outcome.detected else vout[-300:]
        self.others(outcome, table)
        self.repair(outcome, "--force")
        return outcome

    # ---- faults of placement, the catalog and the text (issue "Nothing wrong is ever served") ---
    def misplaced(self, table: str = "activations") -> Outcome:
        """The target layer's folder replaced by its neighbour's (data file and manifest, internally
        consistent): the views must not label the neighbour's rows as the target's."""
        outcome = Outcome("misplaced partition", table)
        source = self.file(table, self.layers[0] if self.target != self.layers[0] else self.layers[-1]).parent
        shutil.rmtree(self.file(table).parent)
        shutil.copytree(source, self.file(table).parent)
        self.detect(outcome, table)
        served = catalog.query(self.root, f"SELECT count(*) AS n FROM {table} WHERE model = ? AND layer = ?",
                               [self.model, self.target])["n"][0]
        if served:
            outcome.notes.append(f"{served} rows served as layer {self.target}")
            outcome.detected = False
        self.others(outcome, table)
        self.repair(outcome)
        return outcome

    def stray(self, table: str = "geometry") -> Outcome:
        """A valid file of another layer dropped beside the target's partition as part-1.parquet."""
        outcome = Outcome("stray file", table)
        neighbour = self.file(table, self.layers[0] if self.target != self.layers[0] else self.layers[-1])
        shutil.copy(neighbour, self.file(table).parent / "part-1.parquet")
        self.detect(outcome, table)
        self.others(outcome, table)
        self.repair(outcome)
        left = sorted(p.name for p in self.file(table).parent.iterdir())
        if left != ["manifest.json", "part-0.parquet"]:
            outcome.notes.append(f"the partition folder holds {left} after the repair")
        return outcome

    def missing_text(self) -> Outcome:
        """The target layer's `tokens` partition deleted: the text columns of two views would be NULL."""
        outcome = Outcome("tokens deleted", "tokens")
        shutil.rmtree(self.file("tokens").parent)
        self.detect(outcome, "tokens")
        listed = catalog.query(self.root, "SELECT reason FROM damaged_partitions WHERE table_name = 'tokens' "
                                          "AND layer = ?", [self.target])
        if listed.is_empty():
            outcome.notes.append("damaged_partitions does not list the missing tokens")
            outcome.detected = False
        else:
            outcome.detection += f"; damaged_partitions: {listed['reason'][0]}"
        self.others(outcome, "tokens")
        self.repair(outcome)
        return outcome

    def broken_catalog(self) -> Outcome:
        """updatelens.duckdb cut to 100 bytes: verify names it, the next run rebuilds it."""
        import duckdb

        outcome = Outcome("catalog cut to 100 bytes", "updatelens.duckdb")
        db = self.root / catalog.CATALOG_FILE
        with db.open("r+b") as handle:
            handle.truncate(100)
        rc, out = self.verify()
        named = [line for line in out.splitlines() if "catalog" in line and "damaged" in line]
        outcome.detected = rc == 1 and bool(named)
        outcome.detection = named[0].strip() if named else out[-300:]
        self.others(outcome, "geometry")
        self.repair(outcome, "--force")  # a run that recomputes: it refreshes the catalog
        try:
            with duckdb.connect(str(db), read_only=True) as con:
                con.execute("SELECT count(*) FROM geometry").fetchone()
        except duckdb.Error as exc:
            outcome.notes.append(f"the catalog still does not open: {exc}")
            outcome.identical = False
        return outcome

    def abandoned_staging(self) -> Outcome:
        """A killed writer's staging folder (a pid that is gone) with a half-written file."""
        outcome = Outcome("abandoned staging", STAGING)
        folder = self.root / STAGING / f"{2**22 + 4242}-drill"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "part-0.parquet").write_bytes(b"PAR1 half written")
        outcome.detected = self.verify()[0] == 0  # invisible to readers
        outcome.detection = "invisible to verify and the views"
        self.others(outcome, "geometry")
        self.repair(outcome)  # `run` cleans it even when every partition is up to date
        if folder.exists():
            outcome.notes.append("the abandoned folder is still there")
            outcome.identical = False
        return outcome

    def full_disk(self) -> Outcome:
        """Another writer fills the file system while a run rewrites the target layer."""
        outcome = Outcome("full disk", "geometry")
        filler = self.root / "filler.bin"
        self.file("geometry").unlink()
        proc = self.run(background=True)
        deadline = time.time() + 600
        while not list((self.root / STAGING).glob("*/*")) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True)
        out, _ = proc.communicate()
        # the run's one line names the full disk and the root: the OSError's own words ("No space left"), or
        # the product's where a library reports it otherwise (sqlite: "disk I/O error"); never a traceback
        outcome.detected = (proc.returncode not in (0, None) and "Traceback" not in out
                            and ("No space left" in out or "the disk is full" in out))
        said = [line for line in out.splitlines() if "No space left" in line or "updatelens run:" in line]
        outcome.detection = (said[-1].strip() if said else out[-300:])[:300]
        vrc, vout = self.verify()
        if "damaged:" in vout:
            outcome.notes.append(f"a damaged file is visible after the full disk: {vout[-500:]}")
            outcome.detected = False
        self.others(outcome, "geometry")
        filler.unlink()
        self.repair(outcome)
        return outcome

    def concurrent(self) -> Outcome:
        """Two runs on the same model and root at once, with the target layer's residuals deleted, while
        a reader queries the other layers."""
        outcome = Outcome("two runs at once", "residuals")
        self.file("residuals").unlink()
        self.detect(outcome, "residuals")
        reads, failures = [0], []
        procs = [self.run(background=True), self.run(background=True)]

        def read() -> None:
            while any(p.poll() is None for p in procs):
                try:
                    assert self.count_others("geometry") == self.other_rows["geometry"]
                    reads[0] += 1
                except Exception as exc:  # noqa: BLE001
                    failures.append(str(exc))
                time.sleep(0.5)

        reader = threading.Thread(target=read)
        reader.start()
        start = time.perf_counter()
        outs = [p.communicate()[0] for p in procs]
        reader.join()
        outcome.repair_s = round(time.perf_counter() - start, 1)
        outcome.repair_rc = max(abs(p.returncode) for p in procs)
        outcome.others_answer = reads[0] > 0 and not failures
        outcome.notes.append(f"{reads[0]} queries answered during the runs, {len(failures)} failed"
                             + (f" ({failures[0][:200]})" if failures else ""))
        for p, out in zip(procs, outs):
            if p.returncode != 0:
                outcome.notes.append(out[-1500:])
        self.after(outcome)
        return outcome


    # ---- faults of a root's shape (issue "A root is what it holds") -----------------------------
    def named(self, outcome: Outcome, *marks: str) -> None:
        """`verify` exits 1 with a line that names every one of `marks`."""
        rc, out = self.verify()
        lines = [line for line in out.splitlines() if all(m in line for m in marks)]
        outcome.detected = rc == 1 and bool(lines)
        outcome.detection = lines[0].strip() if lines else out.strip()[-300:]

    def served_rows(self, table: str) -> int:
        return int(catalog.query(self.root, f"SELECT count(*) AS n FROM {table} WHERE model = ? AND layer = ?",
                                 [self.model, self.target])["n"][0])

    def set_aside_then_run(self, outcome: Outcome) -> None:
        """`verify --repair` sets the stray things aside, then `run` recomputes what they were."""
        rc, out = self.verify_repair()
        if rc not in (0, 1):
            outcome.notes.append(f"verify --repair exited {rc}: {out[-500:]}")
        self.repair(outcome)

    def verify_repair(self) -> tuple[int, str]:
        return self.cli("verify", "--repair")

    def second_spelling(self, table: str = "geometry") -> Outcome:
        """A copy of the target layer's folder under a second spelling of its key (layer=07 beside
        layer=7): never read as the same layer twice."""
        outcome = Outcome("second spelling of a key", table)
        real = self.file(table).parent
        twin = real.parent / f"layer=0{self.target}"
        shutil.copytree(real, twin)
        self.named(outcome, twin.name, "not the layout's spelling")
        expected = len(self.baseline[(table, self.target)])
        if (served := self.served_rows(table)) != expected:
            outcome.notes.append(f"{served} rows served as layer {self.target}, {expected} stored")
            outcome.detected = False
        self.others(outcome, table)
        self.set_aside_then_run(outcome)
        if twin.exists():
            outcome.notes.append(f"{twin.name} is still there after the repair")
            outcome.identical = False
        return outcome

    def backup_folder(self, table: str = "residuals") -> Outcome:
        """A backup-like folder beside the partitions (`layer=7 (copy)`): the views keep answering."""
        outcome = Outcome("backup-named folder", table)
        backup = self.file(table).parent.with_name(f"layer={self.target} (copy)")
        shutil.copytree(self.file(table).parent, backup)
        self.named(outcome, backup.name)
        self.others(outcome, table)
        self.set_aside_then_run(outcome)
        if backup.exists():
            outcome.notes.append("the backup folder is still there after the repair")
            outcome.identical = False
        return outcome

    def symlinked_partition(self, table: str = "local_fits") -> Outcome:
        """The target's partition folder replaced by a symbolic link to a copy outside the root; then the
        copy is damaged: never served, always reported."""
        outcome = Outcome("symlinked partition", table)
        folder = self.file(table).parent
        elsewhere = self.root.parent / f"{self.root.name}-drill-elsewhere"
        shutil.rmtree(elsewhere, ignore_errors=True)
        shutil.copytree(folder, elsewhere)
        shutil.rmtree(folder)
        folder.symlink_to(elsewhere, target_is_directory=True)
        with (elsewhere / "part-0.parquet").open("r+b") as f:  # a later change where the link points
            f.truncate((elsewhere / "part-0.parquet").stat().st_size // 2)
        self.named(outcome, "symbolic link")
        self.others(outcome, table)
        self.set_aside_then_run(outcome)
        if folder.is_symlink():
            outcome.notes.append("the link is still there after the repair")
            outcome.identical = False
        shutil.rmtree(elsewhere, ignore_errors=True)
        return outcome

    def mixed_configuration(self) -> Outcome:
        """A run of the target layer with other settings killed while it writes functional_summary, its last
        stage: the run's partitions were staged, so the layer keeps its stored tables (before runs staged,
        it was left with tables of two configurations); verify exits 0, the next run cleans up."""
        outcome = Outcome("killed run, other settings", "functional_summary")
        rc, out = self.cli("run", "--model", self.model, "--layers", str(self.target), "--set", "k=32", *self.extra,
                           fault=("mid_write", "functional_summary"))
        if rc != -9:
            outcome.notes.append(f"the run was not killed (exit {rc}): {out[-500:]}")
        vrc, vout = self.verify()
        outcome.detected = rc == -9 and vrc == 0 and self.identical()[0]
        outcome.detection = ("killed in its last stage; every stored partition as before, verify exits 0"
                             if outcome.detected else vout[-300:])
        self.others(outcome, "geometry")
        self.repair(outcome)
        return outcome

    def copied_root(self) -> Outcome:
        """The root copied (cp -a keeps sizes and mtimes), then the original moved away: the copy
        re-verifies on first use and serves its own files."""
        outcome = Outcome("copied, original moved", "every table")
        copy = self.root.parent / f"{self.root.name}-drill-copy"
        moved = self.root.parent / f"{self.root.name}-drill-moved"
        for path in (copy, moved):
            shutil.rmtree(path, ignore_errors=True)
        subprocess.run(["cp", "-a", str(self.root), str(copy)], check=True)
        self.root.rename(moved)
        try:
            env = dict(os.environ, DAGSTER_HOME=str(self.home), HF_HUB_OFFLINE="1")
            done = subprocess.run([sys.executable, "-m", "updatelens.orchestration.cli", "verify", "--data-root",
                                   str(copy)], cwd=REPO, env=env, capture_output=True, text=True)
            outcome.detected = done.returncode == 0
            outcome.detection = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
            counted = catalog.query(copy, "SELECT count(*) AS n FROM geometry WHERE model = ? AND layer <> ?",
                                    [self.model, self.target])["n"][0]
            outcome.others_answer = int(counted) == self.other_rows["geometry"]
        finally:
            moved.rename(self.root)
            shutil.rmtree(copy, ignore_errors=True)
        outcome.repair_rc = 0  # nothing to repair: the original is back where it was
        self.after(outcome)
        return outcome


    # ---- round 4 (issue "Trust, round 4") -----------------------------------------------------
    def late_failure(self) -> Outcome:
        """A run of the target layer with other settings whose last stage fails after every earlier stage
        wrote (bench.faults `fail_stage`): the run stages its partitions and swaps them in only at its end,
        so nothing stored changes; the next run removes its staging folder."""
        outcome = Outcome("late failure, other settings", "functional_metrics")
        rc, out = self.cli("run", "--model", self.model, "--layers", str(self.target), "--set", "seed=7", *self.extra,
                           fault=("fail_stage", "functional_metrics"))
        said = [line for line in out.splitlines() if "planted failure" in line]
        vrc, _ = self.verify()
        outcome.detected = rc == 1 and bool(said) and vrc == 0 and self.identical()[0]
        outcome.detection = (f"exit {rc}: {said[-1].strip()[:200]}; every stored partition as before, verify exits {vrc}"
                             if said else out[-300:])
        self.others(outcome, "geometry")
        staged = [p.name for p in (self.root / STAGING).glob("run-*")]
        outcome.notes.append(f"staging folders of the failed run before the next run: {staged}")
        self.repair(outcome)  # up to date: the next run only removes the failed run's folder
        return outcome

    def other_weights(self) -> Outcome:
        """The model's name pointed at other weights (the registry's entry of another shipped model): a run
        of the target layer refuses in one line before anything is written, the root is unchanged."""
        import tomllib

        outcome = Outcome("other weights, same name", "every table")
        text = (REPO / "registry" / "registry.toml").read_text()
        other = next(slug for slug in tomllib.loads(text)["models"] if slug != self.model)
        registry = self.root.parent / f"{self.root.name}-drill-registry.toml"
        registry.write_text(text.replace(f"[models.{self.model}]", f"[models.{self.model}-was]")
                                .replace(f"[models.{other}]", f"[models.{self.model}]"))
        rc, out = self.cli("run", "--model", self.model, "--layers", str(self.target), "--registry", str(registry),
                           *self.extra)
        said = [line for line in out.splitlines() if line.startswith("updatelens run:")]
        outcome.detected = rc == 2 and len(said) == 1 and "other weights" in said[0] and self.identical()[0]
        outcome.detection = said[0].strip()[:300] if said else out[-300:]
        self.others(outcome, "geometry")
        registry.unlink()
        self.repair(outcome)
        return outcome

    def mixed_report(self) -> Outcome:
        """The target layer's geometry rewritten with another configuration id (a layer of two runs, as a
        copy or an older version leaves it): `report` exits 0 and names the layer; the next run redoes it."""
        import pyarrow as pa

        from updatelens.storage.layout import write_partition

        outcome = Outcome("report on a mixed layer", "geometry")
        table = pq.read_table(self.file("geometry"))
        write_partition(self.root, "geometry", self.model, self.target,
                        table.set_column(table.schema.get_field_index("config_id"), "config_id",
                                         pa.array(["0123456789ab"] * len(table))))
        rc, out = self.cli("report", "--model", self.model)
        pages = "".join(p.read_text(errors="replace") for p in self.root.glob("reports/**/*.html"))
        named = f"Layer {self.target}: its tables come from different runs" in pages
        outcome.detected = rc == 0 and named
        outcome.detection = (f"report exit {rc}; the page says 'Layer {self.target}: its tables come from different "
                             "runs'" if named else out[-300:])
        self.others(outcome, "geometry")
        self.repair(outcome)
        return outcome

    def damage_found_by_verify(self, table: str = "residuals") -> Outcome:
        """A bit flipped below the file system (the file's mtime put back): served until `verify` hashes it;
        from then on left out of the views and listed in damaged_partitions, and the next run recomputes it
        without --repair."""
        outcome = Outcome("bit flip, mtime kept", table)
        path = self.file(table)
        stat = path.stat()
        with path.open("r+b") as f:
            f.seek(stat.st_size // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x10]))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        before = self.served_rows(table)
        self.detect(outcome, table)
        after = self.served_rows(table)
        listed = catalog.query(self.root, "SELECT reason FROM damaged_partitions WHERE table_name = ? AND layer = ?",
                               [table, self.target])
        outcome.notes.append(f"rows of the layer served before verify: {before}, after: {after}; "
                             f"damaged_partitions: {listed['reason'].to_list()}")
        outcome.detected = outcome.detected and after == 0 and not listed.is_empty()
        self.others(outcome, table)
        self.repair(outcome)  # no --repair: the root remembers what verify found
        return outcome

    def sweep_cut_short(self) -> Outcome:
        """A sweep rerun killed while it writes (bench.faults `mid_write` on its geometry): the previous sweep
        is still served whole; the next run removes what the killed one left."""
        outcome = Outcome("sweep rerun killed", "sensitivity")
        sweep = ["sweep", "--model", self.model, "--layers", str(self.target), "--grid", '{"k": [32]}']
        rc, out = self.cli(*sweep)
        if rc != 0:
            outcome.notes.append(f"the first sweep failed (exit {rc}): {out[-800:]}")
            return outcome
        query = "SELECT * FROM sensitivity WHERE model = ? ORDER BY ALL"
        served = catalog.query(self.root, query, [self.model])
        rc, out = self.cli(*sweep, fault=("mid_write", "geometry"))
        now = catalog.query(self.root, query, [self.model])
        left = [str(p.relative_to(self.root)) for p in self.root.glob("sweeps/_next/*")]
        outcome.detected = rc == -9 and len(served) > 0 and now.equals(served)
        outcome.detection = (f"killed (exit {rc}); the previous sweep's {len(served)} sensitivity rows still served, "
                             f"unchanged; left behind: {left}")
        self.others(outcome, "geometry")
        self.repair(outcome)  # the next run removes the killed sweep's folder
        if list(self.root.glob("sweeps/_next/*")):
            outcome.notes.append("the killed sweep's folder is still there")
            outcome.identical = False
        return outcome


BAD_SETTINGS = (["--set", "seed=-1"], ["--set", "seed=1e23"], ["--set", "mlp_lr=-0.1"],
                ["--set", "bootstrap=1000000000"], ["--set", "device=cuda"])
BAD_TIMEOUTS = ("nan", "-1", "0", "inf")


def bad_settings(drill: Drill) -> list[dict[str, object]]:
    """Each bad setting given to a forced run of the drill's stored target layer, and each bad `sql
    --timeout`: its exit, its one line, how long it took and whether any stored file changed."""
    records = []
    for args in BAD_SETTINGS:
        start = time.perf_counter()
        rc, out = drill.cli("run", "--model", drill.model, "--layers", str(drill.target), "--force", *args, *drill.extra)
        said = [line for line in out.splitlines() if line.startswith("updatelens run:")]
        records.append({"input": " ".join(args), "exit": rc, "message": said[-1] if said else out[-300:],
                        "one_line": len(said) == 1, "seconds": round(time.perf_counter() - start, 1),
                        "touched": not drill.identical()[0]})
    for value in BAD_TIMEOUTS:
        rc, out = drill.cli("sql", "--timeout", value, "SELECT 1")
        said = [line for line in out.splitlines() if line.startswith("updatelens sql:")]  # after argparse's usage
        records.append({"input": f"sql --timeout {value}", "exit": rc, "message": said[-1] if said else out[-300:],
                        "one_line": len(said) == 1, "touched": False})
    return records


BAD_INPUTS = (["--layers", "4-3"], ["--layers", "4-3,7"], ["--layers", ""], ["--layers", "99"],
              ["--set", "nosuchfield=1"], ["--set", "k=abc"], ["--set", "classes=lowrank"])


def bad_roots_and_corpora(drill: Drill) -> list[dict[str, object]]:
    """A mistyped --data-root given to the reading commands, and corpus files that are no text: each
    refused in one line, nothing created."""
    import tempfile

    records = []
    missing = drill.root.parent / f"{drill.root.name}-no-such-root"
    shutil.rmtree(missing, ignore_errors=True)
    env = dict(os.environ, DAGSTER_HOME=str(drill.home), HF_HUB_OFFLINE="1")
    cli = [sys.executable, "-m", "updatelens.orchestration.cli"]
    for command in (["verify"], ["sql", "SELECT 1"], ["report"]):
        done = subprocess.run([*cli, *command, "--data-root", str(missing)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
        lines = done.stderr.strip().splitlines()
        records.append({"input": f"{command[0]} --data-root <missing>", "exit": done.returncode,
                        "message": lines[-1] if lines else "", "one_line": len(lines) == 1,
                        "created": missing.exists()})
    with tempfile.TemporaryDirectory() as tmp:
        fifo = Path(tmp) / "corpus.fifo"
        os.mkfifo(fifo)
        sparse = Path(tmp) / "huge.txt"
        with sparse.open("wb") as f:
            f.truncate(2 << 30)  # 2 GiB of nothing, on no disk space
        bad = {"bad-fifo": ("a FIFO", fifo), "bad-device": ("a device", Path("/dev/zero")),
               "bad-sparse": ("a 2 GiB sparse file", sparse)}
        registry = Path(tmp) / "registry.toml"  # the shipped models, and a text corpus for each bad file
        registry.write_text((REPO / "registry" / "registry.toml").read_text() + "".join(
            f'\n[corpora.{slug}]\nsource = "text"\npath = "{path}"\n' for slug, (_, path) in bad.items()))
        for slug, (name, _) in bad.items():
            root = Path(tmp) / "root"
            start = time.perf_counter()
            done = subprocess.run([*cli, "run", "--model", drill.model, "--corpus", slug, "--registry", str(registry),
                                   "--data-root", str(root)], cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=300)
            lines = done.stderr.strip().splitlines()
            records.append({"input": f"run --corpus <{name}>", "exit": done.returncode,
                            "message": lines[-1] if lines else "", "one_line": len(lines) == 1,
                            "seconds": round(time.perf_counter() - start, 1), "created": root.exists()})
    return records


def bad_inputs(drill: Drill) -> list[dict[str, object]]:
    """Each bad input to `run`, on a fresh root: its exit code, its message, whether anything was created."""
    records = []
    for args in BAD_INPUTS:
        root = drill.root.parent / f"{drill.root.name}-bad-input"
        shutil.rmtree(root, ignore_errors=True)
        env = dict(os.environ, DAGSTER_HOME=str(root / "home"), HF_HUB_OFFLINE="1")
        cmd = [sys.executable, "-m", "updatelens.orchestration.cli", "run", "--model", drill.model, *args,
               "--data-root", str(root)]
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        records.append({"input": " ".join(a if a else "''" for a in args), "exit": done.returncode,
                        "message": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "",
                        "created": root.exists()})
    return records


VERIFY_ONCE = ("import sys, time\nfrom updatelens.storage import catalog\nstart = time.perf_counter()\n"
               "catalog.verify_root(sys.argv[1])\nprint(time.perf_counter() - start)")


def verify_overhead(root: Path, pipeline_s: float | None, repeats: int = 3) -> dict[str, object]:
    """verify_root over the whole root, each time in a fresh process (in a process that has verified
    the root already, results are cached by size and mtime), against the pipeline time."""
    times = [float(subprocess.run([sys.executable, "-c", VERIFY_ONCE, str(root)], cwd=REPO, check=True,
                                  capture_output=True, text=True).stdout) for _ in range(repeats)]
    parquet = [p for p in root.rglob("*.parquet") if "_quarantine" not in p.parts]
    files, size = len(parquet), sum(p.stat().st_size for p in parquet)
    seconds = sorted(times)[len(times) // 2]
    record: dict[str, object] = {"verify_s": round(seconds, 2), "runs_s": [round(t, 2) for t in times],
                                 "files": files, "bytes": size}
    if pipeline_s:
        record.update(pipeline_s=pipeline_s, ratio=round(seconds / pipeline_s, 4), target="<= 0.05")
    return record


def show(records: list[dict[str, object]], changed: str) -> None:
    """One line per refused input: its exit, whether it said so in one line, whether it `changed` anything."""
    for item in records:
        print(f"{item['input']}: exit {item['exit']}, one line {item['one_line']}, {changed} {item[changed]}: "
              f"{item['message']}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="where to write the drill's record (JSON)")
    parser.add_argument("--data-root", type=Path, default=Path("data"))
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--layers", default="6-8", help="a range FIRST-LAST of stored layers the drill works on")
    parser.add_argument("--target", type=int, default=7, help="the layer that takes the faults")
    parser.add_argument("--pipeline-s", type=float, help="the root's pipeline time, for the verification overhead")
    parser.add_argument("--only", help="comma-separated subset: overhead, inputs, files, kills, placement, disk, "
                                       "concurrent, shape (a root's shape: spellings, links, mixed runs, copies; "
                                       "bad roots and corpora), trust (late failure, other weights, a report on a "
                                       "mixed layer, damage found by verify, a sweep cut short, bad settings)")
    args, extra = parser.parse_known_args()  # anything else (--registry, --set, ...) goes to `updatelens run`
    first, _, last = args.layers.partition("-")
    layers = list(range(int(first), int(last or first) + 1))
    drill = Drill(args.data_root.resolve(), args.model, layers, args.target, extra)
    only = set((args.only or "overhead,inputs,files,kills,placement,disk,concurrent,shape,trust").split(","))
    drill.snapshot()
    record: dict[str, Any] = {"model": args.model, "layers": layers, "target": args.target}
    if "overhead" in only:
        record["verify_overhead"] = verify_overhead(drill.root, args.pipeline_s)
        print(f"verify_root over the whole root: {record['verify_overhead']}", flush=True)
        args.out.write_text(json.dumps(record, indent=1))
    if "inputs" in only:
        record["bad_inputs"] = bad_inputs(drill)
        for item in record["bad_inputs"]:
            print(f"bad input {item['input']!r}: exit {item['exit']}, created {item['created']}: {item['message']}")
    outcomes: list[Outcome] = []

    def done(outcome: Outcome) -> None:
        outcomes.append(outcome)
        print(f"{outcome.fault:>18} {outcome.table:<20} {'ok' if outcome.ok else 'NOT OK'} "
              f"(repair {outcome.repair_s} s) {outcome.detection[:120]}", flush=True)
        args.out.write_text(json.dumps({**record, "outcomes": [{**asdict(o), "ok": o.ok} for o in outcomes]},
                                       indent=1))

    if "files" in only:
        for stage in STAGES:
            for fault in ("delete", "truncate", "bit flip"):
                done(drill.file_fault(fault, stage.tables[0]))
    if "kills" in only:
        done(drill.kill("SIGKILL mid-write", "mid_write"))
        done(drill.kill("SIGKILL before manifest", "before_manifest"))
        done(drill.kill("SIGKILL mid-replace", "mid_replace"))
    if "placement" in only:
        done(drill.misplaced())
        done(drill.stray())
        done(drill.missing_text())
        done(drill.broken_catalog())
        done(drill.abandoned_staging())
    if "disk" in only:
        if shutil.disk_usage(drill.root).total > 8 << 30:
            print("full disk: not run (the data root is not on a small file system; see --help)")
        else:
            done(drill.full_disk())
    if "concurrent" in only:
        done(drill.concurrent())
    if "shape" in only:
        record["bad_roots_and_corpora"] = bad_roots_and_corpora(drill)
        show(record["bad_roots_and_corpora"], "created")
        done(drill.second_spelling())
        done(drill.backup_folder())
        done(drill.symlinked_partition())
        done(drill.mixed_configuration())
        done(drill.copied_root())
    if "trust" in only:
        record["bad_settings"] = bad_settings(drill)
        show(record["bad_settings"], "touched")
        done(drill.late_failure())
        done(drill.other_weights())
        done(drill.mixed_report())
        done(drill.damage_found_by_verify())
        done(drill.sweep_cut_short())
    bad = [o for o in outcomes if not o.ok]
    print(f"{len(outcomes) - len(bad)} of {len(outcomes)} faults detected and repaired; record in {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
