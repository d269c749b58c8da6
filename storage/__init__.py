"""Where results live: hive-partitioned Parquet with atomic writes, and the DuckDB catalog over it.

Independent of Dagster and of the engine's internals: it stores and reads Arrow tables.
"""
