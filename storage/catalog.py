"""The DuckDB catalog: one view per table over its Parquet, plus `layer_summary`.

`layer_summary` is the public SQL interface: one row per (model, layer, fn_class, config_id).
Views are rebuilt after each materialization (and by `updatelens sql`), so they always cover
the partitions on disk; a view is created only for a table that has files.
"""

from __future__ import annotations

from pathlib import Path

import fcntl

import duckdb
import polars as pl

from storage.layout import TABLES, glob_pattern, has_files

CATALOG_FILE = "updatelens.duckdb"

LAYER_SUMMARY_GEOMETRY = """
SELECT model, layer, fn_class, config_id,
       any_value(model_revision) AS model_revision,
       any_value(corpus_slice) AS corpus_slice,
       any_value(k) AS k, any_value(rank) AS rank, any_value(dtype) AS dtype,
       any_value(code_version) AS code_version,
       count(*) AS n_tokens,
       median(rel_err) AS rel_err_median,
       avg(rel_err) AS rel_err_mean,
       median(cos_full_tok) AS cos_full_tok_median,
       median(cos_full_tok_map) AS cos_full_tok_map_median,
       median(cos_full_res) AS cos_full_res_median,
       median(angle_full_res) AS angle_full_res_median,
       avg(CASE WHEN angle_full_res > 60 THEN 1.0 ELSE 0.0 END) AS frac_res_angle_gt60,
       avg(proj_full_m16) AS proj_full_m16,
       avg(proj_tok_m16) AS proj_tok_m16,
       avg(proj_res_m16) AS proj_res_m16,
       any_value(m90_tok) AS m90_tok
FROM geometry
GROUP BY model, layer, fn_class, config_id
"""

LAYER_SUMMARY_FUNCTIONAL = """
SELECT model, layer, fn_class, config_id,
       max(CASE WHEN variant = 'patch' THEN kl_mean END) AS kl_mean,
       max(CASE WHEN variant = 'patch' THEN kl_median END) AS kl_median,
       max(CASE WHEN variant = 'patch' THEN spearman_relerr_kl END) AS spearman_relerr_kl,
       max(CASE WHEN variant = 'patch' THEN spearman_normres_kl END) AS spearman_normres_kl,
       max(CASE WHEN variant = 'random' THEN kl_mean END) AS kl_mean_random_control,
       max(CASE WHEN variant = 'crude' THEN kl_mean END) AS kl_mean_crude_control
FROM functional_summary
GROUP BY model, layer, fn_class, config_id
"""

FUNCTIONAL_COLUMNS = ("kl_mean", "kl_median", "spearman_relerr_kl", "spearman_normres_kl",
                      "kl_mean_random_control", "kl_mean_crude_control")


# The paper's findings (METHOD.md), each measured per (model, config) on the class with the lowest
# median relative error, with the threshold that decides whether it holds. Plain SQL over
# layer_summary and spectra, so a reader can see how every figure is derived.
FINDINGS_SQL = """
CREATE OR REPLACE VIEW findings AS
WITH per_class AS (
    SELECT model, config_id, fn_class, median(rel_err_median) AS err
    FROM layer_summary GROUP BY model, config_id, fn_class
), best AS (
    SELECT model, config_id, arg_min(fn_class, err) AS fn_class FROM per_class GROUP BY model, config_id
), b AS (
    SELECT ls.*, max(ls.layer) OVER (PARTITION BY ls.model, ls.config_id) + 1 AS n_layers
    FROM layer_summary ls JOIN best USING (model, config_id, fn_class)
), ranks AS (
    SELECT model, config_id,
           avg(CASE WHEN which = 'tok' THEN effective_rank END) AS rank_tok,
           avg(CASE WHEN which = 'full' THEN effective_rank END) AS rank_full,
           avg(CASE WHEN which = 'res' THEN effective_rank END) AS rank_res
    FROM (SELECT DISTINCT model, layer, config_id, fn_class, which, effective_rank FROM spectra)
    JOIN best USING (model, config_id, fn_class) GROUP BY model, config_id
), classes AS (
    SELECT model, config_id,
           max(CASE WHEN fn_class = 'diagonal' THEN err END) - max(CASE WHEN fn_class = 'lowrank' THEN err END) AS gap
    FROM per_class GROUP BY model, config_id
), depth AS (
    SELECT model, config_id,
           avg(CASE WHEN layer >= n_layers / 3 AND layer < 2 * n_layers / 3 THEN rel_err_median END)
         - avg(CASE WHEN layer < n_layers / 3 OR layer >= 2 * n_layers / 3 THEN rel_err_median END) AS gap
    FROM b GROUP BY model, config_id
)
SELECT model, config_id, best.fn_class, f.finding, f.statement, f.measure, f.value, f.threshold,
       CASE f.op WHEN '>=' THEN f.value >= f.bound ELSE f.value <= f.bound END AS holds
FROM (
    SELECT model, config_id, '1' AS finding, 'the full update is aligned with the tokenwise update' AS statement,
           'median over layers of median cos(Δ_full, Δ_tok), update form' AS measure,
           median(cos_full_tok_median) AS value, '>= 0.9' AS threshold, '>=' AS op, 0.9 AS bound
    FROM b GROUP BY model, config_id
    UNION ALL
    SELECT model, config_id, '1 map', 'the full update is aligned with the tokenwise update',
           'median over layers of median cos(y, T(x)), map form', median(cos_full_tok_map_median), '>= 0.9', '>=', 0.9
    FROM b GROUP BY model, config_id
    UNION ALL
    SELECT model, config_id, '2 angle', 'the residual deviates by large angles',
           'mean over layers of the share of tokens with angle(Δ_full, r) > 60°', avg(frac_res_angle_gt60),
           '>= 0.5', '>=', 0.5
    FROM b GROUP BY model, config_id
    UNION ALL
    SELECT model, config_id, '2 projection', 'the residual projects little onto the tokenwise subspace',
           'mean over layers of the projection energy of r on the top-16 tokenwise directions',
           avg(proj_res_m16), '<= 0.25', '<=', 0.25
    FROM b GROUP BY model, config_id
    UNION ALL
    SELECT model, config_id, '3', 'full and tokenwise updates are low-dimensional, the residual is not',
           'mean effective rank of Δ_full and Δ_tok over that of r (the larger of the two ratios)',
           greatest(rank_full, rank_tok) / rank_res, '<= 0.5', '<=', 0.5
    FROM ranks
    UNION ALL
    SELECT model, config_id, '4', 'approximation error predicts output perturbation',
           'median over layers of Spearman(relative error, KL)', median(spearman_relerr_kl), '>= 0.7', '>=', 0.7
    FROM b GROUP BY model, config_id
    UNION ALL
    SELECT model, config_id, '5', 'a diagonal map serves about as well as a low-rank one',
           'median relative error of diagonal minus that of lowrank', gap, '<= 0.05', '<=', 0.05
    FROM classes WHERE gap IS NOT NULL
    UNION ALL
    SELECT model, config_id, '6', 'middle layers have larger residuals',
           'mean median relative error of the middle third of layers minus the outer thirds', gap, '>= 0', '>=', 0.0
    FROM depth
) f JOIN best USING (model, config_id)
ORDER BY model, config_id, f.finding
"""


def catalog_path(root: Path) -> Path:
    return Path(root) / CATALOG_FILE


def view_sql(root: Path, table: str) -> str:
    pattern = glob_pattern(root, table).replace("'", "''")
    return (f"CREATE OR REPLACE VIEW {table} AS SELECT * FROM read_parquet('{pattern}', "
            f"hive_partitioning = true, union_by_name = true, "
            f"hive_types = {{'model': VARCHAR, 'layer': INTEGER}})")


def layer_summary_sql(has_functional: bool) -> str:
    if has_functional:
        return (f"CREATE OR REPLACE VIEW layer_summary AS SELECT g.*, "
                f"{', '.join('f.' + c for c in FUNCTIONAL_COLUMNS)} "
                f"FROM ({LAYER_SUMMARY_GEOMETRY}) g LEFT JOIN ({LAYER_SUMMARY_FUNCTIONAL}) f "
                f"USING (model, layer, fn_class, config_id) ORDER BY model, layer, fn_class")
    nulls = ", ".join(f"CAST(NULL AS DOUBLE) AS {c}" for c in FUNCTIONAL_COLUMNS)
    return (f"CREATE OR REPLACE VIEW layer_summary AS SELECT g.*, {nulls} "
            f"FROM ({LAYER_SUMMARY_GEOMETRY}) g ORDER BY model, layer, fn_class")


def create_views(con: duckdb.DuckDBPyConnection, root: Path) -> list[str]:
    """(Re)create on `con` the views of every table with files; drop the others."""
    present = [t for t in TABLES if has_files(Path(root), t)]
    for table in TABLES:
        if table in present:
            con.execute(view_sql(Path(root), table))
        else:
            con.execute(f"DROP VIEW IF EXISTS {table}")
    views = list(present)
    if "geometry" in present:
        con.execute(layer_summary_sql("functional_summary" in present))
        views.append("layer_summary")
    else:
        con.execute("DROP VIEW IF EXISTS layer_summary")
    if {"geometry", "functional_summary", "spectra"} <= set(present):
        con.execute(FINDINGS_SQL)
        views.append("findings")
    else:
        con.execute("DROP VIEW IF EXISTS findings")
    return views


def refresh(root: Path, db_path: Path | None = None) -> list[str]:
    """Rebuild the catalog file's views; returns the view names."""
    db_path = db_path or catalog_path(Path(root))
    db_path.parent.mkdir(parents=True, exist_ok=True)
    # One writer at a time: DuckDB allows a single read-write process per database file.
    with open(db_path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with duckdb.connect(str(db_path)) as con:
            return create_views(con, root)


def connect(root: Path) -> duckdb.DuckDBPyConnection:
    """An in-memory connection with the catalog's views: never blocked by a writer's file lock."""
    con = duckdb.connect()
    create_views(con, root)
    return con


def query(root: Path, sql: str) -> pl.DataFrame:
    """Run SQL over the stored tables; returns a polars frame (empty for statements without rows)."""
    with connect(root) as con:
        rel = con.sql(sql)
        return rel.pl() if rel is not None else pl.DataFrame()
